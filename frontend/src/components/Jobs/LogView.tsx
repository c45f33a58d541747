import { fetchEventSource } from '@microsoft/fetch-event-source'
import { useEffect, useRef, useState } from 'react'
import { getToken } from '../../api/token'

const MAX_LINES = 5000

/** A job's logs: rank filter, search, attempts of the chain; follows by server-sent events. */
export function LogView({ jobId, attempts }: { jobId: number; attempts: number }) {
  const [rank, setRank] = useState('')
  const [q, setQ] = useState('')
  const [attempt, setAttempt] = useState('')
  const [follow, setFollow] = useState(true)
  const [lines, setLines] = useState<string[]>([])
  const [status, setStatus] = useState('')
  const pre = useRef<HTMLPreElement>(null)

  useEffect(() => {
    const ctrl = new AbortController()
    const params = new URLSearchParams()
    if (rank.trim() !== '') params.set('rank', rank.trim())
    if (q.trim() !== '') params.set('q', q.trim())
    if (attempt) params.set('attempt', attempt)
    setLines([])
    const headers = { Authorization: `Bearer ${getToken()}` }
    if (!follow) {
      setStatus('')
      globalThis.fetch(`/api/v1/jobs/${jobId}/logs?${params}`, { headers, signal: ctrl.signal })
        .then((r) => (r.ok ? r.text() : Promise.reject(new Error(`HTTP ${r.status}`))))
        .then((t) => setLines(t.split('\n').filter((l) => l !== '').slice(-MAX_LINES)))
        .catch((e) => { if (!ctrl.signal.aborted) setStatus(String(e.message ?? e)) })
      return () => ctrl.abort()
    }
    params.set('follow', 'true')
    setStatus('following')
    fetchEventSource(`/api/v1/jobs/${jobId}/logs?${params}`, {
      headers,
      signal: ctrl.signal,
      openWhenHidden: true,
      onmessage(ev) {
        if (ev.event === 'log') setLines((prev) => (prev.length >= MAX_LINES ? [...prev.slice(-MAX_LINES + 1), ev.data] : [...prev, ev.data]))
        else if (ev.event === 'end') { setStatus(`ended: ${ev.data}`); ctrl.abort() }
      },
      onerror(err) {
        setStatus(`reconnecting (${err instanceof Error ? err.message : 'error'})`)
      },
    }).catch(() => undefined)
    return () => ctrl.abort()
  }, [jobId, rank, q, attempt, follow])

  useEffect(() => {
    if (follow && pre.current) pre.current.scrollTop = pre.current.scrollHeight
  }, [lines, follow])

  return (
    <div className="logs">
      <div className="filters">
        <label>Rank <input value={rank} onChange={(e) => setRank(e.target.value)} size={4} placeholder="all" /></label>
        <label>Search <input value={q} onChange={(e) => setQ(e.target.value)} size={16} /></label>
        <label>Attempt{' '}
          <select value={attempt} onChange={(e) => setAttempt(e.target.value)}>
            <option value="">all</option>
            {Array.from({ length: attempts }, (_, i) => i + 1).map((a) => <option key={a} value={a}>{a}</option>)}
          </select>
        </label>
        <label><input type="checkbox" checked={follow} onChange={(e) => setFollow(e.target.checked)} /> Follow</label>
        <span className="muted">{status}</span>
      </div>
      <pre ref={pre} className="log-lines" aria-label="Log" tabIndex={0}>{lines.join('\n')}</pre>
    </div>
  )
}
