"""The metrics store on PostgreSQL: bucket writes, rollup upserts from two writers, and the
cluster view's figures (the latest heartbeat's, folded into the node's columns; the API tests run
them on SQLite)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import sessionmaker

from hai.db.migrate import upgrade
from hai.db.models import GpuSample, Job, JobAllocation, MetricRollup, Node, User
from hai.protocol import GpuMetrics
from hai.services import metrics_store
from hai.settings import Settings


def _gpus(utils: dict[int, float]) -> list[GpuMetrics]:
    return [GpuMetrics(index=i, uuid=f"G{i}", util_pct=utils.get(i, 0.0), memory_used_mib=10, memory_total_mib=100,
                       temperature_c=50.0, power_w=100.0) for i in range(4)]


def test_metrics_store_on_postgres(pg_url):
    upgrade(pg_url)
    settings = Settings()
    engine = create_engine(pg_url)
    other = create_engine(pg_url)  # a second API process: its own buffer
    sessions, sessions2 = sessionmaker(engine, expire_on_commit=False), sessionmaker(other, expire_on_commit=False)
    now = datetime.now(timezone.utc)
    try:
        with sessions() as s:
            s.add(User(id=1, name="u", group="g"))
            n0 = Node(name="n0", zone="A", leaf="A1", gpus=4)
            metrics_store.set_latest_gpus(n0, _gpus({0: 90.0}), settings)  # as the heartbeat does
            s.add_all([n0, Node(name="n1", zone="B", leaf="B1", gpus=4, gpu_metrics=None)])
            s.flush()
            s.add(Job(id=1, name="j", user_id=1, user_name="u", group="g", command=["x"], state="running"))
            s.flush()
            s.add(JobAllocation(job_id=1, attempt=1, node_name="n0", node_rank=0, gpus=[0, 1],
                                created_at=now - timedelta(hours=1)))
            s.commit()
        for maker, util in ((sessions, 90.0), (sessions2, 30.0)):
            with maker() as s:
                metrics_store.record_heartbeat(session=s, node="n0", gpus=_gpus({0: util}), now=now, settings=settings)
                metrics_store.flush(session=s, settings=settings)
        with sessions() as s:
            assert s.scalar(select(func.count()).select_from(GpuSample)) == 2  # one part per writer
            jm = metrics_store.job_utilisation(session=s, job_id=1, settings=settings)
            assert (jm.gpu_samples, jm.busy_samples, jm.util_avg_pct) == (4, 2, 30.0)
            pts = metrics_store.gpu_series(session=s, node="n0", window="hour", now=now, settings=settings)
            assert pts[0].points[0].util_avg_pct == 60.0 and pts[0].points[0].util_max_pct == 90.0
            cn = {n.name: n for n in metrics_store.cluster_nodes(session=s, settings=settings)}
            assert cn["n0"].util_pct == 22.5 and cn["n0"].allocated_gpus == 2 and cn["n0"].jobs == [1]
            assert cn["n1"].util_pct is None
            summary = metrics_store.cluster_summary(session=s, settings=settings)
            assert (summary.gpus, summary.allocated_gpus, summary.busy_gpus, summary.running_jobs) == (8, 2, 1, 1)
            idle = metrics_store.idle_allocations(session=s, now=now + timedelta(seconds=900), settings=settings)
            assert [(a.job_id, a.gpus) for a in idle] == [(1, [0, 1])]
            assert metrics_store.prune(session=s, settings=settings, now=now + timedelta(days=3)) > 0
            assert set(s.scalars(select(MetricRollup.grain_s).distinct())) == {settings.metrics.coarse_s}
    finally:
        engine.dispose()
        other.dispose()
