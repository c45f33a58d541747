"""create_app(): routers, middleware, lifespan. No logic."""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import signal
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from hai.api import agent, errors, guards, health, jobs, metrics, nodes, telemetry, users
from hai.api.spa import SpaStaticFiles
from hai.schemas.common import error_responses
from hai.services.context import Platform
from hai.settings import HttpSettings, Settings, get_settings

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


def tune_collector(http: HttpSettings) -> None:
    """A serving process's garbage collector (issue 12): what exists once the app has started
    (modules, the ORM's mappers, compiled caches) is frozen out of every later collection, and
    the first generation collects after ``http.gc_threshold`` allocations instead of 700. With
    Python's defaults a worker serving 1,250 agents a second promoted each heartbeat's short-lived
    objects into the older generations and paused for full collections of 150-250 ms every few
    seconds, the fan-in's p99 (benchmarks/README.md, issue 12). Called by the CLI's servers only:
    a test process that builds many apps keeps Python's defaults."""
    if http.gc_threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(http.gc_threshold, gen1, gen2)


def _telemetry(http: HttpSettings) -> dict:
    """FastAPI's native OpenTelemetry (FastAPI's ``telemetry`` argument, where this FastAPI has
    it) as ``http.opentelemetry`` says. Off, FastAPI does not look at OpenTelemetry's global
    providers on every request (issue 12: three look-ups, each reading the environment, were ~5%
    of a submission's server CPU by py-spy)."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    on = http.opentelemetry
    return {"telemetry": {"tracing": on, "metrics": on, "logs": on}}


class _App(FastAPI):
    """FastAPI whose two outermost layers are the body limit and the steady-heartbeat answer
    (issue 12): a steady heartbeat, nearly every request at 1,250 agents, is answered before
    FastAPI's and Starlette's own middleware (error pages, exception telemetry, their body limit),
    whose layers were a third of a cached answer's CPU (py-spy ``--gil`` during agent_fanin.py).
    Everything else goes through the whole stack as before."""

    max_body_bytes: int = 0

    def build_middleware_stack(self):  # noqa: ANN201
        stack = super().build_middleware_stack()
        early = jobs.EarlySubmissions(agent.SteadyHeartbeats(stack, owner=self), owner=self)
        return guards.BodyLimit(early, max_bytes=self.max_body_bytes)


def server_app() -> FastAPI:
    """``hai server --workers N``'s factory: each worker's app, with its collector tuned, and
    its waits released as soon as the worker is told to stop (``release_waiters_on_signal``)."""
    return create_app(tune_gc=True, release_on_signal=True)


def release_waiters_on_signal(release: Callable[[], None]) -> Callable[[], None]:
    """In a ``hai server --workers N`` worker: when SIGTERM or SIGINT arrives, call ``release``
    (``Notifier.release_waiters``) on the running event loop, then the handler that was there
    (uvicorn's, which starts the graceful shutdown). uvicorn's graceful shutdown waits for every
    request in flight, and a held long poll or a followed log would keep a worker up for as long
    as it lasts (a followed log of a queued job: for ever); one-process ``hai server`` and ``hai
    dev`` do the same from their server's shutdown (``hai.cli.dev.StoppingServer``), which a
    worker's server, built by uvicorn's supervisor, cannot be. Call it from the worker's
    lifespan, on the loop, in the main thread (where uvicorn installed its handlers; elsewhere
    nothing is chained). Returns the undo: the handlers put back (unless replaced since)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    chained: dict[int, tuple[Callable, Callable]] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        before = signal.getsignal(sig)
        if not callable(before):
            continue  # (SIG_DFL or SIG_IGN: not under uvicorn's signal capture)

        def on_signal(signum: int, frame, before=before) -> None:  # noqa: ANN001
            # (not the release itself: it takes a lock, which a signal handler must not)
            loop.call_soon_threadsafe(release)
            before(signum, frame)

        signal.signal(sig, on_signal)
        chained[sig] = (on_signal, before)

    def undo() -> None:
        for sig, (mine, before) in chained.items():
            if signal.getsignal(sig) is mine:
                signal.signal(sig, before)

    return undo


def create_app(platform: Platform | None = None, settings: Settings | None = None, *,
               tune_gc: bool = False, release_on_signal: bool = False) -> FastAPI:
    owned = platform is None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if app.state.platform is None:
            app.state.platform = Platform.from_settings(configured_settings)
        app.state.auth_failures = guards.AuthFailures(app.state.platform.settings.limits)
        # issue 12: 2xx heartbeats left out of the access log (before the redaction filter)
        agent.quiet_heartbeat_access_log(not app.state.platform.settings.agent.access_log_heartbeats)
        guards.install_redaction()
        if tune_gc:
            tune_collector(app.state.platform.settings.http)
        undo = release_waiters_on_signal(app.state.platform.notifier.release_waiters) if release_on_signal else None
        yield
        if undo is not None:
            undo()
        if getattr(app.state, "reply_cache", None) is not None:  # issue 12: write the batched liveness
            app.state.reply_cache.close()
        if app.state.platform is not None:
            await app.state.platform.close_loop()  # this loop's connections of the submissions' writer
        if owned and app.state.platform is not None:
            app.state.platform.close()

    configured_settings = platform.settings if platform else (settings or get_settings())
    app = _App(
        title="HAI platform",
        version="0.1.0",
        summary="GPU-cluster job scheduling: time-sharing, checkpoint-boundary preemption, fat-tree placement",
        lifespan=lifespan,
        **_telemetry(configured_settings.http),
    )
    app.state.platform = platform
    limits = configured_settings.limits
    app.state.auth_failures = guards.AuthFailures(limits)
    # outermost: the body limit, then a steady agent heartbeat answered before everything else (_App)
    app.max_body_bytes = limits.max_body_bytes
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

    configured = configured_settings.frontend_dist
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
