import { useQuery } from '@tanstack/react-query'
import { api, unwrap } from './client'
import type { components, paths } from './gen/schema'

export type UsageBy = components['schemas']['UsageBy']
/** The page's choice of period; the API takes its start (`since`). */
export type UsagePeriod = 'day' | 'week' | 'month'
export type UsageReport = paths['/api/v1/usage']['get']['responses'][200]['content']['application/json']
export type QuotaUse = paths['/api/v1/usage/quotas']['get']['responses'][200]['content']['application/json'][number]

const PERIOD_DAYS: Record<UsagePeriod, number> = { day: 1, week: 7, month: 30 }

export const usageKeys = {
  all: ['usage'] as const,
  report: (by: UsageBy, period: UsagePeriod) => [...usageKeys.all, by, period] as const,
  quotas: () => [...usageKeys.all, 'quotas'] as const,
}

export function useUsage(by: UsageBy, period: UsagePeriod) {
  return useQuery({
    queryKey: usageKeys.report(by, period),
    queryFn: async ({ signal }) => {
      const since = new Date(Date.now() - PERIOD_DAYS[period] * 86_400_000).toISOString()
      return unwrap(await api.GET('/api/v1/usage', { params: { query: { by, since } }, signal }))
    },
    refetchInterval: 30_000,
  })
}

export function useQuotaUse() {
  return useQuery({
    queryKey: usageKeys.quotas(),
    queryFn: async ({ signal }) => unwrap(await api.GET('/api/v1/usage/quotas', { signal })),
    refetchInterval: 15_000,
  })
}
