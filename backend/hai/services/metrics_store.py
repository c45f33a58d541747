"""GPU metrics over time: buffered ingestion from heartbeats, rollups, retention and reads.

Ingestion is cheap by design (1,250 nodes x 8 GPUs at 1 Hz): ``record_heartbeat`` only adds the
heartbeat's figures into an in-process buffer (sums, counts and maxima per GPU and fine bucket).
Every ``flush_interval_s`` one heartbeat's transaction writes the buffer with a few bulk upserts:
per-GPU fine rows, rollups per cluster, node and job at the fine and coarse grain, and each
GPU's status (last busy). Rows hold sums and counts, so partial buckets flushed by several API
processes merge exactly. Jobs are attributed at flush time from the active allocations.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Iterable, Sequence

from sqlalchemy import Engine, delete, func, select
from sqlalchemy.orm import Session

from hai.db.models import GpuSample, GpuStatus, Job, JobAllocation, MetricRollup
from hai.settings import MetricsSettings, Settings

WINDOWS_S = {"hour": 3600, "day": 86400, "week": 7 * 86400}

# per (node, gpu index, fine bucket): n, util_sum, util_max, mem_max, temp_max, power_sum, busy_n
_N, _USUM, _UMAX, _MEM, _TEMP, _PSUM, _BUSY = range(7)


@dataclass
class _Buffer:
    samples: dict[tuple[str, int, int], list[float]] = field(default_factory=dict)
    # per (node, gpu index): last seen epoch, last busy epoch (0 = not in this window), latest util
    status: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    flush_lock: threading.Lock = field(default_factory=threading.Lock)
    last_flush: float = field(default_factory=time.monotonic)

    def add(self, node: str, gpus: Iterable, now_s: float, cfg: MetricsSettings) -> None:  # noqa: ANN001
        bucket = int(now_s // cfg.fine_s) * cfg.fine_s
        busy_at = cfg.busy_util_pct
        with self.lock:
            samples, status = self.samples, self.status
            for g in gpus:
                util = float(g.util_pct)
                temp = float(g.temperature_c or 0.0)
                power = float(g.power_w or 0.0)
                busy = util >= busy_at
                key = (node, g.index, bucket)
                row = samples.get(key)
                if row is None:
                    samples[key] = [1, util, util, g.memory_used_mib, temp, power, 1 if busy else 0]
                else:
                    row[_N] += 1
                    row[_USUM] += util
                    if util > row[_UMAX]:
                        row[_UMAX] = util
                    if g.memory_used_mib > row[_MEM]:
                        row[_MEM] = g.memory_used_mib
                    if temp > row[_TEMP]:
                        row[_TEMP] = temp
                    row[_PSUM] += power
                    if busy:
                        row[_BUSY] += 1
                st = status.get((node, g.index))
                if st is None:
                    status[(node, g.index)] = [now_s, now_s if busy else 0.0, util]
                else:
                    st[0] = now_s
                    st[2] = util
                    if busy:
                        st[1] = now_s

    def take(self) -> tuple[dict, dict]:
        with self.lock:
            samples, status = self.samples, self.status
            self.samples, self.status = {}, {}
            self.last_flush = time.monotonic()
        return samples, status


_buffers: "weakref.WeakKeyDictionary[Engine, _Buffer]" = weakref.WeakKeyDictionary()
_buffers_lock = threading.Lock()


def _buffer(session: Session) -> _Buffer:
    engine = session.get_bind()
    with _buffers_lock:
        buf = _buffers.get(engine)
        if buf is None:
            buf = _buffers[engine] = _Buffer()
        return buf


def _epoch(dt: datetime) -> float:
    return dt.timestamp()


# -- ingestion ------------------------------------------------------------------------------
def record_heartbeat(*, session: Session, node: str, gpus: Sequence, now: datetime, settings: Settings) -> None:  # noqa: ANN001
    """Buffer one heartbeat's GPU figures; write the buffer when it is due (in this session's
    transaction: the caller commits). The one hook the heartbeat calls."""
    cfg = settings.metrics
    buf = _buffer(session)
    if gpus:
        buf.add(node, gpus, _epoch(now), cfg)
    if time.monotonic() - buf.last_flush >= cfg.flush_interval_s and buf.flush_lock.acquire(blocking=False):
        try:
            _write(session, buf, cfg)
        finally:
            buf.flush_lock.release()


def flush(*, session: Session, settings: Settings) -> int:
    """Write what is buffered now and commit; returns the per-GPU rows written."""
    buf = _buffer(session)
    with buf.flush_lock:
        written = _write(session, buf, settings.metrics)
    session.commit()
    return written


def _upsert(session: Session, model, rows: list[dict], keys: Sequence[str], add: Sequence[str], maxed: Sequence[str]) -> None:  # noqa: ANN001
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert

        greatest = func.greatest
    else:
        from sqlalchemy.dialects.sqlite import insert

        greatest = func.max
    table = model.__table__
    rows.sort(key=lambda r: tuple(r[k] for k in keys))  # one lock order across writers
    chunk = 2000
    for i in range(0, len(rows), chunk):
        stmt = insert(table).values(rows[i : i + chunk])
        ex = stmt.excluded
        updates = {c: table.c[c] + ex[c] for c in add}
        updates.update({c: greatest(table.c[c], ex[c]) for c in maxed})
        session.execute(stmt.on_conflict_do_update(index_elements=list(keys), set_=updates))


def _write(session: Session, buf: _Buffer, cfg: MetricsSettings) -> int:
    samples, status = buf.take()
    if not samples and not status:
        return 0
    nodes = sorted({k[0] for k in status})
    owner: dict[tuple[str, int], int] = {}
    if nodes:
        for job_id, node_name, gpus in session.execute(
            select(JobAllocation.job_id, JobAllocation.node_name, JobAllocation.gpus).where(
                JobAllocation.active.is_(True), JobAllocation.node_name.in_(nodes)
            )
        ):
            for g in gpus or ():
                owner[(node_name, int(g))] = job_id

    fine_rows = []
    roll: dict[tuple[str, str, int, int], list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0, 0.0, 0.0])
    coarse = cfg.coarse_s
    for (node, gpu, bucket), r in samples.items():
        fine_rows.append(
            {"node_name": node, "bucket": bucket, "gpu_index": gpu, "n": int(r[_N]), "util_sum": r[_USUM],
             "util_max": r[_UMAX], "mem_used_max_mib": int(r[_MEM]), "temp_max_c": r[_TEMP], "power_sum_w": r[_PSUM]}
        )
        cb = bucket // coarse * coarse
        targets = [("cluster", ""), ("node", node)]
        job_id = owner.get((node, gpu))
        if job_id is not None:
            targets.append(("job", str(job_id)))
        for scope, key in targets:
            for grain, b in ((cfg.fine_s, bucket), (coarse, cb)):
                acc = roll[(scope, key, grain, b)]
                acc[0] += r[_N]
                acc[1] += r[_BUSY]
                acc[2] += r[_USUM]
                if r[_UMAX] > acc[3]:
                    acc[3] = r[_UMAX]
                acc[4] += r[_MEM] * r[_N]
                if r[_TEMP] > acc[5]:
                    acc[5] = r[_TEMP]
                acc[6] += r[_PSUM]
    roll_rows = [
        {"scope": s, "key": k, "grain_s": g, "bucket": b, "n": int(a[0]), "busy_n": int(a[1]), "util_sum": a[2],
         "util_max": a[3], "mem_used_sum_mib": a[4], "temp_max_c": a[5], "power_sum_w": a[6]}
        for (s, k, g, b), a in roll.items()
    ]
    status_rows = [
        {"node_name": n, "gpu_index": g, "last_seen_at": st[0], "last_busy_at": st[1], "util_pct": st[2]}
        for (n, g), st in status.items()
    ]
    _upsert(session, GpuSample, fine_rows, ("node_name", "bucket", "gpu_index"),
            ("n", "util_sum", "power_sum_w"), ("util_max", "mem_used_max_mib", "temp_max_c"))
    _upsert(session, MetricRollup, roll_rows, ("scope", "key", "grain_s", "bucket"),
            ("n", "busy_n", "util_sum", "mem_used_sum_mib", "power_sum_w"), ("util_max", "temp_max_c"))
    _upsert_status(session, status_rows)
    session.flush()
    return len(fine_rows)


def _upsert_status(session: Session, rows: list[dict]) -> None:
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert

        greatest = func.greatest
    else:
        from sqlalchemy.dialects.sqlite import insert

        greatest = func.max
    table = GpuStatus.__table__
    rows.sort(key=lambda r: (r["node_name"], r["gpu_index"]))
    for i in range(0, len(rows), 2000):
        stmt = insert(table).values(rows[i : i + 2000])
        ex = stmt.excluded
        session.execute(
            stmt.on_conflict_do_update(
                index_elements=["node_name", "gpu_index"],
                set_={"last_seen_at": greatest(table.c.last_seen_at, ex.last_seen_at),
                      "last_busy_at": greatest(table.c.last_busy_at, ex.last_busy_at),
                      "util_pct": ex.util_pct},
            )
        )


# -- retention ------------------------------------------------------------------------------
def prune(*, session: Session, settings: Settings, now: datetime) -> int:
    """Drop fine rows older than ``fine_retention_h`` and coarse ones older than
    ``coarse_retention_days``. Idempotent."""
    cfg = settings.metrics
    now_s = _epoch(now)
    fine_cut = int(now_s - cfg.fine_retention_h * 3600)
    coarse_cut = int(now_s - cfg.coarse_retention_days * 86400)
    n = session.execute(delete(GpuSample).where(GpuSample.bucket < fine_cut)).rowcount or 0
    n += session.execute(
        delete(MetricRollup).where(MetricRollup.grain_s == cfg.fine_s, MetricRollup.bucket < fine_cut)
    ).rowcount or 0
    n += session.execute(
        delete(MetricRollup).where(MetricRollup.grain_s != cfg.fine_s, MetricRollup.bucket < coarse_cut)
    ).rowcount or 0
    session.commit()
    return int(n)


# -- reads ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Point:
    t: int  # epoch s of the bucket start
    util_avg_pct: float
    util_max_pct: float
    busy_pct: float  # share of GPU samples at or above the busy threshold
    mem_used_avg_mib: float
    temp_max_c: float
    power_avg_w: float  # per GPU


def _grain_for(window_s: float, cfg: MetricsSettings) -> int:
    return cfg.fine_s if window_s <= 86400 and window_s <= cfg.fine_retention_h * 3600 else cfg.coarse_s


def series(*, session: Session, scope: str, key: str, window: str, now: datetime, settings: Settings) -> tuple[int, list[Point]]:
    """A rollup series over the window (``hour`` | ``day`` | ``week``): (grain_s, points)."""
    cfg = settings.metrics
    span = WINDOWS_S[window]
    grain = _grain_for(span, cfg)
    since = int(_epoch(now) - span) // grain * grain
    rows = session.execute(
        select(MetricRollup.bucket, MetricRollup.n, MetricRollup.busy_n, MetricRollup.util_sum, MetricRollup.util_max,
               MetricRollup.mem_used_sum_mib, MetricRollup.temp_max_c, MetricRollup.power_sum_w)
        .where(MetricRollup.scope == scope, MetricRollup.key == key, MetricRollup.grain_s == grain,
               MetricRollup.bucket >= since)
        .order_by(MetricRollup.bucket)
    ).all()
    return grain, [
        Point(t=b, util_avg_pct=us / n, util_max_pct=um, busy_pct=100.0 * busy / n, mem_used_avg_mib=mem / n,
              temp_max_c=tm, power_avg_w=p / n)
        for b, n, busy, us, um, mem, tm, p in rows
        if n
    ]


@dataclass(frozen=True, slots=True)
class GpuSeries:
    index: int
    points: list[Point]


def gpu_series(*, session: Session, node: str, window: str, now: datetime, settings: Settings) -> list[GpuSeries]:
    """Per-GPU fine series of one node (clipped to the fine retention)."""
    cfg = settings.metrics
    span = min(WINDOWS_S[window], cfg.fine_retention_h * 3600)
    since = int(_epoch(now) - span) // cfg.fine_s * cfg.fine_s
    out: dict[int, list[Point]] = defaultdict(list)
    for s in session.scalars(
        select(GpuSample).where(GpuSample.node_name == node, GpuSample.bucket >= since)
        .order_by(GpuSample.gpu_index, GpuSample.bucket)
    ):
        if s.n:
            out[s.gpu_index].append(
                Point(t=s.bucket, util_avg_pct=s.util_sum / s.n, util_max_pct=s.util_max, busy_pct=0.0,
                      mem_used_avg_mib=float(s.mem_used_max_mib), temp_max_c=s.temp_max_c, power_avg_w=s.power_sum_w / s.n)
            )
    return [GpuSeries(index=i, points=pts) for i, pts in sorted(out.items())]


@dataclass(frozen=True, slots=True)
class JobUtilisation:
    gpu_samples: int
    busy_samples: int
    util_avg_pct: float | None
    busy_pct: float | None  # busy vs allocated


def job_utilisation(*, session: Session, job_id: int, settings: Settings) -> JobUtilisation:
    """Busy vs allocated over the job's whole life (coarse rollups)."""
    n, busy, usum = session.execute(
        select(func.coalesce(func.sum(MetricRollup.n), 0), func.coalesce(func.sum(MetricRollup.busy_n), 0),
               func.coalesce(func.sum(MetricRollup.util_sum), 0.0))
        .where(MetricRollup.scope == "job", MetricRollup.key == str(job_id), MetricRollup.grain_s == settings.metrics.coarse_s)
    ).one()
    return JobUtilisation(gpu_samples=int(n), busy_samples=int(busy), util_avg_pct=(usum / n) if n else None,
                          busy_pct=(100.0 * busy / n) if n else None)


