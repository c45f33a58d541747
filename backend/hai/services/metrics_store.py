"""GPU metrics over time: buffered ingestion from heartbeats, rollups, retention and reads.

Ingestion is cheap by design (1,250 nodes x 8 GPUs at 1 Hz): ``record_heartbeat`` only adds the
heartbeat's figures into an in-process buffer (sums, counts and maxima per node, GPU and fine
bucket). Each bucket is written ONCE, when it has closed: at most every ``flush_interval_s`` one
heartbeat's transaction inserts the closed buckets (one row per node and bucket, its GPUs in a
JSON list) and adds them into the rollups (cluster and job at the fine and coarse grain, node at
the coarse grain) with batched upserts that add sums and keep maxima, and records each GPU's
last busy time. Several API processes may each write part of a bucket (rows keyed by ``part``);
readers add the parts up. Jobs are attributed at write time from the active allocations.
"""

from __future__ import annotations

import random
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Iterable, Sequence

from sqlalchemy import Engine, delete, func, insert, select
from sqlalchemy.orm import Session

from hai.db.models import GpuSample, GpuStatus, Job, JobAllocation, MetricRollup
from hai.settings import MetricsSettings, Settings

WINDOWS_S = {"hour": 3600, "day": 86400, "week": 7 * 86400}

# per GPU within a (node, bucket): n, util_sum, util_max, mem_max, temp_max, power_sum, busy_n
_N, _USUM, _UMAX, _MEM, _TEMP, _PSUM, _BUSY = range(7)


def _part() -> int:
    return random.SystemRandom().randrange(1, 2**31 - 1)


