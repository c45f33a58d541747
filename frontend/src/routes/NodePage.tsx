import { useMemo, useState, type FormEvent } from 'react'
import { Link, useParams } from 'react-router'
import { ApiError } from '../api/client'
import { useMe } from '../api/me'
import { useNodeMetrics } from '../api/metrics'
import { failedChecks, useNode, useNodeAction, useNodeValidations, useNodes, type ValidationRun } from '../api/nodes'
import { QueryStatus } from '../components/ui/QueryStatus'
import { StateBadge } from '../components/ui/StateBadge'
import { Chart as TimeChart } from '../components/ui/Chart'
import { formatTime } from '../components/ui/format'

/** The node exists (it is in the list) but the server has no such endpoint. */
function missing(error: unknown): boolean {
  return error instanceof ApiError && (error.status === 404 || error.status === 405)
}

const GPU_COLOURS = ['#0969da', '#1a7f37', '#9a6700', '#cf222e', '#8250df', '#bf3989', '#1b7c83', '#57606a']

function AdminActions({ name, state }: { name: string; state: string }) {
  const [reason, setReason] = useState('')
  const [force, setForce] = useState(false)
  const act = useNodeAction(name)
  const refused = failedChecks(act.error)
  function drain(e: FormEvent) {
    e.preventDefault()
    act.mutate({ kind: 'drain', reason }, { onSuccess: () => setReason('') })
  }
  const drainable = state === 'ready' || state === 'unhealthy'
  return (
    <div className="admin-actions">
      {drainable && (
        <form onSubmit={drain} className="inline">
          <label htmlFor="drain-reason">Reason</label>
          <input id="drain-reason" value={reason} onChange={(e) => setReason(e.target.value)} placeholder="why (required)" />
          <button type="submit" disabled={act.isPending}>Drain</button>
        </form>
      )}
      {state !== 'ready' && (
        <span className="inline">
          <button type="button" onClick={() => act.mutate({ kind: 'undrain', force })} disabled={act.isPending}>Undrain</button>
          <label><input type="checkbox" checked={force} onChange={(e) => setForce(e.target.checked)} /> force (skip the validator gate)</label>
        </span>
      )}
      <button type="button" onClick={() => act.mutate({ kind: 'validate' })} disabled={act.isPending}>Validate now</button>
      {refused ? (
        <div className="error" role="alert">{refused.message}: {refused.checks.map((c) => `${c.name} ${c.value ?? ''}${c.unit} (threshold ${c.threshold ?? '?'}${c.unit})`).join('; ')}</div>
      ) : act.isError ? <p className="error" role="alert">{act.error.message}</p> : null}
    </div>
  )
}

function Validations({ runs }: { runs: ValidationRun[] }) {
  if (runs.length === 0) return <p className="muted">No validation runs yet.</p>
  const [latest, ...older] = runs
  return (
    <>
      <h4>Latest validation (run {latest.id}, {latest.level}, {latest.status}, {formatTime(latest.finished_at ?? latest.started_at ?? latest.requested_at)})</h4>
      {latest.summary && <p className="wrap">{latest.summary}</p>}
      <table>
        <thead><tr><th>Check</th><th>Result</th><th>Value</th><th>Threshold</th><th>Detail</th></tr></thead>
        <tbody>{latest.checks.map((c) => (
          <tr key={c.name}><td>{c.name}</td><td><StateBadge state={c.status} /></td>
            <td>{c.value ?? ''} {c.value == null ? '' : c.unit}</td><td>{c.threshold ?? ''} {c.threshold == null ? '' : c.unit}</td><td className="wrap">{c.detail}</td></tr>
        ))}</tbody>
      </table>
      {older.length > 0 && <ul>{older.map((r) => <li key={r.id}>run {r.id} ({r.level}, {r.trigger}): {r.status} {formatTime(r.finished_at ?? r.started_at ?? r.requested_at)}</li>)}</ul>}
    </>
  )
}

