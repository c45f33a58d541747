import { useMutation, useQuery, useQueryClient } from '@tanstack/react-query'
import { ApiError, api, unwrap } from './client'
import type { components, paths } from './gen/schema'

export type NodeList = paths['/api/v1/nodes']['get']['responses'][200]['content']['application/json']
export type NodeRead = NodeList[number]
export type NodeDetail = paths['/api/v1/nodes/{name}']['get']['responses'][200]['content']['application/json']
export type NodeEvent = NodeDetail['events'][number]
export type ValidationRun = paths['/api/v1/nodes/{name}/validations']['get']['responses'][200]['content']['application/json'][number]
export type ValidationCheck = ValidationRun['checks'][number]
type UndrainRefused = paths['/api/v1/nodes/{name}/undrain']['post']['responses'][409]['content']['application/json']
export type FailedCheck = components['schemas']['FailedCheckRead']

export const NODES_REFETCH_MS = 5000

export const nodeKeys = {
  all: ['nodes'] as const,
  list: () => [...nodeKeys.all, 'list'] as const,
  detail: (name: string) => [...nodeKeys.all, 'detail', name] as const,
  validations: (name: string) => [...nodeKeys.all, 'validations', name] as const,
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

/** The node with its state, reason and events (oldest first). */
export function useNode(name: string) {
  return useQuery({
    queryKey: nodeKeys.detail(name),
    queryFn: async ({ signal }) => unwrap(await api.GET('/api/v1/nodes/{name}', { params: { path: { name } }, signal })),
    refetchInterval: 2000,
  })
}

/** The node's validation runs, newest first. */
export function useNodeValidations(name: string) {
  return useQuery({
    queryKey: nodeKeys.validations(name),
    queryFn: async ({ signal }) =>
      unwrap(await api.GET('/api/v1/nodes/{name}/validations', { params: { path: { name } }, signal })),
    refetchInterval: 5000,
  })
}

/** `{"detail": {"message", "failed_checks"}}` of a refused undrain (409), or null. */
export function failedChecks(error: unknown): { message: string; checks: FailedCheck[] } | null {
  if (!(error instanceof ApiError) || error.status !== 409) return null
  const d = (error.detail as Partial<UndrainRefused> | undefined)?.detail
  if (!d || typeof d !== 'object') return null
  return { message: d.message ?? 'refused', checks: d.failed_checks ?? [] }
}

export type NodeAction = { kind: 'drain'; reason: string } | { kind: 'undrain'; force: boolean } | { kind: 'validate' }

export async function nodeAction(name: string, a: NodeAction): Promise<unknown> {
  const params = { path: { name } }
  if (a.kind === 'drain') return unwrap(await api.POST('/api/v1/nodes/{name}/drain', { params, body: { reason: a.reason } }))
  if (a.kind === 'undrain') return unwrap(await api.POST('/api/v1/nodes/{name}/undrain', { params, body: { force: a.force } }))
  return unwrap(await api.POST('/api/v1/nodes/{name}/validate', { params, body: { level: 'full' } }))
}

export function useNodeAction(name: string) {
  const qc = useQueryClient()
  return useMutation({
    mutationFn: (a: NodeAction) => nodeAction(name, a),
    onSettled: () => {
      qc.invalidateQueries({ queryKey: nodeKeys.detail(name) })
      qc.invalidateQueries({ queryKey: nodeKeys.validations(name) })
      qc.invalidateQueries({ queryKey: nodeKeys.list() })
    },
  })
}
