import { useQuery } from '@tanstack/react-query'
import { api, unwrap } from './client'
import type { components, paths } from './gen/schema'

export type Window = components['schemas']['Window']
export type MetricSeries = paths['/api/v1/cluster/utilisation']['get']['responses'][200]['content']['application/json']
export type MetricPoint = MetricSeries['points'][number]
export type ClusterSummary = paths['/api/v1/cluster/summary']['get']['responses'][200]['content']['application/json']
export type IdleAllocation = paths['/api/v1/cluster/idle-allocations']['get']['responses'][200]['content']['application/json'][number]
export type NodeMetrics = paths['/api/v1/nodes/{name}/metrics']['get']['responses'][200]['content']['application/json']

export const metricKeys = {
  all: ['metrics'] as const,
  summary: () => [...metricKeys.all, 'summary'] as const,
  cluster: (w: Window) => [...metricKeys.all, 'cluster', w] as const,
  idle: () => [...metricKeys.all, 'idle'] as const,
  node: (name: string, w: Window) => [...metricKeys.all, 'node', name, w] as const,
}

export function useClusterSummary() {
  return useQuery({
    queryKey: metricKeys.summary(),
    queryFn: async ({ signal }) => unwrap(await api.GET('/api/v1/cluster/summary', { signal })),
    refetchInterval: 5000,
  })
}

export function useClusterUtilisation(window: Window, enabled = true) {
  return useQuery({
    enabled,
    queryKey: metricKeys.cluster(window),
    queryFn: async ({ signal }) => unwrap(await api.GET('/api/v1/cluster/utilisation', { params: { query: { window } }, signal })),
    refetchInterval: 15_000,
  })
}

export function useIdleAllocations(enabled = true) {
  return useQuery({
    enabled,
    queryKey: metricKeys.idle(),
    queryFn: async ({ signal }) => unwrap(await api.GET('/api/v1/cluster/idle-allocations', { signal })),
    refetchInterval: 15_000,
  })
}

export function useNodeMetrics(name: string, window: Window = 'hour') {
  return useQuery({
    queryKey: metricKeys.node(name, window),
    queryFn: async ({ signal }) =>
      unwrap(await api.GET('/api/v1/nodes/{name}/metrics', { params: { path: { name }, query: { window } }, signal })),
    refetchInterval: 15_000,
  })
}

export type ClusterNode = paths['/api/v1/cluster/nodes']['get']['responses'][200]['content']['application/json'][number]

export function useClusterNodes() {
  return useQuery({
    queryKey: [...metricKeys.all, 'nodes'] as const,
    queryFn: async ({ signal }) => unwrap(await api.GET('/api/v1/cluster/nodes', { signal })),
    refetchInterval: 5000,
  })
}
