import { useQueryClient } from '@tanstack/react-query'
import { useState, type FormEvent } from 'react'
import { useMe } from '../../api/me'
import { setToken, useToken } from '../../api/token'

export function TokenBox() {
  const token = useToken()
  const [draft, setDraft] = useState(token)
  const queryClient = useQueryClient()
  const me = useMe(token !== '')

  function save(e: FormEvent) {
    e.preventDefault()
    setToken(draft)
    // everything cached was fetched as someone else (or no one)
    queryClient.resetQueries()
  }

  return (
    <form className="token-box" onSubmit={save}>
      <label htmlFor="hai-token">API token</label>
      <input
        id="hai-token"
        type="password"
        autoComplete="off"
        placeholder="paste a token from `hai admin create-user`"
        value={draft}
        onChange={(e) => setDraft(e.target.value)}
      />
      <button type="submit">Save</button>
      <span className="who" role="status">
        {token === ''
          ? 'not signed in'
          : me.isSuccess
            ? `${me.data.name} (${me.data.group})${me.data.is_admin ? ' · admin' : ''}`
            : me.isError
              ? me.error.message
              : '…'}
      </span>
    </form>
  )
}
