import { useMemo, useState } from 'react'
import { JOBS_FIRST, JOBS_PAGE, useJobs, type JobListParams, type JobState } from '../api/jobs'
import { JobsTable } from '../components/Jobs/JobsTable'
import { QueryStatus } from '../components/ui/QueryStatus'

const STATES: JobState[] = ['queued', 'starting', 'running', 'suspending', 'succeeded', 'failed', 'cancelled']
export const PRIORITIES = ['LOW', 'NORMAL', 'ABOVE_NORMAL', 'HIGH', 'VERY_HIGH', 'EXTREME_HIGH']

export function JobsPage() {
  const [state, setState] = useState('')
  const [user, setUser] = useState('')
  const [priority, setPriority] = useState('')
  const filters: JobListParams = {}
  if (state) filters.state = [state as JobState]
  if (user.trim()) filters.user = user.trim()
  // the newest screenful first (fast), then the whole page of 1,000, refreshed
  const quick = useJobs({ ...filters, limit: JOBS_FIRST }, { refetchIntervalMs: false })
  const full = useJobs({ ...filters, limit: JOBS_PAGE }, { enabled: quick.isFetched })
  const jobs = (full.data && !full.isPlaceholderData) || !quick.data ? full : quick
  const items = useMemo(
    () => (jobs.data?.items ?? []).filter((j) => !priority || j.priority === priority),
    [jobs.data, priority],
  )
  return (
    <section>
      <h2>Jobs</h2>
      <div className="filters">
        <label>State{' '}
          <select value={state} onChange={(e) => setState(e.target.value)}>
            <option value="">any</option>
            {STATES.map((s) => <option key={s} value={s}>{s}</option>)}
          </select>
        </label>
        <label>User <input value={user} onChange={(e) => setUser(e.target.value)} placeholder="any" size={12} /></label>
        <label>Priority{' '}
          <select value={priority} onChange={(e) => setPriority(e.target.value)}>
            <option value="">any</option>
            {PRIORITIES.map((p) => <option key={p} value={p}>{p}</option>)}
          </select>
        </label>
        {jobs.data && (
          <span className="muted" role="status">
            {jobs.data.total > jobs.data.items.length || jobs.data.total_exact === false
              ? `newest ${jobs.data.items.length.toLocaleString()} of ${jobs.data.total_exact === false ? 'more than ' : ''}${jobs.data.total.toLocaleString()} jobs (narrow with the filters)`
              : `${items.length.toLocaleString()} job${items.length === 1 ? '' : 's'}`}
          </span>
        )}
      </div>
      <QueryStatus query={jobs}>{() => <JobsTable jobs={items} />}</QueryStatus>
    </section>
  )
}
