import { useQuery } from '@tanstack/react-query'
import { api, unwrap } from './client'
import type { paths } from './gen/schema'

export type Me = paths['/api/v1/me']['get']['responses'][200]['content']['application/json']

export const meKeys = {
  all: ['me'] as const,
}

export async function fetchMe(signal?: AbortSignal): Promise<Me> {
  return unwrap(await api.GET('/api/v1/me', { signal }))
}

export function useMe(enabled = true) {
  return useQuery({ queryKey: meKeys.all, queryFn: ({ signal }) => fetchMe(signal), enabled })
}
