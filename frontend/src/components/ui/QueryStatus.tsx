import type { UseQueryResult } from '@tanstack/react-query'
import type { ReactNode } from 'react'

/** Loading / error / data for one query, in one place. */
export function QueryStatus<T>({ query, children }: { query: UseQueryResult<T>; children: (data: T) => ReactNode }) {
  if (query.isPending) return <p className="muted">Loading…</p>
  if (query.isError) return <p className="error">{query.error.message}</p>
  return <>{children(query.data)}</>
}
