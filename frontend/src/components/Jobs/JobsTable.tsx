import type { JobRead } from '../../api/jobs'
import { formatTime } from '../ui/format'
import { StateBadge } from '../ui/StateBadge'

export function JobsTable({ jobs }: { jobs: JobRead[] }) {
  if (jobs.length === 0) return <p className="empty">No jobs.</p>
  return (
    <table>
      <thead>
        <tr>
          <th>ID</th>
          <th>Name</th>
          <th>User</th>
          <th>State</th>
          <th>Priority</th>
          <th>Nodes × GPUs</th>
          <th>Type</th>
          <th>Created</th>
          <th>Started</th>
          <th>Finished</th>
          <th>Exit</th>
          <th>Pending reason</th>
        </tr>
      </thead>
      <tbody>
        {jobs.map((job) => (
          <tr key={job.id}>
            <td>{job.id}</td>
            <td>{job.name}</td>
            <td>
              {job.user} <span className="muted">({job.group})</span>
            </td>
            <td>
              <StateBadge state={job.state} />
            </td>
            <td>{job.priority}</td>
            <td>
              {job.nodes} × {job.gpus_per_node}
            </td>
            <td>{job.job_type}</td>
            <td>{formatTime(job.created_at)}</td>
            <td>{formatTime(job.started_at)}</td>
            <td>{formatTime(job.finished_at)}</td>
            <td>{job.exit_code ?? ''}</td>
            <td className="muted wrap">{job.pending_reason ?? ''}</td>
          </tr>
        ))}
      </tbody>
    </table>
  )
}
