// The one HTTP client, typed by the generated schema (src/api/gen/, never edited by hand:
// run `npm run gen:api`). Same-origin: the backend serves the dashboard and /api/v1.
import createClient, { type Middleware } from 'openapi-fetch'
import type { paths } from './gen/schema'
import { getToken } from './token'

export class ApiError extends Error {
  readonly status: number
  readonly detail: unknown

  constructor(status: number, detail: unknown) {
    super(ApiError.describe(status, detail))
    this.name = 'ApiError'
    this.status = status
    this.detail = detail
  }

  private static describe(status: number, detail: unknown): string {
    if (detail && typeof detail === 'object' && 'detail' in detail) {
      const d = (detail as { detail: unknown }).detail
      if (typeof d === 'string') return `${status}: ${d}`
    }
    return `HTTP ${status}`
  }
}

const auth: Middleware = {
  onRequest({ request }) {
    const token = getToken()
    if (token) request.headers.set('Authorization', `Bearer ${token}`)
    return request
  },
}

export const api = createClient<paths>({
  baseUrl: import.meta.env.VITE_API_BASE ?? '',
  // looked up per call, so tests can stub globalThis.fetch
  fetch: (request) => globalThis.fetch(request),
})
api.use(auth)

/** Returns the body of a successful response or throws an ApiError. */
export function unwrap<T>(result: { data?: T; error?: unknown; response: Response }): T {
  if (result.error !== undefined || !result.response.ok) {
    throw new ApiError(result.response.status, result.error)
  }
  return result.data as T
}
