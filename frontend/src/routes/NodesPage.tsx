import { Link } from 'react-router'
import { useNodes, type NodeRead } from '../api/nodes'
import { QueryStatus } from '../components/ui/QueryStatus'
import { StateBadge } from '../components/ui/StateBadge'
import { formatTime } from '../components/ui/format'

/** The mean over the node's GPUs at its latest heartbeat (the list carries no per-GPU figures). */
function nodeUtil(n: NodeRead): number | null {
  return n.gpu_util_pct ?? null
}

export default function NodesPage() {
  const nodes = useNodes()
  return (
    <section>
      <h2>Nodes</h2>
      <QueryStatus query={nodes}>
        {(list) => list.length === 0 ? <p className="empty">No nodes.</p> : (
          <table>
            <thead><tr><th>Node</th><th>Zone</th><th>Leaf</th><th>State</th><th>Reason</th><th>GPUs free</th><th>GPU util</th><th>Jobs</th><th>Last heartbeat</th></tr></thead>
            <tbody>
              {list.map((n) => {
                const u = nodeUtil(n)
                return (
                  <tr key={n.name}>
                    <td><Link to={`/nodes/${encodeURIComponent(n.name)}`}>{n.name}</Link></td>
                    <td>{n.zone}</td><td>{n.leaf}</td><td><StateBadge state={n.state} /></td>
                    <td className="wrap">{n.state_reason}</td><td>{n.free_gpus}/{n.gpus}</td>
                    <td>{u == null ? '' : `${u.toFixed(0)}%`}</td>
                    <td>{n.running_jobs.map((j) => <Link key={j} to={`/jobs/${j}`}>{j} </Link>)}</td>
                    <td>{formatTime(n.last_heartbeat_at)}</td>
                  </tr>
                )
              })}
            </tbody>
          </table>
        )}
      </QueryStatus>
    </section>
  )
}
