import { keepPreviousData, useMutation, useQuery, useQueryClient } from '@tanstack/react-query'
import { api, unwrap } from './client'
import type { paths } from './gen/schema'

type ListJobsOp = paths['/api/v1/jobs']['get']
export type JobListParams = NonNullable<ListJobsOp['parameters']['query']>
export type JobList = ListJobsOp['responses'][200]['content']['application/json']
export type JobRead = JobList['items'][number]
export type JobState = JobRead['state']
export type JobCreate = paths['/api/v1/jobs']['post']['requestBody']['content']['application/json']
export type JobMetrics = paths['/api/v1/jobs/{job_id}/metrics']['get']['responses'][200]['content']['application/json']
export type JobAction = 'cancel' | 'suspend' | 'resume'

export const JOBS_REFETCH_MS = 3000
export const JOB_REFETCH_MS = 2000
/** The list shows the newest this many jobs that match the server-side filters. */
export const JOBS_PAGE = 1000
/** ...after a first screenful of this many. */
export const JOBS_FIRST = 50

export const jobKeys = {
  all: ['jobs'] as const,
  lists: () => [...jobKeys.all, 'list'] as const,
  list: (params: JobListParams = {}) => [...jobKeys.lists(), params] as const,
  detail: (id: number) => [...jobKeys.all, 'detail', id] as const,
  metrics: (id: number) => [...jobKeys.all, 'metrics', id] as const,
}

export async function fetchJobs(params: JobListParams = {}, signal?: AbortSignal): Promise<JobList> {
  return unwrap(await api.GET('/api/v1/jobs', { params: { query: params }, signal }))
}

export function useJobs(params: JobListParams = {}, options: { refetchIntervalMs?: number | false; enabled?: boolean } = {}) {
  return useQuery({
    queryKey: jobKeys.list(params),
    queryFn: ({ signal }) => fetchJobs(params, signal),
    refetchInterval: options.refetchIntervalMs ?? JOBS_REFETCH_MS,
    placeholderData: keepPreviousData,
    enabled: options.enabled ?? true,
  })
}

export function useJob(id: number) {
  return useQuery({
    queryKey: jobKeys.detail(id),
    queryFn: async ({ signal }) => unwrap(await api.GET('/api/v1/jobs/{job_id}', { params: { path: { job_id: id } }, signal })),
    refetchInterval: JOB_REFETCH_MS,
  })
}

export function useJobMetrics(id: number) {
  return useQuery({
    queryKey: jobKeys.metrics(id),
    queryFn: async ({ signal }) =>
      unwrap(await api.GET('/api/v1/jobs/{job_id}/metrics', { params: { path: { job_id: id }, query: { window: 'day' } }, signal })),
    refetchInterval: 10_000,
  })
}

export async function submitJob(body: JobCreate): Promise<JobRead> {
  return unwrap(await api.POST('/api/v1/jobs', { body }))
}

export async function jobAction(id: number, action: JobAction): Promise<JobRead> {
  const path = `/api/v1/jobs/{job_id}/${action}` as const
  return unwrap(await api.POST(path, { params: { path: { job_id: id } } }))
}

export function useJobAction(id: number) {
  const qc = useQueryClient()
  return useMutation({
    mutationFn: (action: JobAction) => jobAction(id, action),
    onSuccess: (job) => {
      qc.setQueryData(jobKeys.detail(id), job)
      qc.invalidateQueries({ queryKey: jobKeys.lists() })
    },
  })
}

/** FastAPI 422 details as {field: message}, keyed by the first body field of `loc`. */
export function fieldErrors(detail: unknown): Record<string, string> {
  const out: Record<string, string> = {}
  const items = detail && typeof detail === 'object' && 'detail' in detail ? (detail as { detail: unknown }).detail : null
  if (!Array.isArray(items)) return out
  for (const item of items) {
    if (!item || typeof item !== 'object') continue
    const loc = (item as { loc?: unknown[] }).loc ?? []
    const msg = String((item as { msg?: unknown }).msg ?? 'invalid')
    const field = loc.find((part, i) => i > 0 && typeof part === 'string') ?? (loc.length === 1 ? 'body' : '')
    const key = String(field || 'body')
    out[key] = out[key] ? `${out[key]}; ${msg}` : msg
  }
  return out
}