@dataclass
class _Buffer:
    # (node, bucket) -> gpu index -> figures
    samples: dict[tuple[str, int], dict[int, list[float]]] = field(default_factory=dict)
    # (node, gpu index) -> [last seen epoch, last busy epoch (0: not busy since the last write), util]
    status: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    part: int = field(default_factory=_part)
    lock: threading.Lock = field(default_factory=threading.Lock)
    flush_lock: threading.Lock = field(default_factory=threading.Lock)
    last_flush: float = field(default_factory=time.monotonic)
    latest_s: float = 0.0  # the newest heartbeat time seen

    def add(self, node: str, gpus: Iterable, now_s: float, cfg: MetricsSettings) -> None:  # noqa: ANN001
        bucket = int(now_s // cfg.fine_s) * cfg.fine_s
        busy_at = cfg.busy_util_pct
        with self.lock:
            if now_s > self.latest_s:
                self.latest_s = now_s
            per_gpu = self.samples.get((node, bucket))
            if per_gpu is None:
                per_gpu = self.samples[(node, bucket)] = {}
            status = self.status
            for g in gpus:
                util = float(g.util_pct)
                temp = float(g.temperature_c or 0.0)
                power = float(g.power_w or 0.0)
                busy = util >= busy_at
                row = per_gpu.get(g.index)
                if row is None:
                    per_gpu[g.index] = [1, util, util, g.memory_used_mib, temp, power, 1 if busy else 0]
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

    def take(self, cfg: MetricsSettings, *, include_open: bool) -> tuple[dict, dict, int]:
        """The closed buckets (all of them with ``include_open``) and the GPU status, removed
        from the buffer, with the part id to write them under."""
        with self.lock:
            self.last_flush = time.monotonic()
            part = self.part
            if include_open:
                samples, self.samples = self.samples, {}
                self.part = _part()  # what arrives later for an open bucket is another part
            else:
                open_from = int(self.latest_s // cfg.fine_s) * cfg.fine_s
                samples = {k: v for k, v in self.samples.items() if k[1] < open_from}
                for k in samples:
                    del self.samples[k]
            status, self.status = (self.status, {}) if samples or include_open else ({}, self.status)
        return samples, status, part


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
    """Buffer one heartbeat's GPU figures; write the closed buckets when a write is due (in this
    session's transaction: the caller commits). The one hook the heartbeat calls."""
    cfg = settings.metrics
    buf = _buffer(session)
    if gpus:
        buf.add(node, gpus, _epoch(now), cfg)
    if time.monotonic() - buf.last_flush >= cfg.flush_interval_s and buf.flush_lock.acquire(blocking=False):
        try:
            _write(session, buf, cfg, include_open=False)
        finally:
            buf.flush_lock.release()


def buffer_heartbeat(*, engine: Engine, node: str, gpus: Sequence, now: datetime, settings: Settings) -> None:  # noqa: ANN001
    """Buffer one heartbeat's GPU figures only, no database (a steady heartbeat answered from the
    reply cache, issue 12); ``write_due`` writes the closed buckets later."""
    if gpus:
        with _buffers_lock:
            buf = _buffers.get(engine)
            if buf is None:
                buf = _buffers[engine] = _Buffer()
        buf.add(node, gpus, _epoch(now), settings.metrics)


def write_due(*, session: Session, settings: Settings) -> int:
    """Write the closed buckets if a write is due (as ``record_heartbeat`` does), in this
    session's transaction: the caller commits. Returns the node-bucket rows written."""
    cfg = settings.metrics
    buf = _buffer(session)
    if time.monotonic() - buf.last_flush >= cfg.flush_interval_s and buf.flush_lock.acquire(blocking=False):
        try:
            return _write(session, buf, cfg, include_open=False)
        finally:
            buf.flush_lock.release()
    return 0


def flush(*, session: Session, settings: Settings, include_open: bool = True) -> int:
    """Write what is buffered (by default also the buckets still open) and commit; returns the
    node-bucket rows written."""
    buf = _buffer(session)
    with buf.flush_lock:
        written = _write(session, buf, settings.metrics, include_open=include_open)
    session.commit()
    return written


def _dialect_insert(session: Session):  # noqa: ANN202
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert

        return dialect_insert, func.greatest
    from sqlalchemy.dialects.sqlite import insert as dialect_insert

    return dialect_insert, func.max


def _upsert(session: Session, model, rows: list[dict], keys: Sequence[str], add: Sequence[str], maxed: Sequence[str],  # noqa: ANN001
            replace: Sequence[str] = ()) -> None:
    if not rows:
        return
    dialect_insert, greatest = _dialect_insert(session)
    table = model.__table__
    rows.sort(key=lambda r: tuple(r[k] for k in keys))  # one lock order across writers
    stmt = dialect_insert(table)
    ex = stmt.excluded
    updates = {c: table.c[c] + ex[c] for c in add}
    updates.update({c: greatest(table.c[c], ex[c]) for c in maxed})
    updates.update({c: ex[c] for c in replace})
    # one cached statement, executemany (batched "insertmanyvalues" under the hood)
    session.execute(stmt.on_conflict_do_update(index_elements=list(keys), set_=updates), rows)


def _write(session: Session, buf: _Buffer, cfg: MetricsSettings, *, include_open: bool) -> int:
    samples, status, part = buf.take(cfg, include_open=include_open)
    if not samples and not status:
        return 0
    nodes = sorted({k[0] for k in samples} | {k[0] for k in status})
    owner: dict[tuple[str, int], int] = {}
    if nodes:
        for job_id, node_name, gpus in session.execute(
            select(JobAllocation.job_id, JobAllocation.node_name, JobAllocation.gpus).where(
                JobAllocation.active, JobAllocation.node_name.in_(nodes)
            )
        ):
            for g in gpus or ():
                owner[(node_name, int(g))] = job_id

    fine, coarse = cfg.fine_s, cfg.coarse_s
    sample_rows = []
    roll: dict[tuple[str, str, int, int], list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0, 0.0, 0.0])
    for (node, bucket), per_gpu in samples.items():
        sample_rows.append({
            "node_name": node, "bucket": bucket, "part": part,
            "gpus": [[i, int(r[_N]), round(r[_USUM], 1), round(r[_UMAX], 1), int(r[_MEM]), round(r[_TEMP], 1),
                      round(r[_PSUM], 1), int(r[_BUSY])]
                     for i, r in sorted(per_gpu.items())],
        })
        cb = bucket // coarse * coarse
        for gpu, r in per_gpu.items():
            targets = [("cluster", "", fine, bucket), ("cluster", "", coarse, cb), ("node", node, coarse, cb)]
            job_id = owner.get((node, gpu))
            if job_id is not None:
                targets += [("job", str(job_id), fine, bucket), ("job", str(job_id), coarse, cb)]
            for t in targets:
                acc = roll[t]
                acc[0] += r[_N]
                acc[1] += r[_BUSY]
                acc[2] += r[_USUM]
                if r[_UMAX] > acc[3]:
                    acc[3] = r[_UMAX]
                acc[4] += r[_MEM] * r[_N]
                if r[_TEMP] > acc[5]:
                    acc[5] = r[_TEMP]
                acc[6] += r[_PSUM]
    if sample_rows:
        session.execute(insert(GpuSample), sample_rows)
    roll_rows = [
        {"scope": s, "key": k, "grain_s": g, "bucket": b, "n": int(a[0]), "busy_n": int(a[1]), "util_sum": a[2],
         "util_max": a[3], "mem_used_sum_mib": a[4], "temp_max_c": a[5], "power_sum_w": a[6]}
        for (s, k, g, b), a in roll.items()
    ]
    _upsert(session, MetricRollup, roll_rows, ("scope", "key", "grain_s", "bucket"),
            ("n", "busy_n", "util_sum", "mem_used_sum_mib", "power_sum_w"), ("util_max", "temp_max_c"))
    status_rows = [
        {"node_name": n, "gpu_index": g, "last_seen_at": st[0], "last_busy_at": st[1], "util_pct": st[2]}
        for (n, g), st in status.items()
    ]
    _upsert(session, GpuStatus, status_rows, ("node_name", "gpu_index"), (), ("last_seen_at", "last_busy_at"),
            replace=("util_pct",))
    session.flush()
    return len(sample_rows)


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


def _node_fine(session: Session, node: str, since: int) -> dict[int, dict[int, list[float]]]:
    """bucket -> gpu index -> [n, util_sum, util_max, mem_max, temp_max, power_sum, busy_n], the
    parts of each bucket added up."""
    out: dict[int, dict[int, list[float]]] = defaultdict(dict)
    for bucket, gpus in session.execute(
        select(GpuSample.bucket, GpuSample.gpus).where(GpuSample.node_name == node, GpuSample.bucket >= since)
        .order_by(GpuSample.bucket)
    ):
        per = out[bucket]
        for idx, n, usum, umax, mem, temp, psum, busy in gpus:
            acc = per.get(idx)
            if acc is None:
                per[idx] = [n, usum, umax, mem, temp, psum, busy]
            else:
                acc[0] += n
                acc[1] += usum
                acc[2] = max(acc[2], umax)
                acc[3] = max(acc[3], mem)
                acc[4] = max(acc[4], temp)
                acc[5] += psum
                acc[6] += busy
    return out


def series(*, session: Session, scope: str, key: str, window: str, now: datetime, settings: Settings) -> tuple[int, list[Point]]:
    """A series over the window (``hour`` | ``day`` | ``week``): (grain_s, points). Rollups,
    except a node's fine series, which its per-node GPU rows give."""
    cfg = settings.metrics
    span = WINDOWS_S[window]
    grain = _grain_for(span, cfg)
    since = int(_epoch(now) - span) // grain * grain
    if scope == "node" and grain == cfg.fine_s:
        points = []
        for b, per in sorted(_node_fine(session, key, since).items()):
            n = sum(a[0] for a in per.values())
            if n:
                points.append(Point(
                    t=b, util_avg_pct=sum(a[1] for a in per.values()) / n, util_max_pct=max(a[2] for a in per.values()),
                    busy_pct=100.0 * sum(a[6] for a in per.values()) / n,
                    mem_used_avg_mib=sum(a[3] * a[0] for a in per.values()) / n,
                    temp_max_c=max(a[4] for a in per.values()), power_avg_w=sum(a[5] for a in per.values()) / n))
        return grain, points
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
    for b, per in sorted(_node_fine(session, node, since).items()):
        for idx, (n, usum, umax, mem, temp, psum, busy) in sorted(per.items()):
            if n:
                out[idx].append(Point(t=b, util_avg_pct=usum / n, util_max_pct=umax, busy_pct=100.0 * busy / n,
                                      mem_used_avg_mib=float(mem), temp_max_c=temp, power_avg_w=psum / n))
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
        .where(JobAllocation.active, Job.state == "running",
               JobAllocation.created_at <= datetime.fromtimestamp(now_s - cfg.idle_after_s, timezone.utc))
    ).all()
    if not rows:
        return []
    status = {  # only GPUs not busy for idle_after_s can qualify; no IN list of every node
        (n, g): (seen, busy)
        for n, g, seen, busy in session.execute(
            select(GpuStatus.node_name, GpuStatus.gpu_index, GpuStatus.last_seen_at, GpuStatus.last_busy_at)
            .where(GpuStatus.last_busy_at <= now_s - cfg.idle_after_s)
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


def latest_gpu_figures(gpus: Sequence, busy_util_pct: float) -> tuple[float | None, int]:  # noqa: ANN001
    """(mean utilisation over the GPUs reporting one, or None; GPUs at or above ``busy_util_pct``)."""
    utils = [float(g.util_pct) for g in gpus if getattr(g, "util_pct", None) is not None]
    if not utils:
        return None, 0
    return sum(utils) / len(utils), sum(1 for u in utils if u >= busy_util_pct)


def latest_gpu_columns(gpus: Sequence, settings: Settings) -> dict:  # noqa: ANN001
    """A heartbeat's GPU figures as the node's columns: ``gpu_metrics`` with their mean
    utilisation and busy count folded into two columns, which the cluster summary and tree read
    (no JSON scan of every node's GPUs per page load)."""
    util, busy = latest_gpu_figures(gpus, settings.metrics.busy_util_pct)
    return {"gpu_metrics": [g.model_dump() for g in gpus], "gpu_util_pct": util, "gpus_busy": busy}


def set_latest_gpus(node, gpus: Sequence, settings: Settings) -> None:  # noqa: ANN001
    """Keep a heartbeat's GPU figures on the node (``latest_gpu_columns``)."""
    for column, value in latest_gpu_columns(gpus, settings).items():
        setattr(node, column, value)


@dataclass(frozen=True, slots=True)
class ClusterSummary:
    gpus: int
    allocated_gpus: int
    busy_gpus: int  # reporting at or above the busy threshold in their latest heartbeat
    queued_by_priority: dict[str, int]
    running_jobs: int


def cluster_summary(*, session: Session, settings: Settings) -> ClusterSummary:
    from hai.db.models import Node

    gpus, busy = session.execute(select(func.coalesce(func.sum(Node.gpus), 0), func.coalesce(func.sum(Node.gpus_busy), 0))).one()
    allocated = int(session.scalar(  # counted by the database: no GPU list decoded here
        select(func.coalesce(func.sum(func.json_array_length(JobAllocation.gpus)), 0)).where(JobAllocation.active)
    ) or 0)
    queued = {p: int(c) for p, c in session.execute(
        select(Job.priority, func.count()).where(Job.state == "queued").group_by(Job.priority))}
    running = session.scalar(select(func.count()).select_from(Job).where(Job.state == "running")) or 0
    return ClusterSummary(gpus=int(gpus), allocated_gpus=allocated, busy_gpus=int(busy), queued_by_priority=queued,
                          running_jobs=int(running))


@dataclass(frozen=True, slots=True)
class ClusterNode:
    name: str
    zone: str
    leaf: str
    state: str
    state_reason: str
    gpus: int
    allocated_gpus: int
    util_pct: float | None  # mean over the node's GPUs, latest heartbeat
    jobs: list[int]


def cluster_nodes(*, session: Session, settings: Settings) -> list[ClusterNode]:
    """Every node as the fat-tree view draws it: one light row each (no inventories)."""
    from hai.db.models import Node

    held: dict[str, int] = defaultdict(int)
    jobs: dict[str, set[int]] = defaultdict(set)
    for node, count, job_id in session.execute(
        select(JobAllocation.node_name, func.json_array_length(JobAllocation.gpus), JobAllocation.job_id)
        .where(JobAllocation.active)  # not IS true: an index-only scan of ix_job_allocations_active (0014)
    ):
        held[node] += int(count or 0)
        jobs[node].add(job_id)
    out = []
    for name, zone, leaf, state, reason, gpus, util in session.execute(
        select(Node.name, Node.zone, Node.leaf, Node.state, Node.state_reason, Node.gpus, Node.gpu_util_pct)
        .order_by(Node.zone, Node.leaf, Node.name)
    ):
        out.append(ClusterNode(name=name, zone=zone, leaf=leaf, state=state, state_reason=reason, gpus=gpus,
                               allocated_gpus=held.get(name, 0), util_pct=util,
                               jobs=sorted(jobs.get(name, ()))))
    return out
