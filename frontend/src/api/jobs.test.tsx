import { QueryClientProvider } from '@tanstack/react-query'
import { render, renderHook, screen, waitFor } from '@testing-library/react'
import type { ReactNode } from 'react'
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest'
import { Dashboard } from '../routes/Dashboard'
import { ApiError } from './client'
import { jobKeys, useJobs, type JobList, type JobRead } from './jobs'
import { createQueryClient } from './queryClient'
import { setToken } from './token'

function job(overrides: Partial<JobRead> = {}): JobRead {
  return {
    id: 7,
    name: 'train-llm',
    user: 'alice',
    group: 'research',
    state: 'running',
    priority: 'HIGH',
    submitted_priority: 'HIGH',
    nodes: 2,
    gpus_per_node: 8,
    job_type: 'torch',
    command: ['python', 'train.py'],
    env: {},
    tags: [],
    allow_cross_zone: false,
    max_runtime_s: null,
    suspend_grace_s: 60,
    log_watchdog_s: null,
    created_at: '2026-01-01T00:00:00Z',
    started_at: '2026-01-01T00:00:05Z',
    finished_at: null,
    exit_code: null,
    failure_reason: null,
    attempt: 1,
    suspensions: 0,
    restarts: 0,
    held: false,
    placement: [],
    placement_reason: null,
    pending_reason: null,
    last_checkpoint: null,
    progress: null,
    lost_gpu_s: 0,
    events: [],
    ...overrides,
  }
}

const JOBS: JobList = { total: 1, items: [job()] }

function json(body: unknown, status = 200): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } })
}

function wrapper({ children }: { children: ReactNode }) {
  return <QueryClientProvider client={createQueryClient()}>{children}</QueryClientProvider>
}

describe('useJobs', () => {
  const fetchMock = vi.fn<typeof fetch>()

  beforeEach(() => {
    vi.stubGlobal('fetch', fetchMock)
    fetchMock.mockReset()
    setToken('tok-123')
  })
  afterEach(() => {
    vi.unstubAllGlobals()
    setToken('')
  })

  it('fetches /api/v1/jobs with the bearer token and query params', async () => {
    fetchMock.mockResolvedValue(json(JOBS))

    const { result } = renderHook(() => useJobs({ state: ['running', 'starting'], limit: 10 }, { refetchIntervalMs: false }), {
      wrapper,
    })

    await waitFor(() => expect(result.current.isSuccess).toBe(true))
    expect(result.current.data).toEqual(JOBS)
    expect(fetchMock).toHaveBeenCalledTimes(1)
    const request = fetchMock.mock.calls[0][0] as Request
    const url = new URL(request.url)
    expect(url.pathname).toBe('/api/v1/jobs')
    expect(url.searchParams.getAll('state')).toEqual(['running', 'starting'])
    expect(url.searchParams.get('limit')).toBe('10')
    expect(request.headers.get('Authorization')).toBe('Bearer tok-123')
  })

  it('surfaces a 401 as an ApiError without retrying', async () => {
    fetchMock.mockResolvedValue(json({ detail: 'invalid token' }, 401))

    const { result } = renderHook(() => useJobs({}, { refetchIntervalMs: false }), { wrapper })

    await waitFor(() => expect(result.current.isError).toBe(true))
    expect(result.current.error).toBeInstanceOf(ApiError)
    expect((result.current.error as ApiError).status).toBe(401)
    expect(result.current.error?.message).toBe('401: invalid token')
    expect(fetchMock).toHaveBeenCalledTimes(1)
  })

  it('keys lists by their parameters', () => {
    expect(jobKeys.list({ state: ['queued'] })).toEqual(['jobs', 'list', { state: ['queued'] }])
    expect(jobKeys.list({ state: ['queued'] })).not.toEqual(jobKeys.list({ state: ['running'] }))
  })
})

describe('Dashboard', () => {
  beforeEach(() => setToken('tok-123'))
  afterEach(() => {
    vi.unstubAllGlobals()
    setToken('')
  })

  it('renders the jobs and nodes tables from the API', async () => {
    vi.stubGlobal(
      'fetch',
      vi.fn<typeof fetch>(async (input) => {
        const path = new URL((input as Request).url).pathname
        if (path === '/api/v1/jobs') return json(JOBS)
        if (path === '/api/v1/nodes')
          return json([{ name: 'gpu-a1-01', zone: 'A', leaf: 'A1', gpus: 8, free_gpus: 0, state: 'ready', state_reason: '', running_jobs: [7] }])
        return json({ detail: 'not found' }, 404)
      }),
    )

    render(<Dashboard />, { wrapper })

    expect(await screen.findByText('train-llm')).toBeTruthy()
    expect(await screen.findByText('gpu-a1-01')).toBeTruthy()
    expect(screen.getByText('2 × 8')).toBeTruthy()
    expect(screen.getByText('0 / 8')).toBeTruthy()
  })

  it('asks for a token when none is stored, and calls nothing', () => {
    setToken('')
    const fetchMock = vi.fn<typeof fetch>()
    vi.stubGlobal('fetch', fetchMock)
    render(<Dashboard />, { wrapper })
    expect(screen.getByText(/Enter an API token/)).toBeTruthy()
    expect(fetchMock).not.toHaveBeenCalled()
  })
})
