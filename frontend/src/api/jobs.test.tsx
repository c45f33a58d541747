import { QueryClientProvider } from '@tanstack/react-query'
import { fireEvent, render, renderHook, screen, waitFor } from '@testing-library/react'
import type { ReactNode } from 'react'
import { MemoryRouter } from 'react-router'
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest'
import { App } from '../App'
import { JobsTable } from '../components/Jobs/JobsTable'
import { groupTree } from '../components/Nodes/FatTree'
import { formatGpus, parseEnv, splitCommand } from '../components/ui/format'
import type { ClusterNode } from './metrics'
import { ApiError } from './client'
import { fieldErrors, jobKeys, useJobs, type JobList, type JobRead } from './jobs'
import { createQueryClient } from './queryClient'
import { setToken } from './token'
import { Timeline, timelineLabel } from '../routes/JobPage'

function job(overrides: Partial<JobRead> = {}): JobRead {
  return {
    id: 7, name: 'train-llm', user: 'alice', group: 'research', state: 'running', priority: 'HIGH',
    submitted_priority: 'HIGH', nodes: 2, gpus_per_node: 8, job_type: 'torch', command: ['python', 'train.py'],
    env: {}, tags: [], allow_cross_zone: false, max_runtime_s: null, suspend_grace_s: 60, log_watchdog_s: null,
    created_at: '2026-01-01T00:00:00Z', started_at: '2026-01-01T00:00:05Z', finished_at: null, exit_code: null,
    failure_reason: null, attempt: 1, suspensions: 0, restarts: 0, held: false, placement: [], placement_reason: null,
    pending_reason: null, last_checkpoint: null, progress: null, lost_gpu_s: 0, events: [],
    ...overrides,
  }
}

const JOBS: JobList = { total: 1, total_exact: true, items: [job()] }

function json(body: unknown, status = 200): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } })
}

function wrapper({ children }: { children: ReactNode }) {
  return <QueryClientProvider client={createQueryClient()}>{children}</QueryClientProvider>
}

function renderApp(path: string) {
  return render(
    <QueryClientProvider client={createQueryClient()}>
      <MemoryRouter initialEntries={[path]}><App /></MemoryRouter>
    </QueryClientProvider>,
  )
}

/** A fetch stub answering by path. */
function routes(table: Record<string, (req: Request) => Response>) {
  return vi.spyOn(globalThis, 'fetch').mockImplementation(async (input: RequestInfo | URL, init?: RequestInit) => {
    const req = input instanceof Request ? input : new Request(new URL(String(input), 'http://x'), init)
    const path = new URL(req.url, 'http://x').pathname
    const handler = table[path]
    return handler ? handler(req) : json({ detail: 'not found' }, 404)
  })
}

describe('useJobs', () => {
  beforeEach(() => setToken('secret-token'))

  it('sends the bearer token and the filters, and returns the list', async () => {
    const fetch = routes({ '/api/v1/jobs': () => json(JOBS) })
    const { result } = renderHook(() => useJobs({ state: ['running'], user: 'alice' }, { refetchIntervalMs: false }), { wrapper })
    await waitFor(() => expect(result.current.isSuccess).toBe(true))
    expect(result.current.data).toEqual(JOBS)
    const req = fetch.mock.calls[0][0] as Request
    expect(req.headers.get('Authorization')).toBe('Bearer secret-token')
    const url = new URL(req.url)
    expect(url.searchParams.getAll('state')).toEqual(['running'])
    expect(url.searchParams.get('user')).toBe('alice')
  })

  it('surfaces an error response as an ApiError with the status and does not retry a 401', async () => {
    const fetch = routes({ '/api/v1/jobs': () => json({ detail: 'invalid token' }, 401) })
    const { result } = renderHook(() => useJobs({}, { refetchIntervalMs: false }), { wrapper })
    await waitFor(() => expect(result.current.isError).toBe(true))
    expect(result.current.error).toBeInstanceOf(ApiError)
    expect((result.current.error as ApiError).status).toBe(401)
    expect(fetch).toHaveBeenCalledTimes(1)
  })

  it('keys lists by their parameters', () => {
    expect(jobKeys.list({ state: ['queued'] })).not.toEqual(jobKeys.list({ state: ['running'] }))
  })
})

