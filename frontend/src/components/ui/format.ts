export function formatTime(iso: string | null | undefined): string {
  if (!iso) return ''
  const date = new Date(iso)
  return Number.isNaN(date.getTime()) ? iso : date.toLocaleString()
}

/** 45 s, 12 min, 3.2 h, 2.1 d */
export function formatDuration(seconds: number | null | undefined): string {
  if (seconds == null || !Number.isFinite(seconds)) return ''
  const s = Math.max(0, seconds)
  if (s < 90) return `${Math.round(s)} s`
  if (s < 5400) return `${Math.round(s / 60)} min`
  if (s < 172800) return `${(s / 3600).toFixed(1)} h`
  return `${(s / 86400).toFixed(1)} d`
}

export function secondsBetween(from: string | null | undefined, to?: string | null, now = Date.now()): number | null {
  if (!from) return null
  const a = new Date(from).getTime()
  const b = to ? new Date(to).getTime() : now
  return Number.isNaN(a) || Number.isNaN(b) ? null : (b - a) / 1000
}

/** A shell-like split of a command line: whitespace separates, quotes group. */
export function splitCommand(line: string): string[] {
  const out: string[] = []
  let cur = ''
  let quote: string | null = null
  let any = false
  for (const ch of line) {
    if (quote) {
      if (ch === quote) quote = null
      else cur += ch
    } else if (ch === '"' || ch === "'") {
      quote = ch
      any = true
    } else if (/\s/.test(ch)) {
      if (cur || any) out.push(cur)
      cur = ''
      any = false
    } else cur += ch
  }
  if (cur || any) out.push(cur)
  return out
}

/** KEY=VALUE lines into an object; returns the first bad line's message instead when one is malformed. */
export function parseEnv(text: string): { env: Record<string, string> } | { error: string } {
  const env: Record<string, string> = {}
  const lines = text.split('\n')
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i].trim()
    if (!line || line.startsWith('#')) continue
    const eq = line.indexOf('=')
    if (eq <= 0) return { error: `line ${i + 1}: expected KEY=VALUE, got "${line}"` }
    env[line.slice(0, eq).trim()] = line.slice(eq + 1)
  }
  return { env }
}

/** Colour for a utilisation 0..100 (grey when unknown). */
export function utilColour(pct: number | null | undefined): string {
  if (pct == null) return '#d0d7de'
  const p = Math.max(0, Math.min(100, pct)) / 100
  // pale blue -> deep green
  const hue = 200 - 80 * p
  const light = 88 - 50 * p
  return `hsl(${hue.toFixed(0)} 60% ${light.toFixed(0)}%)`
}

/** A node's GPUs as "how many (which)": [0, 1, 2, 3] -> "4 (GPU 0-3)", [1, 5] -> "2 (GPU 1, 5)". */
export function formatGpus(gpus: readonly number[]): string {
  if (gpus.length === 0) return '0'
  const sorted = [...gpus].sort((a, b) => a - b)
  const runs: string[] = []
  for (let i = 0; i < sorted.length; ) {
    let j = i
    while (j + 1 < sorted.length && sorted[j + 1] === sorted[j] + 1) j++
    runs.push(j > i ? `${sorted[i]}-${sorted[j]}` : `${sorted[i]}`)
    i = j + 1
  }
  return `${gpus.length} (GPU ${runs.join(', ')})`
}
