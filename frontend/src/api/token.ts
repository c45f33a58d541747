// The API token: kept in localStorage, read by the client on every request,
// observable from React through useToken().
import { useSyncExternalStore } from 'react'

export const TOKEN_STORAGE_KEY = 'hai.token'

const listeners = new Set<() => void>()

export function getToken(): string {
  try {
    return window.localStorage.getItem(TOKEN_STORAGE_KEY) ?? ''
  } catch {
    return ''
  }
}

export function setToken(token: string): void {
  const value = token.trim()
  if (value) window.localStorage.setItem(TOKEN_STORAGE_KEY, value)
  else window.localStorage.removeItem(TOKEN_STORAGE_KEY)
  listeners.forEach((notify) => notify())
}

function subscribe(notify: () => void): () => void {
  listeners.add(notify)
  // another tab changed the token
  const onStorage = (e: StorageEvent) => {
    if (e.key === TOKEN_STORAGE_KEY) notify()
  }
  window.addEventListener('storage', onStorage)
  return () => {
    listeners.delete(notify)
    window.removeEventListener('storage', onStorage)
  }
}

export function useToken(): string {
  return useSyncExternalStore(subscribe, getToken, () => '')
}