@dataclass(frozen=True, slots=True)
class IdleAllocation:
    job_id: int
    job_name: str
    user: str
    node: str
    gpus: list[int]  # the allocated GPUs that sit idle
    idle_s: float  # the shortest idle time among them


def idle_allocations(*, session: Session, now: datetime, settings: Settings) -> list[IdleAllocation]:
    """Allocated GPUs of running jobs below the busy threshold for at least ``idle_after_s``,
    longest idle first."""
    cfg = settings.metrics
    now_s = _epoch(now)
    rows = session.execute(
        select(JobAllocation.job_id, Job.name, Job.user_name, JobAllocation.node_name, JobAllocation.gpus,
               JobAllocation.created_at)
        .join(Job, Job.id == JobAllocation.job_id)
        .where(JobAllocation.active.is_(True), Job.state == "running")
    ).all()
    if not rows:
        return []
    nodes = sorted({r[3] for r in rows})
    status = {
        (n, g): (seen, busy)
        for n, g, seen, busy in session.execute(
            select(GpuStatus.node_name, GpuStatus.gpu_index, GpuStatus.last_seen_at, GpuStatus.last_busy_at)
            .where(GpuStatus.node_name.in_(nodes))
        )
    }
    out = []
    for job_id, name, user, node, gpus, created_at in rows:
        start = _epoch(created_at)
        idle = []
        for g in gpus or ():
            st = status.get((node, int(g)))
            if st is None:
                continue  # never reported: unknown, not idle
            idle_for = now_s - max(start, st[1])
            if idle_for >= cfg.idle_after_s:
                idle.append((int(g), idle_for))
        if idle:
            out.append(IdleAllocation(job_id=job_id, job_name=name, user=user, node=node,
                                      gpus=sorted(g for g, _ in idle), idle_s=min(s for _, s in idle)))
    out.sort(key=lambda a: (-a.idle_s, a.job_id, a.node))
    return out


@dataclass(frozen=True, slots=True)
class ClusterSummary:
    gpus: int
    allocated_gpus: int
    busy_gpus: int  # reporting at or above the busy threshold in their latest heartbeat
    queued_by_priority: dict[str, int]
    running_jobs: int


def cluster_summary(*, session: Session, settings: Settings) -> ClusterSummary:
    from hai.db.models import Node

    threshold = settings.metrics.busy_util_pct
    gpus = busy = 0
    for count, metrics in session.execute(select(Node.gpus, Node.gpu_metrics)):
        gpus += count or 0
        busy += sum(1 for g in metrics or () if (g.get("util_pct") or 0.0) >= threshold)
    allocated = sum(len(g or ()) for g in session.scalars(select(JobAllocation.gpus).where(JobAllocation.active.is_(True))))
    queued = {p: int(c) for p, c in session.execute(
        select(Job.priority, func.count()).where(Job.state == "queued").group_by(Job.priority))}
    running = session.scalar(select(func.count()).select_from(Job).where(Job.state == "running")) or 0
    return ClusterSummary(gpus=gpus, allocated_gpus=allocated, busy_gpus=busy, queued_by_priority=queued,
                          running_jobs=int(running))
