"""Job traces for the simulator.

A trace is CSV with ``timestamp`` (a date time such as ``2017-10-09 07:01:55``, or seconds),
``duration`` (seconds of run time), ``num_gpus``, and optionally ``priority``, ``user``,
``group``. When ``user``/``group`` are absent, a ``cluster`` column (the Philly trace's virtual
cluster) stands for both, so time-sharing and usage ordering see the trace's real tenants;
without either, every job belongs to user ``user`` of group ``default``.

A job of more than ``gpus_per_node`` (8) GPUs takes ceil(n/8) whole nodes of 8 GPUs; a smaller
job takes n GPUs on one node. Arrival times are shifted so the first job arrives at 0, then
divided by ``time_scale`` (2 = arrivals twice as dense; durations are unchanged).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from datetime import UTC, datetime

from hai.domain.jobs import Priority


class TraceError(ValueError):
    pass


@dataclass(frozen=True)
class TraceJob:
    id: int
    submit_s: float
    duration_s: float
    num_gpus: int  # as asked in the trace
    nodes: int
    gpus_per_node: int
    priority: Priority
    user: str
    group: str

    @property
    def gpus(self) -> int:
        """GPUs the job holds when it runs (whole nodes for jobs of more than one node)."""
        return self.nodes * self.gpus_per_node


def _seconds(value: str) -> float:
    v = value.strip()
    try:
        return float(v)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(v)
    except ValueError:
        raise TraceError(f"timestamp {value!r} is neither seconds nor a date time") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def _priority(value: str | None) -> Priority:
    if value is None or not value.strip():
        return Priority.NORMAL
    v = value.strip().upper()
    try:
        return Priority(v)
    except ValueError:
        raise TraceError(f"unknown priority {value!r} (one of {', '.join(p.value for p in Priority)})") from None


def parse_trace(
    text: str, *, time_scale: float = 1.0, limit: int | None = None, gpus_per_node: int = 8
) -> tuple[list[TraceJob], int]:
    """Parse trace CSV text. Returns (jobs in arrival order with ids 1.., rows skipped).

    Rows with fewer than 1 GPU or a negative duration are skipped and counted. ``limit`` keeps
    the first N jobs by arrival time."""
    if time_scale <= 0:
        raise TraceError("time scale must be > 0")
    reader = csv.DictReader(io.StringIO(text))
    cols = reader.fieldnames or []
    for need in ("timestamp", "duration", "num_gpus"):
        if need not in cols:
            raise TraceError(f"trace lacks column {need!r}; needs timestamp,duration,num_gpus")
    has_user, has_group, has_cluster, has_prio = "user" in cols, "group" in cols, "cluster" in cols, "priority" in cols
    rows: list[tuple[float, int, float, int, Priority, str, str]] = []
    skipped = 0
    for i, row in enumerate(reader):
        try:
            ts = _seconds(row["timestamp"])
            duration = float(row["duration"])
            n = int(float(row["num_gpus"]))
        except (TypeError, ValueError) as exc:
            raise TraceError(f"row {i + 2}: {exc}") from None
        if n < 1 or duration < 0 or math.isnan(duration):
            skipped += 1
            continue
        tenant = (row.get("cluster") or "").strip() if has_cluster else ""
        user = ((row.get("user") or "").strip() if has_user else "") or tenant or "user"
        group = ((row.get("group") or "").strip() if has_group else "") or tenant or "default"
        prio = _priority(row.get("priority")) if has_prio else Priority.NORMAL
        rows.append((ts, i, duration, n, prio, user, group))
    rows.sort(key=lambda r: (r[0], r[1]))
    if limit is not None:
        rows = rows[: max(0, limit)]
    t0 = rows[0][0] if rows else 0.0
    jobs = []
    for k, (ts, _i, duration, n, prio, user, group) in enumerate(rows, start=1):
        if n > gpus_per_node:
            nodes, per = math.ceil(n / gpus_per_node), gpus_per_node
        else:
            nodes, per = 1, n
        jobs.append(TraceJob(k, (ts - t0) / time_scale, duration, n, nodes, per, prio, user, group))
    return jobs, skipped
