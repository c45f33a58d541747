import {
  createColumnHelper, flexRender, getCoreRowModel, getSortedRowModel, useReactTable, type SortingState,
} from '@tanstack/react-table'
import { useVirtualizer } from '@tanstack/react-virtual'
import { useMemo, useRef, useState } from 'react'
import { Link } from 'react-router'
import type { JobRead } from '../../api/jobs'
import { formatDuration, secondsBetween } from '../ui/format'
import { StateBadge } from '../ui/StateBadge'

const PRIORITY_RANK: Record<string, number> = { LOW: 0, NORMAL: 1, ABOVE_NORMAL: 2, HIGH: 3, VERY_HIGH: 4, EXTREME_HIGH: 5 }
const ROW_PX = 33
const col = createColumnHelper<JobRead>()

function runtime(j: JobRead, now: number): number | null {
  return j.started_at ? secondsBetween(j.started_at, j.finished_at, now) : null
}

/** Sortable, virtualised: only the rows in view are in the DOM (10,000 jobs stay smooth). */
export function JobsTable({ jobs, height = 600 }: { jobs: JobRead[]; height?: number }) {
  const [sorting, setSorting] = useState<SortingState>([{ id: 'id', desc: true }])
  const now = Date.now()
  const columns = useMemo(() => [
    col.accessor('id', { header: 'ID', cell: (c) => <Link to={`/jobs/${c.getValue()}`}>{c.getValue()}</Link> }),
    col.accessor('name', { header: 'Name', cell: (c) => <Link to={`/jobs/${c.row.original.id}`}>{c.getValue()}</Link> }),
    col.accessor('state', { header: 'State', cell: (c) => <StateBadge state={c.getValue()} /> }),
    col.accessor((j) => PRIORITY_RANK[j.priority] ?? 0, { id: 'priority', header: 'Priority', cell: (c) => c.row.original.priority }),
    col.accessor('user', { header: 'User' }),
    col.accessor((j) => j.nodes * j.gpus_per_node, { id: 'size', header: 'Nodes × GPUs', cell: (c) => `${c.row.original.nodes} × ${c.row.original.gpus_per_node}` }),
    col.accessor((j) => secondsBetween(j.created_at, null, now) ?? 0, { id: 'age', header: 'Age', cell: (c) => formatDuration(c.getValue()) }),
    col.accessor((j) => runtime(j, now) ?? -1, { id: 'runtime', header: 'Runtime', cell: (c) => (c.getValue() < 0 ? '' : formatDuration(c.getValue())) }),
    col.accessor((j) => j.pending_reason ?? '', { id: 'pending', header: 'Pending reason', cell: (c) => <span className="reason" title={c.getValue()}>{c.getValue()}</span> }),
  ], [now])
  const table = useReactTable({
    data: jobs, columns, state: { sorting }, onSortingChange: setSorting,
    getCoreRowModel: getCoreRowModel(), getSortedRowModel: getSortedRowModel(), getRowId: (j) => String(j.id),
  })
  const rows = table.getRowModel().rows
  const scroller = useRef<HTMLDivElement>(null)
  const virtual = useVirtualizer({
    count: rows.length, getScrollElement: () => scroller.current, estimateSize: () => ROW_PX, overscan: 12,
    // jsdom/happy-dom have no layout: render a first screenful there
    initialRect: { width: 1000, height },
  })
  if (jobs.length === 0) return <p className="empty">No jobs.</p>
  const items = virtual.getVirtualItems()
  const top = items.length ? items[0].start : 0
  const bottom = items.length ? virtual.getTotalSize() - items[items.length - 1].end : 0
  return (
    <div ref={scroller} className="scroller" style={{ maxHeight: height }}>
      <table className="jobs-table" aria-rowcount={rows.length}>
        <thead>
          {table.getHeaderGroups().map((hg) => (
            <tr key={hg.id}>
              {hg.headers.map((h) => {
                const dir = h.column.getIsSorted()
                return (
                  <th key={h.id} aria-sort={dir === 'asc' ? 'ascending' : dir === 'desc' ? 'descending' : 'none'}>
                    <button type="button" className="sort" onClick={h.column.getToggleSortingHandler()}>
                      {flexRender(h.column.columnDef.header, h.getContext())}{dir === 'asc' ? ' ▲' : dir === 'desc' ? ' ▼' : ''}
                    </button>
                  </th>
                )
              })}
            </tr>
          ))}
        </thead>
        <tbody>
          {top > 0 && <tr style={{ height: top }} aria-hidden="true" />}
          {items.map((vi) => {
            const row = rows[vi.index]
            return (
              <tr key={row.id} data-job-id={row.original.id} style={{ height: ROW_PX }}>
                {row.getVisibleCells().map((cell) => (
                  <td key={cell.id}>{flexRender(cell.column.columnDef.cell, cell.getContext())}</td>
                ))}
              </tr>
            )
          })}
          {bottom > 0 && <tr style={{ height: bottom }} aria-hidden="true" />}
        </tbody>
      </table>
    </div>
  )
}
