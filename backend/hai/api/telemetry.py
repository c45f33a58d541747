"""GPU metrics over time and accounting, for the dashboard and `hai usage`."""

from __future__ import annotations

from dataclasses import fields
from functools import cache
from datetime import date, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BeforeValidator
from fastapi.exceptions import RequestValidationError
from sqlalchemy import select

from hai.api.deps import CurrentUser, PlatformDep, SessionDep
from hai.db.base import utcnow
from hai.db.models import Node
from hai.schemas import metrics as m
from hai.services import jobs as job_service
from hai.services import metrics_store, usage
from hai.services.errors import NotFound

router = APIRouter(prefix="/api/v1", tags=["metrics"])


@cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _kw(obj: object) -> dict:
    """A service record's fields, shallow (dataclasses.asdict deep-copies: 8x slower on 1,250 nodes)."""
    return {k: getattr(obj, k) for k in _names(type(obj))}


def _series(grain: int, points, window: m.Window) -> m.MetricSeries:  # noqa: ANN001
    return m.MetricSeries(window=window, grain_s=grain, points=[m.MetricPoint(**_kw(p)) for p in points])


@router.get("/cluster/summary", response_model=m.ClusterSummary)
def cluster_summary(session: SessionDep, platform: PlatformDep, _user: CurrentUser) -> m.ClusterSummary:
    s = metrics_store.cluster_summary(session=session, settings=platform.settings)
    return m.ClusterSummary(**_kw(s))


@router.get("/cluster/nodes", response_model=list[m.ClusterNodeRead])
def cluster_nodes(session: SessionDep, platform: PlatformDep, _user: CurrentUser) -> list[m.ClusterNodeRead]:
    """Every node, lightly, for the fat-tree view (zone, leaf, state, allocation, utilisation, jobs)."""
    return [m.ClusterNodeRead(**_kw(n)) for n in metrics_store.cluster_nodes(session=session, settings=platform.settings)]


@router.get("/cluster/utilisation", response_model=m.MetricSeries)
def cluster_utilisation(
    session: SessionDep, platform: PlatformDep, _user: CurrentUser, window: m.Window = m.Window.hour
) -> m.MetricSeries:
    grain, points = metrics_store.series(session=session, scope="cluster", key="", window=window.value, now=utcnow(),
                                         settings=platform.settings)
    return _series(grain, points, window)


@router.get("/cluster/idle-allocations", response_model=list[m.IdleAllocationRead])
def idle_allocations(session: SessionDep, platform: PlatformDep, _user: CurrentUser) -> list[m.IdleAllocationRead]:
    """Allocated GPUs of running jobs that sat below the busy threshold for at least
    HAI_METRICS__IDLE_AFTER_S, longest idle first."""
    rows = metrics_store.idle_allocations(session=session, now=utcnow(), settings=platform.settings)
    return [m.IdleAllocationRead(**_kw(r)) for r in rows]


@router.get("/nodes/{name}/metrics", response_model=m.NodeMetrics)
def node_metrics(
    name: str, session: SessionDep, platform: PlatformDep, _user: CurrentUser, window: m.Window = m.Window.hour
) -> m.NodeMetrics:
    if session.scalar(select(Node.id).where(Node.name == name)) is None:
        raise NotFound(f"node {name} not found")
    now = utcnow()
    grain, points = metrics_store.series(session=session, scope="node", key=name, window=window.value, now=now,
                                         settings=platform.settings)
    gpus = metrics_store.gpu_series(session=session, node=name, window=window.value, now=now, settings=platform.settings)
    return m.NodeMetrics(
        node=name, series=_series(grain, points, window),
        gpus=[m.GpuMetricSeries(index=g.index, points=[m.MetricPoint(**_kw(p)) for p in g.points]) for g in gpus],
    )


@router.get("/jobs/{job_id}/metrics", response_model=m.JobMetrics)
def job_metrics(
    job_id: int, session: SessionDep, platform: PlatformDep, user: CurrentUser, window: m.Window = m.Window.day
) -> m.JobMetrics:
    job_service.get_job(session=session, job_id=job_id, user=user)
    grain, points = metrics_store.series(session=session, scope="job", key=str(job_id), window=window.value,
                                         now=utcnow(), settings=platform.settings)
    u = metrics_store.job_utilisation(session=session, job_id=job_id, settings=platform.settings)
    return m.JobMetrics(job_id=job_id, series=_series(grain, points, window), **_kw(u))


def _iso_only(value: object) -> object:
    """Pydantic reads a bare number as Unix seconds; the schema promises an ISO date or time, so
    `until=0.5` is a 422, not the start of 1970 (found by schemathesis, issue 13)."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return value
        raise ValueError("an ISO date or time is expected, e.g. 2026-12-01 or 2026-12-01T12:00:00Z")
    return value


IsoTime = Annotated[datetime | date, BeforeValidator(_iso_only)]


@router.get("/usage", response_model=m.UsageReport, tags=["usage"])
def get_usage(
    session: SessionDep,
    _user: CurrentUser,
    by: m.UsageBy = m.UsageBy.user,
    since: Annotated[IsoTime | None, Query(description="start (ISO date or time; default 7 days ago)")] = None,
    until: Annotated[IsoTime | None, Query(description="end (ISO date or time; default now)")] = None,
) -> m.UsageReport:
    """GPU-hours per user or group within [since, until), from what the jobs' allocations held."""
    end = _aware(until) if until is not None else utcnow()
    start = _aware(since) if since is not None else end - timedelta(days=7)
    if start >= end:
        raise RequestValidationError([{"loc": ("query", "since"), "msg": "must be before until", "type": "value_error"}])
    rows = usage.gpu_hours(session=session, by=by.value, since=start, until=end)
    return m.UsageReport(by=by, since=start, until=end, rows=[m.UsageRowRead(**_kw(r)) for r in rows])


@router.get("/usage/quotas", response_model=list[m.QuotaUseRead], tags=["usage"])
def get_quota_use(session: SessionDep, _user: CurrentUser) -> list[m.QuotaUseRead]:
    """Each quota and the GPUs its jobs hold now."""
    return [m.QuotaUseRead(**_kw(q)) for q in usage.quota_use(session=session)]


def _aware(dt: datetime | date) -> datetime:
    from datetime import timezone

    if not isinstance(dt, datetime):
        dt = datetime(dt.year, dt.month, dt.day)
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)
