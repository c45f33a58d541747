"""create_app(): routers, middleware, lifespan. No logic."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from hai.api import agent, errors, guards, health, jobs, metrics, nodes, users
from hai.services.context import Platform
from hai.settings import Settings, get_settings

API_VERSION = "1"


def default_frontend_dist() -> Path:
    return Path(__file__).resolve().parents[2] / "frontend" / "dist"


def create_app(platform: Platform | None = None, settings: Settings | None = None) -> FastAPI:
    owned = platform is None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if app.state.platform is None:
            app.state.platform = Platform.from_settings(settings or get_settings())
        app.state.auth_failures = guards.AuthFailures(app.state.platform.settings.limits)
        guards.install_redaction()
        yield
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
    app.add_middleware(guards.BodyLimit, max_bytes=limits.max_body_bytes)
    errors.install(app)
    for module in (health, jobs, nodes, users, agent, metrics):
        app.include_router(module.router)
    app.include_router(nodes.validations_router)  # issue 10: GET /api/v1/validations/{id}

    dist = (platform.settings if platform else (settings or get_settings())).frontend_dist or default_frontend_dist()
    if dist.is_dir() and (dist / "index.html").exists():
        app.mount("/", StaticFiles(directory=dist, html=True), name="dashboard")
    return app
