import { memo, useMemo, type MouseEvent } from 'react'
import { useNavigate } from 'react-router'
import type { ClusterNode } from '../../api/metrics'
import { utilColour } from '../ui/format'

type NodeRead = ClusterNode

export interface Zone { name: string; leaves: { name: string; nodes: NodeRead[] }[] }

export function groupTree(nodes: NodeRead[]): Zone[] {
  const zones = new Map<string, Map<string, NodeRead[]>>()
  for (const n of nodes) {
    let leaves = zones.get(n.zone)
    if (!leaves) zones.set(n.zone, (leaves = new Map()))
    let list = leaves.get(n.leaf)
    if (!list) leaves.set(n.leaf, (list = []))
    list.push(n)
  }
  const byName = (a: string, b: string) => a.localeCompare(b, undefined, { numeric: true })
  return [...zones.keys()].sort(byName).map((z) => ({
    name: z,
    leaves: [...zones.get(z)!.keys()].sort(byName).map((l) => ({
      name: l, nodes: zones.get(z)!.get(l)!.slice().sort((a, b) => byName(a.name, b.name)),
    })),
  }))
}

const MARK: Record<string, string> = { draining: 'D', drained: 'D', unhealthy: 'U', lost: 'L' }

/** One node: a single plain link (no router component, no child elements: 1,250 of them draw at
 * once); its state letter is drawn by CSS from data-mark; clicks are routed by the tree. */
const NodeCell = memo(function NodeCell({ n, highlighted }: { n: NodeRead; highlighted: boolean }) {
  const util = n.util_pct ?? null
  const title = `${n.name}: ${n.state}${n.state_reason ? ` (${n.state_reason})` : ''}, ${util == null ? 'no metrics' : `${util.toFixed(0)}% GPU util`}, ${n.allocated_gpus}/${n.gpus} GPUs allocated`
  return (
    <a href={`/nodes/${encodeURIComponent(n.name)}`} className={`node node-${n.state}${highlighted ? ' highlighted' : ''}`}
      style={{ background: utilColour(util) }} title={title} aria-label={n.name} data-state={n.state} data-mark={MARK[n.state]} />
  )
})

/** Zones -> leaf switches -> nodes: each node a link named by its name, coloured by GPU util, marked by state. */
export function FatTree({ nodes, highlight }: { nodes: NodeRead[]; highlight: ReadonlySet<string> }) {
  const tree = useMemo(() => groupTree(nodes), [nodes])
  const navigate = useNavigate()
  // one handler for every node link: a plain left click navigates inside the app (as <Link> does)
  const onClick = (e: MouseEvent<HTMLDivElement>) => {
    const a = (e.target as Element).closest('a.node')
    if (!a || e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey || e.defaultPrevented) return
    e.preventDefault()
    navigate(a.getAttribute('href') ?? '/')
  }
  return (
    <div className="fat-tree" onClick={onClick}>
      {tree.map((z) => (
        <section key={z.name} className="zone" aria-label={`Zone ${z.name}`}>
          <h3>Zone {z.name} <span className="muted">({z.leaves.reduce((a, l) => a + l.nodes.length, 0)} nodes, {z.leaves.length} leaves)</span></h3>
          <div className="leaves">
            {z.leaves.map((l) => (
              <section key={l.name} className="leaf" aria-label={`Leaf ${l.name}`}>
                <h4>{l.name}</h4>
                <div className="nodes">
                  {l.nodes.map((n) => <NodeCell key={n.name} n={n} highlighted={highlight.has(n.name)} />)}
                </div>
              </section>
            ))}
          </div>
        </section>
      ))}
    </div>
  )
}
