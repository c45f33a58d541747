import { Suspense } from 'react'
import { Navigate, Route, Routes } from 'react-router'
import { Layout } from './components/Layout/Layout'
import ClusterPage from './routes/ClusterPage'
import JobPage from './routes/JobPage'
import { JobsPage } from './routes/JobsPage'
import NodePage from './routes/NodePage'
import NodesPage from './routes/NodesPage'
import SubmitPage from './routes/SubmitPage'
import UsagePage from './routes/UsagePage'

// pages are small and load with the app (no waterfall on a deep link); the charting code
// (uPlot) loads on first use (components/ui/Chart)

export function App() {
  return (
    <Suspense fallback={<p className="muted">Loading…</p>}>
      <Routes>
        <Route element={<Layout />}>
          <Route index element={<Navigate to="/jobs" replace />} />
          <Route path="jobs" element={<JobsPage />} />
          <Route path="jobs/:id" element={<JobPage />} />
          <Route path="submit" element={<SubmitPage />} />
          <Route path="cluster" element={<ClusterPage />} />
          <Route path="nodes" element={<NodesPage />} />
          <Route path="nodes/:name" element={<NodePage />} />
          <Route path="usage" element={<UsagePage />} />
          <Route path="*" element={<p>Not found.</p>} />
        </Route>
      </Routes>
    </Suspense>
  )
}
