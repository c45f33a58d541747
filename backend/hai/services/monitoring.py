"""The figures `/metrics` exports for Prometheus, read from the database at scrape time."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from hai.db.models import Job, JobAllocation, Node
from hai.domain.nodes import NodeState


@dataclass(frozen=True, slots=True)
class NodeGauges:
    name: str
    zone: str
    leaf: str
    state: str
    util_pct: float | None  # mean over the node's GPUs, latest heartbeat
    memory_used_mib: int
    memory_total_mib: int
    temperature_max_c: float | None
    power_w: float | None  # sum over the node's GPUs


@dataclass(frozen=True, slots=True)
class ClusterGauges:
    jobs: dict[tuple[str, str], int]  # (state, priority) -> count
    nodes: dict[str, int]  # state -> count
    gpus_ready: int
    gpus_allocated: int
    queue_wait_max_s: dict[str, float]  # priority -> oldest queued job's wait
    queue_wait_avg_s: dict[str, float]
    node_gauges: list[NodeGauges] = field(default_factory=list)


def cluster_gauges(*, session: Session, now: datetime) -> ClusterGauges:
    jobs = {(s, p): int(c) for s, p, c in session.execute(
        select(Job.state, Job.priority, func.count()).group_by(Job.state, Job.priority))}
    nodes = {s: int(c) for s, c in session.execute(select(Node.state, func.count()).group_by(Node.state))}
    ready = session.scalar(select(func.coalesce(func.sum(Node.gpus), 0)).where(Node.state == NodeState.READY.value)) or 0
    held = sum(len(g) for g in session.scalars(select(JobAllocation.gpus).where(JobAllocation.active)))
    waits: dict[str, list[float]] = {}
    for priority, queued_at in session.execute(select(Job.priority, Job.queued_at).where(Job.state == "queued")):
        waits.setdefault(priority, []).append(max(0.0, (now - queued_at).total_seconds()))
    node_gauges = []
    for n in session.scalars(select(Node).order_by(Node.name)):
        m = n.gpu_metrics or []
        utils = [g.get("util_pct") for g in m if g.get("util_pct") is not None]
        temps = [g.get("temperature_c") for g in m if g.get("temperature_c") is not None]
        powers = [g.get("power_w") for g in m if g.get("power_w") is not None]
        node_gauges.append(NodeGauges(
            name=n.name, zone=n.zone, leaf=n.leaf, state=n.state,
            util_pct=sum(utils) / len(utils) if utils else None,
            memory_used_mib=sum(int(g.get("memory_used_mib") or 0) for g in m),
            memory_total_mib=sum(int(g.get("memory_total_mib") or 0) for g in m),
            temperature_max_c=max(temps) if temps else None,
            power_w=sum(powers) if powers else None,
        ))
    return ClusterGauges(
        jobs=jobs, nodes=nodes, gpus_ready=int(ready), gpus_allocated=held,
        queue_wait_max_s={p: max(w) for p, w in waits.items()},
        queue_wait_avg_s={p: sum(w) / len(w) for p, w in waits.items()},
        node_gauges=node_gauges,
    )
