import { useQueryClient } from '@tanstack/react-query'
import { useState, type FormEvent } from 'react'
import { ApiError } from '../../api/client'
import { setToken } from '../../api/token'

/** Checks the token against /api/v1/me before keeping it. */
export function SignIn() {
  const [draft, setDraft] = useState('')
  const [error, setError] = useState<string | null>(null)
  const [busy, setBusy] = useState(false)
  const qc = useQueryClient()

  async function submit(e: FormEvent) {
    e.preventDefault()
    setBusy(true)
    setError(null)
    try {
      const res = await globalThis.fetch('/api/v1/me', { headers: { Authorization: `Bearer ${draft.trim()}` } })
      if (res.status === 401 || res.status === 403) throw new ApiError(res.status, null)
      if (!res.ok) throw new Error(`the server answered ${res.status}`)
      qc.clear()
      setToken(draft)
    } catch (err) {
      setError(err instanceof ApiError ? 'That API token was not accepted (wrong or revoked token).' : String(err instanceof Error ? err.message : err))
    } finally {
      setBusy(false)
    }
  }

  return (
    <form className="sign-in" onSubmit={submit}>
      <h2>Sign in</h2>
      <label htmlFor="hai-token">API token</label>
      <input id="hai-token" type="password" autoComplete="off" value={draft} onChange={(e) => setDraft(e.target.value)}
        placeholder="from `hai admin create-user`, or <data-dir>/admin-token in dev" />
      <button type="submit" disabled={busy || draft.trim() === ''}>Sign in</button>
      {error && <p className="error" role="alert">{error}</p>}
    </form>
  )
}
