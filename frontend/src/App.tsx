import { TokenBox } from './components/Auth/TokenBox'
import { Dashboard } from './routes/Dashboard'

export function App() {
  return (
    <>
      <header>
        <h1>HAI platform</h1>
        <TokenBox />
      </header>
      <main>
        <Dashboard />
      </main>
    </>
  )
}
