import { useEffect, useRef } from 'react'
import uPlot from 'uplot'
import 'uplot/dist/uPlot.min.css'

export interface ChartSeries {
  label: string
  values: (number | null)[]
  colour: string
}

/** A uPlot time series (x in epoch seconds), sized to its container's width. */
export function TimeChart({ title, times, series, range, height = 180, yMax = 100, unit = '%' }: {
  title: string
  /** the x range in epoch seconds (the period shown), so sparse data keeps a true time axis */
  range?: [number, number]
  times: number[]
  series: ChartSeries[]
  height?: number
  yMax?: number | null
  unit?: string
}) {
  const box = useRef<HTMLDivElement>(null)
  useEffect(() => {
    const el = box.current
    if (!el || typeof window === 'undefined' || !('ResizeObserver' in window)) return
    const width = Math.max(300, el.clientWidth || 600)
    const opts: uPlot.Options = {
      title,
      width,
      height,
      series: [{}, ...series.map((s) => ({
        label: s.label, stroke: s.colour, width: 1.5, spanGaps: false,
        points: { show: times.length < 60, size: 4 },
        value: (_u: uPlot, v: number | null) => (v == null ? '–' : `${v.toFixed(1)}${unit}`),
      }))],
      scales: {
        x: range ? { time: true, range: () => [range[0], range[1]] } : { time: true },
        y: yMax == null ? {} : { range: [0, yMax] },
      },
      axes: [{}, { values: (_u, ticks) => ticks.map((t) => `${t}${unit}`) }],
    }
    const plot = new uPlot(opts, [times, ...series.map((s) => s.values)] as uPlot.AlignedData, el)
    const ro = new ResizeObserver(() => plot.setSize({ width: Math.max(300, el.clientWidth), height }))
    ro.observe(el)
    return () => {
      ro.disconnect()
      plot.destroy()
    }
  }, [title, times, series, height, yMax, unit, range?.[0], range?.[1]])
  return (
    <figure className="chart" aria-label={title}>
      <div ref={box} />
      {times.length === 0 && <figcaption className="muted">No samples yet.</figcaption>}
    </figure>
  )
}
