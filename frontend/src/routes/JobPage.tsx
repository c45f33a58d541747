import { useMemo, type ReactNode } from 'react'
import { Link, useParams } from 'react-router'
import { useMe } from '../api/me'
import { useJob, useJobAction, useJobMetrics, type JobRead } from '../api/jobs'
import { LogView } from '../components/Jobs/LogView'
import { QueryStatus } from '../components/ui/QueryStatus'
import { StateBadge } from '../components/ui/StateBadge'
import { Chart as TimeChart } from '../components/ui/Chart'
import { formatDuration, formatGpus, formatTime, secondsBetween } from '../components/ui/format'

const TERMINAL = new Set(['succeeded', 'failed', 'cancelled'])

/** Name each state change the way users think of it. */
export function timelineLabel(from: string | null | undefined, to: string, suspendedBefore: boolean): string {
  if (!from && to === 'queued') return 'queued'
  if (to === 'suspending') return 'suspend requested'
  if (from === 'suspending' && to === 'queued') return 'suspended'
  if (from === 'queued' && to === 'queued' && suspendedBefore) return 'resume requested'  // released by its owner, waits for GPUs
  if (to === 'starting') return suspendedBefore ? 'resumed' : 'started'
  if (to === 'running') return 'running'
  if (TERMINAL.has(to)) return `finished (${to})`
  return to
}

export function Timeline({ job }: { job: JobRead }) {
  let suspended = false
  const rows: { at: number; key: string; el: ReactNode }[] = job.events.map((e, i) => {
    const label = timelineLabel(e.from_state, e.to_state, suspended)
    if (label === 'suspended') suspended = true
    return { at: Date.parse(e.at), key: `e${i}`, el: <><time>{formatTime(e.at)}</time> <strong>{label}</strong>{e.reason ? ` — ${e.reason}` : ''}</> }
  })
  const ckpt = job.last_checkpoint
  if (ckpt) {  // the latest checkpoint, in its place among the state changes
    const iso = new Date(ckpt.at * 1000).toISOString()
    rows.push({ at: ckpt.at * 1000, key: 'ckpt', el: <><time>{formatTime(iso)}</time> <strong>checkpoint reported</strong>
      {` — ${ckpt.step == null ? '' : `step ${ckpt.step}, `}${ckpt.path}${ckpt.duration_s == null ? '' : ` (written in ${ckpt.duration_s.toFixed(1)} s)`}`}</> })
  }
  rows.sort((a, b) => a.at - b.at)  // stable: events keep their order at equal times
  return <ol className="timeline">{rows.map((r) => <li key={r.key}>{r.el}</li>)}</ol>
}

function Actions({ job }: { job: JobRead }) {
  const me = useMe()
  const act = useJobAction(job.id)
  const mine = me.data && (me.data.is_admin || me.data.name === job.user)
  if (!mine || TERMINAL.has(job.state)) return null
  const canSuspend = (job.state === 'running' || job.state === 'starting') && !job.held
  const canResume = job.held && job.state === 'queued'
  return (
    <div className="actions">
      <button type="button" onClick={() => act.mutate('cancel')} disabled={act.isPending}>Cancel job</button>
      {canSuspend && <button type="button" onClick={() => act.mutate('suspend')} disabled={act.isPending}>Suspend</button>}
      {canResume && <button type="button" onClick={() => act.mutate('resume')} disabled={act.isPending}>Resume</button>}
      {act.isError && <span className="error" role="alert">{act.error.message}</span>}
    </div>
  )
}

function JobUtilisation({ id, from, to }: { id: number; from: string | null; to: string | null }) {
  const m = useJobMetrics(id)
  const data = useMemo(() => {
    const pts = m.data?.series.points ?? []
    const end = Math.floor((to ? new Date(to).getTime() : Date.now()) / 1000)
    const grain = m.data?.series.grain_s ?? 60
    const start = from ? Math.floor(new Date(from).getTime() / 1000) : end - 3600
    return {
      range: [Math.min(start, end - grain) - grain, end + grain] as [number, number],
      times: pts.map((p) => p.t),
      series: [
        { label: 'mean util', values: pts.map((p) => p.util_avg_pct), colour: '#1a7f37' },
        { label: 'busy GPUs', values: pts.map((p) => p.busy_pct), colour: '#0969da' },
      ],
    }
  }, [m.data, from, to])
  return (
    <QueryStatus query={m}>
      {(d) => (
        <>
          <p>
            Busy vs allocated: {d.busy_pct == null ? 'no samples yet' : `${d.busy_pct.toFixed(0)}% of allocated GPU samples busy, mean utilisation ${d.util_avg_pct?.toFixed(0)}%`}
          </p>
          <TimeChart title="Job GPU utilisation" times={data.times} series={data.series} range={data.range} />
        </>
      )}
    </QueryStatus>
  )
}

export default function JobPage() {
  const id = Number(useParams().id)
  const job = useJob(id)
  return (
    <QueryStatus query={job}>
      {(j) => {
        const zones = [...new Set(j.placement.map((p) => p.zone))]
        const leaves = [...new Set(j.placement.map((p) => p.leaf))]
        return (
          <section className="job-page">
            <h2>Job {j.id}: {j.name}</h2>
            <p>State <StateBadge state={j.state} />{j.held ? ' (held: suspended by its owner)' : ''} · {j.priority} · {j.user} ({j.group}) · {j.nodes} × {j.gpus_per_node} GPUs · {j.job_type} · attempt {j.attempt}
              {j.started_at && ` · runtime ${formatDuration(secondsBetween(j.started_at, j.finished_at))}`}</p>
            <Actions job={j} />
            {j.state === 'queued' && j.pending_reason && <p className="pending"><strong>Pending reason:</strong> {j.pending_reason}</p>}
            {j.failure_reason && <p className="error">Failure: {j.failure_reason}</p>}
            <h3>Placement</h3>
            {j.placement.length === 0 ? <p className="muted">Not placed.</p> : (
              <>
                <p>Zone {zones.join(', ')} · leaves {leaves.join(', ')}</p>
                <table><thead><tr><th>Node</th><th>Zone</th><th>Leaf</th><th>GPUs</th></tr></thead>
                  <tbody>{j.placement.map((p) => <tr key={p.node}><td><Link to={`/nodes/${p.node}`}>{p.node}</Link></td><td>{p.zone}</td><td>{p.leaf}</td><td>{formatGpus(p.gpus)}</td></tr>)}</tbody>
                </table>
              </>
            )}
            {j.placement_reason && <p><strong>Why here:</strong> {j.placement_reason}</p>}
            {j.progress && <p><strong>Progress:</strong> {Object.entries(j.progress).map(([k, v]) => `${k}=${String(v)}`).join(', ')}</p>}
            <h3>Timeline</h3>
            <Timeline job={j} />
            <h3>GPU utilisation</h3>
            <JobUtilisation id={j.id} from={j.started_at} to={j.finished_at} />
            <h3>Logs</h3>
            <LogView jobId={j.id} attempts={Math.max(1, j.attempt)} />
          </section>
        )
      }}
    </QueryStatus>
  )
}
