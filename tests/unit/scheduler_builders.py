"""Small fluent builders for scheduler tests (DESIGN.md pattern 10, after Kueue's wrappers).

    c = cluster().zone("A", leaves=2, nodes_per_leaf=4)
    c.run(job("low").nodes(2).priority("LOW").started(0).user("bob"))
    snap = c.queue(job("high").nodes(4).priority("HIGH")).snapshot()

Node names are ``<zone>-l<leaf>-n<node>`` (``A-l0-n3``); leaves ``A-l0``. Job names map to
stable integer ids (first use = 1, 2, ...), see ``Cluster.id_of``. Running jobs take GPUs from
the nodes named in ``.on(...)``, or the first free ones in node order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hai.domain.jobs import JobState, Priority
from hai.domain.scheduler.model import FIFO_LEVELS
from hai.domain.scheduler import (
    Allocation,
    NodeView,
    Policy,
    QueuedJob,
    Quota,
    RunningJob,
    Snapshot,
)


class JobBuilder:
    def __init__(self, name: str):
        self.name = name
        self._nodes = 1
        self._gpus_per_node = 8
        self._priority = Priority.NORMAL
        self._submitted_priority: Priority | None = None
        self._user = "alice"
        self._group = "research"
        self._submitted = 0.0
        self._queued_at: float | None = None
        self._started = 0.0
        self._checkpoint: float | None = None
        self._on: list[tuple[str, tuple[int, ...] | None]] = []
        self._state = JobState.RUNNING
        self._cross = False
        self._min_runtime: float | None = None
        self._suspend_for: str | None = None
        self._reserved: tuple[str, ...] = ()
        self._suspensions = 0
        self._attained = 0.0

    def nodes(self, n: int) -> JobBuilder:
        self._nodes = n
        return self

    def gpus(self, n: int) -> JobBuilder:
        """GPUs per node (default 8)."""
        self._gpus_per_node = n
        return self

    def priority(self, p: str | Priority) -> JobBuilder:
        self._priority = Priority(p)
        return self

    def asked(self, p: str | Priority) -> JobBuilder:
        """The priority the user submitted with (before any demotion)."""
        self._submitted_priority = Priority(p)
        return self

    def user(self, u: str) -> JobBuilder:
        self._user = u
        return self

    def group(self, g: str) -> JobBuilder:
        self._group = g
        return self

    def submitted(self, t: float) -> JobBuilder:
        self._submitted = t
        return self

    def queued_at(self, t: float) -> JobBuilder:
        self._queued_at = t
        return self

    def started(self, t: float) -> JobBuilder:
        self._started = t
        return self

    def checkpoint(self, t: float) -> JobBuilder:
        self._checkpoint = t
        return self

    def on(self, node: str, gpus: tuple[int, ...] | None = None) -> JobBuilder:
        self._on.append((node, gpus))
        return self

    def state(self, s: str | JobState) -> JobBuilder:
        self._state = JobState(s)
        return self

    def cross_zone(self) -> JobBuilder:
        self._cross = True
        return self

    def min_runtime(self, s: float) -> JobBuilder:
        self._min_runtime = s
        return self

    def suspending_for(self, name: str) -> JobBuilder:
        self._state = JobState.SUSPENDING
        self._suspend_for = name
        return self

    def reserved(self, *nodes: str) -> JobBuilder:
        self._reserved = tuple(nodes)
        return self

    def attained(self, gpu_s: float) -> JobBuilder:
        """GPU-seconds of its earlier attempts (attained service)."""
        self._attained = gpu_s
        return self

    def suspensions(self, n: int) -> JobBuilder:
        self._suspensions = n
        return self


def job(name: str) -> JobBuilder:
    return JobBuilder(name)


@dataclass
class _Node:
    name: str
    zone: str
    leaf: str
    gpus: int
    free: list[int]
    schedulable: bool = True


@dataclass
class Cluster:
    _nodes: list[_Node] = field(default_factory=list)
    _running: list[RunningJob] = field(default_factory=list)
    _queued: list[QueuedJob] = field(default_factory=list)
    _quotas: list[Quota] = field(default_factory=list)
    _usage: dict[str, float] = field(default_factory=dict)
    _ids: dict[str, int] = field(default_factory=dict)

    def id_of(self, name: str) -> int:
        if name not in self._ids:
            self._ids[name] = len(self._ids) + 1
        return self._ids[name]

    def name_of(self, job_id: int) -> str:
        for k, v in self._ids.items():
            if v == job_id:
                return k
        raise KeyError(job_id)

    def zone(self, name: str, leaves: int = 1, nodes_per_leaf: int = 4, gpus: int = 8) -> Cluster:
        for li in range(leaves):
            for ni in range(nodes_per_leaf):
                self._nodes.append(_Node(f"{name}-l{li}-n{ni}", name, f"{name}-l{li}", gpus, list(range(gpus))))
        return self

    def node(self, name: str, zone: str = "A", leaf: str = "A-l0", gpus: int = 8) -> Cluster:
        self._nodes.append(_Node(name, zone, leaf, gpus, list(range(gpus))))
        return self

    def unschedulable(self, *names: str) -> Cluster:
        for n in self._nodes:
            if n.name in names:
                n.schedulable = False
        return self

    def _node(self, name: str) -> _Node:
        for n in self._nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def run(self, b: JobBuilder) -> Cluster:
        """Add a running job holding GPUs (from ``.on(...)`` nodes, else first free in order)."""
        allocs: list[Allocation] = []
        if b._on:
            for node, gpus in b._on:
                n = self._node(node)
                take = tuple(gpus) if gpus is not None else tuple(n.free[: b._gpus_per_node])
                if len(take) != b._gpus_per_node or any(g not in n.free for g in take):
                    raise ValueError(f"{b.name}: node {node} lacks {b._gpus_per_node} free GPUs")
                n.free = [g for g in n.free if g not in take]
                allocs.append(Allocation(node, take))
        else:
            for _ in range(b._nodes):
                cands = [n for n in self._nodes if len(n.free) >= b._gpus_per_node and n.name not in [a.node for a in allocs]]
                if b._nodes > 1 or b._gpus_per_node == 8:
                    cands = [n for n in cands if len(n.free) == n.gpus]
                if not cands:
                    raise ValueError(f"{b.name}: no room")
                n = cands[0]
                take = tuple(n.free[: b._gpus_per_node])
                n.free = n.free[b._gpus_per_node :]
                allocs.append(Allocation(n.name, take))
        self._running.append(
            RunningJob(
                id=self.id_of(b.name),
                user=b._user,
                group=b._group,
                priority=b._priority,
                nodes=len(allocs),
                gpus_per_node=b._gpus_per_node,
                allocations=tuple(allocs),
                state=b._state,
                started_at=b._started,
                first_submitted_at=b._submitted,
                submitted_priority=b._submitted_priority or b._priority,
                last_checkpoint_at=b._checkpoint,
                allow_cross_zone=b._cross,
                min_runtime_s=b._min_runtime,
                suspend_requested_for=self.id_of(b._suspend_for) if b._suspend_for else None,
                attained_gpu_s=b._attained,
            )
        )
        return self

    def queue(self, *builders: JobBuilder) -> Cluster:
        for b in builders:
            self._queued.append(
                QueuedJob(
                    id=self.id_of(b.name),
                    user=b._user,
                    group=b._group,
                    priority=b._priority,
                    nodes=b._nodes,
                    gpus_per_node=b._gpus_per_node,
                    first_submitted_at=b._submitted,
                    queued_at=b._queued_at if b._queued_at is not None else b._submitted,
                    submitted_priority=b._submitted_priority or b._priority,
                    allow_cross_zone=b._cross,
                    suspensions=b._suspensions,
                    reserved_nodes=b._reserved,
                    attained_gpu_s=b._attained,
                )
            )
        return self

    def quota(self, group: str, priority: str, gpus: int, user: str | None = None) -> Cluster:
        self._quotas.append(Quota(group, Priority(priority), gpus, user))
        return self

    def usage(self, user: str, gpu_s: float) -> Cluster:
        self._usage[user] = gpu_s
        return self

    def snapshot(self) -> Snapshot:
        return Snapshot(
            nodes=tuple(NodeView(n.name, n.zone, n.leaf, n.gpus, tuple(n.free), n.schedulable) for n in self._nodes),
            running=tuple(self._running),
            queued=tuple(self._queued),
            quotas=tuple(self._quotas),
            usage=dict(self._usage),
        )


def cluster() -> Cluster:
    return Cluster()


def policy(**kw) -> Policy:
    return replace(Policy(**FIFO_LEVELS), **kw)  # the FIFO levels unless a test asks for more


def nodes_of(decisions, job_id: int) -> list[str]:
    for s in decisions.starts:
        if s.job_id == job_id:
            return [a.node for a in s.allocations]
    raise AssertionError(f"job {job_id} did not start: {decisions.pending_reasons.get(job_id)!r}")


def leaves_of(names: list[str]) -> list[str]:
    return sorted({n.rsplit("-", 1)[0] for n in names})


__all__ = ["cluster", "index_facts", "job", "leaves_of", "nodes_of", "policy"]


def index_facts(index) -> tuple:
    """Everything a cycle reads of a free index: each slot's fields, the name map, the GPU
    bounds, the idle nodes per leaf and zone, the partly used nodes by free GPUs."""
    slots = [(s.ord, s.name, s.zone, s.leaf, s.zone_ix, s.leaf_ix, s.gpus, list(s.free), s.indexed) for s in index.slots]
    return (slots, {n: s.ord for n, s in index.by_name.items()}, all(index.by_name[s.name] is s for s in index.slots),
            index.max_gpus, index.homogeneous, [lf.idle for lf in index.leaves], index.zone_idle, index.partial)