describe('sign in', () => {
  afterEach(() => vi.restoreAllMocks())

  it('says so when the token is wrong and keeps it out of storage', async () => {
    routes({ '/api/v1/me': () => json({ detail: 'invalid token' }, 401) })
    renderApp('/jobs')
    fireEvent.change(screen.getByLabelText('API token'), { target: { value: 'wrong' } })
    fireEvent.click(screen.getByRole('button', { name: 'Sign in' }))
    expect((await screen.findByRole('alert')).textContent).toContain('not accepted')
    expect(window.localStorage.getItem('hai.token')).toBeNull()
  })

  it('shows the navigation and Sign out once signed in', async () => {
    routes({ '/api/v1/me': () => json({ name: 'alice', group: 'vision', is_admin: false }), '/api/v1/jobs': () => json(JOBS) })
    renderApp('/jobs')
    fireEvent.change(screen.getByLabelText('API token'), { target: { value: 'good' } })
    fireEvent.click(screen.getByRole('button', { name: 'Sign in' }))
    for (const name of ['Jobs', 'Submit', 'Cluster', 'Nodes', 'Usage']) expect(await screen.findByRole('link', { name })).toBeTruthy()
    expect(screen.getByRole('button', { name: 'Sign out' })).toBeTruthy()
    expect((await screen.findByRole('link', { name: 'train-llm' })).getAttribute('href')).toBe('/jobs/7')
  })
})

describe('jobs table', () => {
  it('renders only a window of 10,000 rows and sorts by a column', async () => {
    const many = Array.from({ length: 10_000 }, (_, i) => job({ id: i + 1, name: `job-${i + 1}`, user: i % 2 ? 'bob' : 'alice' }))
    const { container } = render(<MemoryRouter><JobsTable jobs={many} height={400} /></MemoryRouter>)
    await waitFor(() => expect(container.querySelectorAll('tbody tr[data-job-id]').length).toBeGreaterThan(5))
    const rows = container.querySelectorAll('tbody tr[data-job-id]')
    expect(rows.length).toBeLessThan(100)
    expect(rows[0].getAttribute('data-job-id')).toBe('10000') // newest first by default
    fireEvent.click(screen.getByRole('button', { name: /^ID/ }))
    expect(container.querySelector('tbody tr[data-job-id]')!.getAttribute('data-job-id')).toBe('1')
  })
})

describe('submit form', () => {
  beforeEach(() => setToken('t'))
  afterEach(() => vi.restoreAllMocks())

  it('shows the API validation error beside the field it concerns', async () => {
    routes({
      '/api/v1/me': () => json({ name: 'alice', group: 'vision', is_admin: false }),
      '/api/v1/jobs': () => json({ detail: [{ loc: ['body', 'gpus_per_node'], msg: 'Input should be less than or equal to 8', type: 'x' }] }, 422),
    })
    renderApp('/submit')
    fireEvent.change(await screen.findByLabelText('Name'), { target: { value: 'x' } })
    fireEvent.change(screen.getByLabelText('Command'), { target: { value: 'echo hi' } })
    fireEvent.change(screen.getByLabelText('GPUs per node'), { target: { value: '9' } })
    fireEvent.click(screen.getByRole('button', { name: 'Submit' }))
    const err = await screen.findByText('Input should be less than or equal to 8')
    expect(err.id).toBe('f-gpus-error')
    expect(screen.getByLabelText('GPUs per node').getAttribute('aria-invalid')).toBe('true')
  })
})

