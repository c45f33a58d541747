import { lazy, Suspense } from 'react'
import { Navigate, Route, Routes } from 'react-router'
import { Layout } from './components/Layout/Layout'
import { JobsPage } from './routes/JobsPage'

// the pages with charts load their code on first visit
const JobPage = lazy(() => import('./routes/JobPage'))
const SubmitPage = lazy(() => import('./routes/SubmitPage'))
const ClusterPage = lazy(() => import('./routes/ClusterPage'))
const NodesPage = lazy(() => import('./routes/NodesPage'))
const NodePage = lazy(() => import('./routes/NodePage'))
const UsagePage = lazy(() => import('./routes/UsagePage'))

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
