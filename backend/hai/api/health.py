from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from hai.api.deps import PlatformDep
from hai.schemas.common import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz(platform: PlatformDep) -> Health:
    with platform.sessions() as session:
        session.execute(text("SELECT 1"))
    return Health(status="ok", database=platform.engine.dialect.name)
