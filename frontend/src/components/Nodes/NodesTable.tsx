import type { NodeRead } from '../../api/nodes'
import { StateBadge } from '../ui/StateBadge'

export function NodesTable({ nodes }: { nodes: NodeRead[] }) {
  if (nodes.length === 0) return <p className="empty">No nodes registered.</p>
  return (
    <table>
      <thead>
        <tr>
          <th>Name</th>
          <th>Zone</th>
          <th>Leaf</th>
          <th>GPUs free / total</th>
          <th>State</th>
          <th>Running jobs</th>
        </tr>
      </thead>
      <tbody>
        {nodes.map((node) => (
          <tr key={node.name}>
            <td>{node.name}</td>
            <td>{node.zone}</td>
            <td>{node.leaf}</td>
            <td>
              {node.free_gpus} / {node.gpus}
            </td>
            <td>
              <StateBadge state={node.state} /> <span className="muted">{node.state_reason}</span>
            </td>
            <td>{node.running_jobs.join(', ')}</td>
          </tr>
        ))}
      </tbody>
    </table>
  )
}
