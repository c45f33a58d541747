import { useJobs } from '../api/jobs'
import { useNodes } from '../api/nodes'
import { useToken } from '../api/token'
import { JobsTable } from '../components/Jobs/JobsTable'
import { NodesTable } from '../components/Nodes/NodesTable'
import { QueryStatus } from '../components/ui/QueryStatus'

export function Dashboard() {
  const token = useToken()
  const signedIn = token !== ''
  const jobs = useJobs({}, { enabled: signedIn })
  const nodes = useNodes({ enabled: signedIn })

  if (!signedIn) return <p className="muted">Enter an API token above to see jobs and nodes.</p>

  return (
    <>
      <section>
        <h2>
          Jobs {jobs.data && <span className="muted">({jobs.data.total})</span>}
        </h2>
        <QueryStatus query={jobs}>{(data) => <JobsTable jobs={data.items} />}</QueryStatus>
      </section>
      <section>
        <h2>Nodes</h2>
        <QueryStatus query={nodes}>{(data) => <NodesTable nodes={data} />}</QueryStatus>
      </section>
    </>
  )
}
