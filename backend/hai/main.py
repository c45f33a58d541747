"""create_app(): routers, middleware, lifespan. No logic."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from hai.api import agent, errors, guards, health, jobs, metrics, nodes, telemetry, users
from hai.api.spa import SpaStaticFiles
from hai.schemas.common import error_responses
from hai.services.context import Platform
from hai.settings import Settings, get_settings

API_VERSION = "1"
log = logging.getLogger(__name__)

NO_DASHBOARD_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>HAI platform: no dashboard</title></head>
<body style="font-family: sans-serif; max-width: 42rem; margin: 3rem auto">
<h1>HAI platform</h1>
<p>The API is up (<a href="/docs">/docs</a>, <a href="/healthz">/healthz</a>), but this server has
no built dashboard to serve.</p>
<p>Build it with <code>cd frontend &amp;&amp; npm ci &amp;&amp; npm run build</code>, then either point
<code>HAI_FRONTEND_DIST</code> at <code>frontend/dist</code> or reinstall the package
(<code>pip install ./backend</code>), which ships a dashboard built before it.</p>
</body></html>
"""


def dashboard_candidates() -> list[Path]:
    """Where a built dashboard may be, when HAI_FRONTEND_DIST does not say: the copy shipped in the
    installed package (backend/setup.py), then the source checkout's frontend/dist."""
    package = Path(__file__).resolve().parent
    return [package / "_shipped" / "dashboard", package.parents[1] / "frontend" / "dist"]


def find_dashboard(configured: Path | None) -> Path | None:
    for dist in [configured] if configured is not None else dashboard_candidates():
        if dist.is_dir() and (dist / "index.html").is_file():
            return dist
    return None


def create_app(platform: Platform | None = None, settings: Settings | None = None) -> FastAPI:
    owned = platform is None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if app.state.platform is None:
            app.state.platform = Platform.from_settings(settings or get_settings())
        app.state.auth_failures = guards.AuthFailures(app.state.platform.settings.limits)
        # issue 12: 2xx heartbeats left out of the access log (before the redaction filter)
        agent.quiet_heartbeat_access_log(not app.state.platform.settings.agent.access_log_heartbeats)
        guards.install_redaction()
        yield
        if getattr(app.state, "reply_cache", None) is not None:  # issue 12: write the batched liveness
            app.state.reply_cache.close()
        if owned and app.state.platform is not None:
            app.state.platform.close()

    app = FastAPI(
        title="HAI platform",
        version="0.1.0",
        summary="GPU-cluster job scheduling: time-sharing, checkpoint-boundary preemption, fat-tree placement",
        lifespan=lifespan,
    )
    app.state.platform = platform
    limits = (platform.settings if platform else (settings or get_settings())).limits
    app.state.auth_failures = guards.AuthFailures(limits)
    # innermost: a steady agent heartbeat is answered before routing (issue 12), inside the guards
    app.add_middleware(agent.SteadyHeartbeats)
    app.add_middleware(guards.BodyLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(guards.AllowHeader, routes_of=lambda: app.routes)
    errors.install(app)
    # issue 13: every refusal a route can send is declared in the OpenAPI schema
    user_errors = error_responses(400, 401, 403, 404, 409, 413, 429)
    # the agent's routes first: every node calls them every second, and a request is matched
    # against the routes in order (issue 12; no other route's path overlaps theirs)
    app.include_router(agent.router, responses=user_errors | error_responses(426))
    app.include_router(health.router, responses=error_responses(400))
    for module in (jobs, nodes, users, metrics, telemetry):
        app.include_router(module.router, responses=user_errors)
    app.include_router(nodes.validations_router, responses=user_errors)  # issue 10: GET /api/v1/validations/{id}

    configured = (platform.settings if platform else (settings or get_settings())).frontend_dist
    dist = find_dashboard(configured)
    if dist is not None:
        app.mount("/", SpaStaticFiles(directory=dist, html=True), name="dashboard")
    else:
        looked = [configured] if configured is not None else dashboard_candidates()
        log.warning(
            "no built dashboard (looked in %s): / serves a page saying how to build it",
            ", ".join(str(p) for p in looked),
        )

        @app.get("/", include_in_schema=False)
        def no_dashboard() -> HTMLResponse:
            return HTMLResponse(NO_DASHBOARD_PAGE)

    return app