describe('helpers', () => {
  it('maps 422 locs to fields', () => {
    expect(fieldErrors({ detail: [{ loc: ['body', 'env', 'A=B'], msg: 'bad' }, { loc: ['body', 'name'], msg: 'short' }] }))
      .toEqual({ env: 'bad', name: 'short' })
  })
  it('splits commands and parses KEY=VALUE lines', () => {
    expect(splitCommand(`python -c "print('a b')" x`)).toEqual(['python', '-c', "print('a b')", 'x'])
    expect(parseEnv('A=1\n\nB=x=y')).toEqual({ env: { A: '1', B: 'x=y' } })
    expect(parseEnv('nope')).toEqual({ error: 'line 1: expected KEY=VALUE, got "nope"' })
  })
  it('names timeline steps', () => {
    expect(timelineLabel(null, 'queued', false)).toBe('queued')
    expect(timelineLabel('running', 'suspending', false)).toBe('suspend requested')
    expect(timelineLabel('suspending', 'queued', false)).toBe('suspended')
    expect(timelineLabel('queued', 'queued', true)).toBe('resume requested')
    expect(timelineLabel('queued', 'starting', true)).toBe('resumed')
    expect(timelineLabel('running', 'cancelled', true)).toBe('finished (cancelled)')
  })
  it('shows a placement\'s GPUs as a count and ranges', () => {
    expect(formatGpus([3, 0, 1, 2])).toBe('4 (GPU 0-3)')
    expect(formatGpus([1, 5, 6])).toBe('3 (GPU 1, 5-6)')
    expect(formatGpus([])).toBe('0')
  })
  it('puts the reported checkpoint in its place in the timeline', () => {
    const at = (s: number) => new Date(Date.UTC(2026, 0, 1, 0, 0, s)).toISOString()
    const j = job({
      events: [
        { at: at(0), from_state: null, to_state: 'queued', reason: '' },
        { at: at(10), from_state: 'running', to_state: 'suspending', reason: 'HIGH job 9' },
        { at: at(30), from_state: 'suspending', to_state: 'queued', reason: '' },
      ],
      last_checkpoint: { at: Date.UTC(2026, 0, 1, 0, 0, 20) / 1000, path: '/ckpt/step-500', step: 500, duration_s: 2.5 },
    })
    render(<Timeline job={j} />)
    const items = screen.getAllByRole('listitem').map((li) => li.querySelector('strong')?.textContent)
    expect(items).toEqual(['queued', 'suspend requested', 'checkpoint reported', 'suspended'])
    expect(screen.getByText(/step 500, \/ckpt\/step-500/)).toBeTruthy()
  })
  it('groups nodes by zone and leaf in natural order', () => {
    const n = (name: string, zone: string, leaf: string) => ({ name, zone, leaf }) as ClusterNode
    const tree = groupTree([n('n10', 'B', 'L2'), n('n2', 'A', 'L10'), n('n1', 'A', 'L2')])
    expect(tree.map((z) => [z.name, z.leaves.map((l) => [l.name, l.nodes.map((x) => x.name)])])).toEqual([
      ['A', [['L2', ['n1']], ['L10', ['n2']]]], ['B', [['L2', ['n10']]]],
    ])
  })
})

describe('jobs page total', () => {
  beforeEach(() => setToken('t'))
  afterEach(() => vi.restoreAllMocks())

  it('says "more than" when the server counted only up to its cap (total_exact false)', async () => {
    routes({
      '/api/v1/me': () => json({ name: 'alice', group: 'vision', is_admin: false }),
      '/api/v1/jobs': () => json({ total: 10_000, total_exact: false, items: [job()] }),
    })
    renderApp('/jobs')
    expect(await screen.findByText('newest 1 of more than 10,000 jobs (narrow with the filters)')).toBeTruthy()
  })

  it('gives an exact total as it is', async () => {
    routes({
      '/api/v1/me': () => json({ name: 'alice', group: 'vision', is_admin: false }),
      '/api/v1/jobs': () => json({ total: 1234, total_exact: true, items: [job()] }),
    })
    renderApp('/jobs')
    expect(await screen.findByText('newest 1 of 1,234 jobs (narrow with the filters)')).toBeTruthy()
  })
})
