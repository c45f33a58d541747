// Node health endpoints of issue 10 (node detail with events, drain, undrain, validate,
// validation runs). HAND-WRITTEN against that REST contract because the endpoints are
// not in the generated schema yet; once they are, regenerate (`make openapi`) and replace these
// types with `paths[...]` ones like the other modules.
import { useMutation, useQuery, useQueryClient } from '@tanstack/react-query'
import { ApiError } from './client'
import { nodeKeys } from './nodes'
import { getToken } from './token'

export interface NodeEvent {
  at: string
  from_state?: string | null
  to_state: string
  reason?: string
  actor?: string | null
  [extra: string]: unknown
}

export interface NodeDetail {
  name: string
  zone: string
  leaf: string
  gpus: number
  free_gpus?: number
  state: string
  state_reason: string
  running_jobs?: number[]
  last_heartbeat_at?: string | null
  events: NodeEvent[]
  [extra: string]: unknown
}

export interface FailedCheck {
  name: string
  value?: number | string | null
  threshold?: number | string | null
  unit?: string | null
  detail?: string | null
}

export interface CheckResult extends FailedCheck {
  result?: string
  status?: string
  critical?: boolean
  level?: string
}

export interface ValidationRun {
  id: number
  node?: string
  status?: string
  result?: string
  started_at?: string | null
  finished_at?: string | null
  created_at?: string | null
  checks?: CheckResult[]
  [extra: string]: unknown
}

async function call<T>(method: string, path: string, body?: unknown, signal?: AbortSignal): Promise<T> {
  const headers: Record<string, string> = { Accept: 'application/json' }
  const token = getToken()
  if (token) headers.Authorization = `Bearer ${token}`
  if (body !== undefined) headers['Content-Type'] = 'application/json'
  const res = await globalThis.fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), signal })
  const text = await res.text()
  const data = text ? JSON.parse(text) : undefined
  if (!res.ok) throw new ApiError(res.status, data)
  return data as T
}

/** `{"detail": {"message", "failed_checks"}}` of a refused undrain, or null. */
export function failedChecks(error: unknown): { message: string; checks: FailedCheck[] } | null {
  if (!(error instanceof ApiError) || error.status !== 409) return null
  const d = (error.detail as { detail?: { message?: string; failed_checks?: FailedCheck[] } } | undefined)?.detail
  if (!d || typeof d !== 'object') return null
  return { message: d.message ?? 'refused', checks: d.failed_checks ?? [] }
}

export const nodeHealthKeys = {
  detail: (name: string) => [...nodeKeys.all, 'detail', name] as const,
  validations: (name: string) => [...nodeKeys.all, 'validations', name] as const,
}

const enc = encodeURIComponent

export function useNode(name: string) {
  return useQuery({
    queryKey: nodeHealthKeys.detail(name),
    queryFn: ({ signal }) => call<NodeDetail>('GET', `/api/v1/nodes/${enc(name)}`, undefined, signal),
    refetchInterval: 2000,
  })
}

export function useNodeValidations(name: string) {
  return useQuery({
    queryKey: nodeHealthKeys.validations(name),
    queryFn: ({ signal }) => call<ValidationRun[]>('GET', `/api/v1/nodes/${enc(name)}/validations`, undefined, signal),
    refetchInterval: 5000,
  })
}

export type NodeAction = { kind: 'drain'; reason: string } | { kind: 'undrain'; force: boolean } | { kind: 'validate' }

export function useNodeAction(name: string) {
  const qc = useQueryClient()
  return useMutation({
    mutationFn: (a: NodeAction) => {
      const path = `/api/v1/nodes/${enc(name)}/${a.kind}`
      if (a.kind === 'drain') return call<unknown>('POST', path, { reason: a.reason })
      if (a.kind === 'undrain') return call<unknown>('POST', path, { force: a.force })
      return call<unknown>('POST', path)
    },
    onSettled: () => {
      qc.invalidateQueries({ queryKey: nodeHealthKeys.detail(name) })
      qc.invalidateQueries({ queryKey: nodeHealthKeys.validations(name) })
      qc.invalidateQueries({ queryKey: nodeKeys.list() })
    },
  })
}
