import { useMemo, useState } from 'react'
import { Link } from 'react-router'
import { useJobs } from '../api/jobs'
import { useClusterNodes, useClusterSummary, useClusterUtilisation, useIdleAllocations, type Window } from '../api/metrics'
import { FatTree } from '../components/Nodes/FatTree'
import { QueryStatus } from '../components/ui/QueryStatus'
import { Chart as TimeChart } from '../components/ui/Chart'
import { formatDuration, formatGpus } from '../components/ui/format'

function Totals() {
  const s = useClusterSummary()
  return (
    <QueryStatus query={s}>
      {(d) => (
        <dl className="totals">
          <div><dt>GPUs</dt><dd>{d.gpus}</dd></div>
          <div><dt>Allocated</dt><dd>{d.allocated_gpus}</dd></div>
          <div><dt>Busy</dt><dd>{d.busy_gpus}</dd></div>
          <div><dt>Running jobs</dt><dd>{d.running_jobs}</dd></div>
          <div><dt>Queued jobs</dt><dd>{Object.keys(d.queued_by_priority).length === 0 ? 0 : Object.entries(d.queued_by_priority).map(([p, c]) => `${p} ${c}`).join(' · ')}</dd></div>
        </dl>
      )}
    </QueryStatus>
  )
}

const WINDOW_S: Record<Window, number> = { hour: 3600, day: 86400, week: 7 * 86400 }

function Utilisation({ ready }: { ready: boolean }) {
  const [w, setW] = useState<Window>('hour')
  const q = useClusterUtilisation(w, ready)
  const data = useMemo(() => {
    const pts = q.data?.points ?? []
    const now = Math.floor(Date.now() / 1000)
    return {
      range: [now - WINDOW_S[w], now] as [number, number],
      times: pts.map((p) => p.t),
      series: [
        { label: 'mean util', values: pts.map((p) => p.util_avg_pct), colour: '#1a7f37' },
        { label: 'busy GPUs', values: pts.map((p) => p.busy_pct), colour: '#0969da' },
      ],
    }
  }, [q.data, w])
  return (
    <div>
      <div className="tabs" role="group" aria-label="Period">
        {(['hour', 'day', 'week'] as Window[]).map((x) => (
          <button key={x} type="button" aria-pressed={w === x} onClick={() => setW(x)}>Last {x}</button>
        ))}
      </div>
      <TimeChart title={`Cluster GPU utilisation, last ${w}`} times={data.times} series={data.series} range={data.range} />
    </div>
  )
}

function IdleAllocated({ onSelect, ready }: { onSelect: (id: number) => void; ready: boolean }) {
  const q = useIdleAllocations(ready)
  return (
    <section aria-label="Idle allocated GPUs">
      <h3>Idle allocated GPUs</h3>
      <QueryStatus query={q}>
        {(rows) => rows.length === 0 ? <p className="muted">None: every allocated GPU is busy.</p> : (
          <table>
            <thead><tr><th>Job</th><th>User</th><th>Node</th><th>GPUs</th><th>Idle for</th></tr></thead>
            <tbody>
              {rows.map((r) => (
                <tr key={`${r.job_id}-${r.node}`} className="idle-row">
                  <td><Link to={`/jobs/${r.job_id}`}>{r.job_id} {r.job_name}</Link> <button type="button" className="link" onClick={() => onSelect(r.job_id)}>show</button></td>
                  <td>{r.user}</td><td><Link to={`/nodes/${r.node}`}>{r.node}</Link></td><td>{formatGpus(r.gpus)}</td><td>{formatDuration(r.idle_s)}</td>
                </tr>
              ))}
            </tbody>
          </table>
        )}
      </QueryStatus>
    </section>
  )
}

export default function ClusterPage() {
  const nodes = useClusterNodes()
  // the job picker's list waits for the tree (it is the heavier query)
  const running = useJobs({ state: ['running', 'starting', 'suspending'], limit: 1000 }, { refetchIntervalMs: 10_000, enabled: nodes.isSuccess })
  const [selected, setSelected] = useState<number | null>(null)
  const highlight = useMemo(
    () => new Set(selected == null ? [] : (nodes.data ?? []).filter((n) => n.jobs.includes(selected)).map((n) => n.name)),
    [nodes.data, selected],
  )
  return (
    <section>
      <h2>Cluster</h2>
      <Totals />
      <Utilisation ready={nodes.isSuccess} />
      <IdleAllocated onSelect={setSelected} ready={nodes.isSuccess} />
      <h3>Fat-tree</h3>
      <div className="filters">
        <label>Highlight job{' '}
          <select value={selected ?? ''} onChange={(e) => setSelected(e.target.value ? Number(e.target.value) : null)}>
            <option value="">none</option>
            {(running.data?.items ?? []).map((j) => <option key={j.id} value={j.id}>{j.id} {j.name} ({j.user})</option>)}
          </select>
        </label>
        <span className="legend muted">colour: GPU utilisation (grey: no metrics) · letter: D draining/drained, U unhealthy, L lost</span>
      </div>
      <QueryStatus query={nodes}>{(list) => <FatTree nodes={list} highlight={highlight} />}</QueryStatus>
    </section>
  )
}
