import { beforeEach, describe, expect, it, vi } from 'vitest'
import { failedChecks, nodeAction } from './nodes'
import { setToken } from './token'

function json(body: unknown, status = 200): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } })
}

describe('node actions through the generated client', () => {
  beforeEach(() => setToken('admin-token'))

  it('drains with the reason in the body, to the node named in the path, with the token', async () => {
    const fetch = vi.spyOn(globalThis, 'fetch').mockResolvedValue(json({ name: 'n 1', state: 'draining' }))
    await nodeAction('n 1', { kind: 'drain', reason: 'bad GPU 3' })
    const req = fetch.mock.calls[0][0] as Request
    expect(req.method).toBe('POST')
    expect(new URL(req.url, 'http://x').pathname).toBe('/api/v1/nodes/n%201/drain')
    expect(req.headers.get('Authorization')).toBe('Bearer admin-token')
    expect(await req.json()).toEqual({ reason: 'bad GPU 3' })
    fetch.mockRestore()
  })

  it('turns a refused undrain (409) into its message and failed checks', async () => {
    const refused = { detail: { message: 'validation failed', failed_checks: [{ name: 'gemm', value: 100, threshold: 500, unit: 'TFLOPS', detail: '' }] } }
    const fetch = vi.spyOn(globalThis, 'fetch').mockResolvedValue(json(refused, 409))
    const error = await nodeAction('n1', { kind: 'undrain', force: false }).catch((e: unknown) => e)
    expect(await (fetch.mock.calls[0][0] as Request).json()).toEqual({ force: false })
    expect(failedChecks(error)).toEqual({ message: 'validation failed', checks: refused.detail.failed_checks })
    expect(failedChecks(new Error('other'))).toBeNull()
    fetch.mockRestore()
  })
})
