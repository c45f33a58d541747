import { useQuery } from '@tanstack/react-query'
import { api, unwrap } from './client'
import type { paths } from './gen/schema'

export type NodeList = paths['/api/v1/nodes']['get']['responses'][200]['content']['application/json']
export type NodeRead = NodeList[number]

export const NODES_REFETCH_MS = 5000

export const nodeKeys = {
  all: ['nodes'] as const,
  list: () => [...nodeKeys.all, 'list'] as const,
}

export async function fetchNodes(signal?: AbortSignal): Promise<NodeList> {
  return unwrap(await api.GET('/api/v1/nodes', { signal }))
}

export function useNodes(options: { refetchIntervalMs?: number | false; enabled?: boolean } = {}) {
  return useQuery({
    queryKey: nodeKeys.list(),
    queryFn: ({ signal }) => fetchNodes(signal),
    refetchInterval: options.refetchIntervalMs ?? NODES_REFETCH_MS,
    enabled: options.enabled ?? true,
  })
}
