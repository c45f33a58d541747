"""Prometheus metrics (prometheus-client), read from the database at scrape time."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select

from hai.api.deps import CurrentUser, PlatformDep
from hai.db.models import Job, JobAllocation, Node
from hai.domain.jobs import JobState
from hai.domain.nodes import NodeState
from hai.services.context import Platform

router = APIRouter(tags=["metrics"])


class _ClusterCollector:
    def __init__(self, platform: Platform) -> None:
        self.platform = platform

    def collect(self):  # noqa: ANN201
        with self.platform.sessions() as s:
            jobs = dict(s.execute(select(Job.state, func.count()).group_by(Job.state)).all())
            nodes = dict(s.execute(select(Node.state, func.count()).group_by(Node.state)).all())
            gpus = dict(s.execute(select(Node.state, func.sum(Node.gpus)).group_by(Node.state)).all())
            held = sum(len(g) for g in s.scalars(select(JobAllocation.gpus).where(JobAllocation.active.is_(True))))
        j = GaugeMetricFamily("hai_jobs", "jobs by state", labels=["state"])
        for state in JobState:
            j.add_metric([state.value], jobs.get(state.value, 0))
        yield j
        n = GaugeMetricFamily("hai_nodes", "nodes by state", labels=["state"])
        for state in NodeState:
            n.add_metric([state.value], nodes.get(state.value, 0))
        yield n
        yield GaugeMetricFamily("hai_gpus_total", "GPUs on ready nodes", value=int(gpus.get(NodeState.READY.value) or 0))
        yield GaugeMetricFamily("hai_gpus_allocated", "GPUs held by jobs", value=held)


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def metrics(platform: PlatformDep, _user: CurrentUser) -> Response:
    """Prometheus text format (scrape with a bearer token)."""
    registry = CollectorRegistry()
    registry.register(_ClusterCollector(platform))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
