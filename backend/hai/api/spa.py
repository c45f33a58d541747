"""The built dashboard as static files, with deep links (``/jobs/12``) answered by index.html
so the browser's router takes over on reload. API paths keep their 404s."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.staticfiles import StaticFiles
from starlette.types import Scope


class SpaStaticFiles(StaticFiles):
    async def get_response(self, path: str, scope: Scope):  # noqa: ANN201
        try:
            return await super().get_response(path, scope)
        except HTTPException as exc:
            api = path.split("/", 1)[0] in ("api", "metrics", "healthz", "docs", "openapi.json")
            if exc.status_code != 404 or api or "." in path.rsplit("/", 1)[-1]:
                raise
            return await super().get_response("index.html", scope)