export default function NodePage() {
  const name = useParams().name ?? ''
  const nodes = useNodes()
  const detail = useNode(name)
  const validations = useNodeValidations(name)
  const me = useMe()
  const metrics = useNodeMetrics(name)
  const chart = useMemo(() => {
    const gpus = metrics.data?.gpus ?? []
    const times = [...new Set(gpus.flatMap((g) => g.points.map((p) => p.t)))].sort((a, b) => a - b)
    const now = Math.floor(Date.now() / 1000)
    return {
      range: [now - 3600, now] as [number, number],
      times,
      series: gpus.map((g, i) => {
        const at = new Map(g.points.map((p) => [p.t, p.util_avg_pct]))
        return { label: `GPU ${g.index}`, values: times.map((t) => at.get(t) ?? null), colour: GPU_COLOURS[i % GPU_COLOURS.length] }
      }),
    }
  }, [metrics.data])
  const n = nodes.data?.find((x) => x.name === name)
  if (nodes.isSuccess && !n) return <p className="error">Node {name} not found.</p>
  const state = detail.data?.state ?? n?.state ?? ''
  const reason = detail.data?.state_reason ?? n?.state_reason ?? ''
  return (
    <section>
      <h2>Node {name}</h2>
      {n && (
        <>
          <p>State <StateBadge state={state} />{reason && <> · <span className="reason-text">{reason}</span></>} · zone {n.zone} · leaf {n.leaf} · {n.free_gpus}/{n.gpus} GPUs free · last heartbeat {formatTime(n.last_heartbeat_at)}</p>
          {me.data?.is_admin && <AdminActions name={name} state={state} />}
          <h3>Running jobs</h3>
          {n.running_jobs.length === 0 ? <p className="muted">None.</p> : <ul>{n.running_jobs.map((j) => <li key={j}><Link to={`/jobs/${j}`}>job {j}</Link></li>)}</ul>}
          <h3>GPUs</h3>
          <table>
            <thead><tr><th>GPU</th><th>Model</th><th>Util</th><th>Memory</th><th>Temperature</th><th>Power</th><th>ECC uncorrected</th></tr></thead>
            <tbody>{(detail.data?.gpu_metrics ?? n.gpu_metrics ?? []).map((g) => (
              <tr key={g.index}><td>{g.index}</td><td>{g.model}</td><td>{g.util_pct == null ? '' : `${g.util_pct.toFixed(0)}%`}</td>
                <td>{g.memory_used_mib ?? ''}/{g.memory_total_mib ?? ''} MiB</td><td>{g.temperature_c == null ? '' : `${g.temperature_c} °C`}</td>
                <td>{g.power_w == null ? '' : `${g.power_w} W`}</td><td>{g.ecc_uncorrected ?? ''}</td></tr>
            ))}</tbody>
          </table>
          <TimeChart title="GPU utilisation, last hour" times={chart.times} series={chart.series} range={chart.range} />
        </>
      )}
      <h3>Validation</h3>
      {missing(validations.error) ? <p className="muted">This server does not report validation runs.</p>
        : <QueryStatus query={validations}>{(runs) => <Validations runs={runs} />}</QueryStatus>}
      <h3>Events</h3>
      {missing(detail.error) ? <p className="muted">This server does not report node events.</p> : <QueryStatus query={detail}>
        {(d) => d.events.length === 0 ? <p className="muted">No events.</p> : (
          <table>
            <thead><tr><th>When</th><th>From</th><th>To</th><th>By</th><th>Reason</th></tr></thead>
            <tbody>{[...d.events].reverse().map((e, i) => (
              <tr key={i}><td>{formatTime(e.at)}</td><td>{e.from_state ?? ''}</td><td><StateBadge state={e.to_state} /></td><td>{e.actor}</td><td className="wrap">{e.reason}</td></tr>
            ))}</tbody>
          </table>
        )}
      </QueryStatus>}
    </section>
  )
}
