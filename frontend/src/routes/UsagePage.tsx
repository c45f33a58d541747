import { useMemo, useState } from 'react'
import { useQuotaUse, useUsage, type UsageBy, type UsagePeriod } from '../api/usage'
import { QueryStatus } from '../components/ui/QueryStatus'

function Bars({ rows }: { rows: { key: string; gpu_hours: number }[] }) {
  const max = Math.max(1e-9, ...rows.map((r) => r.gpu_hours))
  return (
    <figure className="bars" aria-label="GPU-hours chart">
      {rows.map((r) => (
        <div key={r.key} className="bar-row">
          <span className="bar-label">{r.key}</span>
          <span className="bar" style={{ width: `${(100 * r.gpu_hours) / max}%` }} />
          <span className="bar-value">{r.gpu_hours.toFixed(2)}</span>
        </div>
      ))}
    </figure>
  )
}

export default function UsagePage() {
  const [by, setBy] = useState<UsageBy>('user')
  const [period, setPeriod] = useState<UsagePeriod>('week')
  const usage = useUsage(by, period)
  const quotas = useQuotaUse()
  const total = useMemo(() => (usage.data?.rows ?? []).reduce((a, r) => a + r.gpu_hours, 0), [usage.data])
  return (
    <section>
      <h2>Usage</h2>
      <div className="filters">
        <label>By{' '}
          <select value={by} onChange={(e) => setBy(e.target.value as UsageBy)}><option value="user">user</option><option value="group">group</option></select>
        </label>
        <label>Period{' '}
          <select value={period} onChange={(e) => setPeriod(e.target.value as UsagePeriod)}>
            <option value="day">last day</option><option value="week">last week</option><option value="month">last month</option>
          </select>
        </label>
      </div>
      <QueryStatus query={usage}>
        {(u) => u.rows.length === 0 ? <p className="muted">No GPU time in this period.</p> : (
          <>
            <Bars rows={u.rows} />
            <table>
              <thead><tr><th>{by === 'user' ? 'User' : 'Group'}</th><th>GPU-hours</th><th>Jobs</th></tr></thead>
              <tbody>
                {u.rows.map((r) => <tr key={r.key}><td>{r.key}</td><td>{r.gpu_hours.toFixed(2)}</td><td>{r.jobs}</td></tr>)}
                <tr><th>Total</th><th>{total.toFixed(2)}</th><th /></tr>
              </tbody>
            </table>
          </>
        )}
      </QueryStatus>
      <h3>Quotas</h3>
      <QueryStatus query={quotas}>
        {(qs) => qs.length === 0 ? <p className="muted">No quotas set.</p> : (
          <table>
            <thead><tr><th>Group</th><th>Priority</th><th>User</th><th>Quota (GPUs)</th><th>In use now</th></tr></thead>
            <tbody>{qs.map((q, i) => (
              <tr key={i}><td>{q.group}</td><td>{q.priority}</td><td>{q.user ?? 'everyone'}</td><td>{q.gpus}</td>
                <td><meter min={0} max={Math.max(1, q.gpus)} value={q.used_gpus} /> {q.used_gpus}</td></tr>
            ))}</tbody>
          </table>
        )}
      </QueryStatus>
    </section>
  )
}
