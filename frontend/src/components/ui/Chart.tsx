import { lazy, Suspense, type ComponentProps } from 'react'
import type { TimeChart as TimeChartType } from './TimeChart'

// uPlot loads on first use, so pages paint before the charting code arrives
const TimeChart = lazy(() => import('./TimeChart').then((m) => ({ default: m.TimeChart })))

export function Chart(props: ComponentProps<typeof TimeChartType>) {
  return (
    <Suspense fallback={<figure className="chart" aria-label={props.title}><p className="muted">Loading chart…</p></figure>}>
      <TimeChart {...props} />
    </Suspense>
  )
}
