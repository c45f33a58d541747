import { keepPreviousData, useQuery } from '@tanstack/react-query'
import { api, unwrap } from './client'
import type { paths } from './gen/schema'

type ListJobsOp = paths['/api/v1/jobs']['get']
export type JobListParams = NonNullable<ListJobsOp['parameters']['query']>
export type JobList = ListJobsOp['responses'][200]['content']['application/json']
export type JobRead = JobList['items'][number]
export type JobState = JobRead['state']

export const JOBS_REFETCH_MS = 3000

export const jobKeys = {
  all: ['jobs'] as const,
  lists: () => [...jobKeys.all, 'list'] as const,
  list: (params: JobListParams = {}) => [...jobKeys.lists(), params] as const,
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
