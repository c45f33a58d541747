import { useQueryClient } from '@tanstack/react-query'
import { NavLink, Outlet } from 'react-router'
import { useMe } from '../../api/me'
import { setToken, useToken } from '../../api/token'
import { SignIn } from '../Auth/SignIn'

const LINKS: [string, string][] = [
  ['/jobs', 'Jobs'],
  ['/submit', 'Submit'],
  ['/cluster', 'Cluster'],
  ['/nodes', 'Nodes'],
  ['/usage', 'Usage'],
]

export function Layout() {
  const token = useToken()
  const me = useMe(token !== '')
  const qc = useQueryClient()
  if (!token) {
    return (
      <>
        <header><h1>HAI platform</h1></header>
        <main><SignIn /></main>
      </>
    )
  }
  return (
    <>
      <header>
        <h1>HAI platform</h1>
        <nav aria-label="Main">
          {LINKS.map(([to, label]) => (
            <NavLink key={to} to={to}>{label}</NavLink>
          ))}
        </nav>
        <span className="who" role="status">
          {me.isSuccess ? `${me.data.name} (${me.data.group})${me.data.is_admin ? ' · admin' : ''}` : me.isError ? me.error.message : '…'}
        </span>
        <button type="button" onClick={() => { setToken(''); qc.clear() }}>Sign out</button>
      </header>
      <main>
        <Outlet />
      </main>
    </>
  )
}
