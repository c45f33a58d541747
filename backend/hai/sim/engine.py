"""Trace replay with a virtual clock, through the same domain scheduler the live service calls.

The engine plays the service's part: it keeps the job states, builds a Snapshot each cycle,
calls ``schedule(snapshot, policy, now)`` and applies the Decisions. It also checks them
independently (a GPU handed out twice, a job spanning zones, a quota exceeded) and measures.

Model of a job (all in virtual seconds):

* it needs ``duration`` seconds of progress; a resumed attempt first spends ``restart_cost_s``
  holding its GPUs without progress;
* it checkpoints every ``checkpoint_interval_s`` of progress in an attempt;
* asked to suspend, it stops: the progress since its last checkpoint is lost (``lost_gpu_s``),
  and it holds its GPUs ``checkpoint_cost_s`` longer while it stops; then it is queued again
  (first submission time kept). A job that would finish within ``checkpoint_cost_s`` finishes.

A cycle runs at every time something happens (arrival, end, release) and at the times a rule
can change its mind (a job reaches the minimum runtime or the quantum, a waiting job passes the
wait threshold, an ABOVE_NORMAL job reaches the demotion age), like an event-driven live loop,
and skips the cycles that provably cannot decide anything new (``sim/skipping.py``).
"""

from __future__ import annotations

import heapq
import math
import statistics
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from hai.domain.jobs import JobState, Priority
from hai.domain.scheduler import KeptQueue
from hai.domain.scheduler import schedule as hai_schedule
from hai.domain.scheduler.core import service_class
from hai.domain.scheduler.model import (
    Decisions,
    NodeView,
    Policy,
    QueuedJob,
    Quota,
    RunningJob,
    Snapshot,
)
from hai.domain.scheduler.placement import min_leaves
from hai.domain.scheduler.quota import QuotaBook
from hai.domain.scheduler.victims import DEMOTED
from hai.domain.topology import TopologyNode
from hai.sim.skipping import IdleCycleRules
from hai.sim.trace import TraceJob

Scheduler = Callable[[Snapshot, Policy, float], Decisions]

_ARRIVE, _RELEASE, _FINISH = 0, 1, 2
# wake-ups: times at which a time-based rule can change the scheduler's mind
_W_QUANTUM, _W_THRESHOLD, _W_MINRT, _W_DEMOTE, _W_CYCLE = 3, 4, 5, 6, 7
_EPS = 1e-6  # (event-driven mode) wake-ups land just after a threshold: float rounding cannot hide it
_PENDING, _QUEUED, _RUNNING, _SUSPENDING, _DONE, _REJECTED = range(6)


@dataclass(frozen=True)
class SimConfig:
    checkpoint_interval_s: float = 300.0
    checkpoint_cost_s: float = 10.0
    restart_cost_s: float = 30.0
    # cycles run on this grid, like the live loop (HAI_SCHEDULER__INTERVAL_S): everything that
    # happened in (T - interval, T] is decided at T. 0: a cycle at the exact time of each event.
    cycle_interval_s: float = 1.0


class _Job:
    __slots__ = (
        "allocs",
        "attained",
        "attempt",
        "attempt_start",
        "end",
        "expired_rank",
        "first_start",
        "priority",
        "progress_start",
        "queued_since",
        "queued_total",
        "ready_rank",
        "state",
        "suspend_for",
        "suspensions",
        "t",
        "work_done",
    )

    def __init__(self, t: TraceJob):
        self.t = t
        self.state = _PENDING
        self.priority = t.priority
        self.work_done = 0.0
        self.attained = 0.0  # GPU-seconds held in earlier attempts (attained service)
        self.attempt = 0
        self.attempt_start = 0.0
        self.progress_start = 0.0
        self.allocs: tuple = ()
        self.first_start: float | None = None
        self.end: float | None = None
        self.queued_since = 0.0
        self.queued_total = 0.0
        self.suspensions = 0
        self.suspend_for: int | None = None
        self.ready_rank: int | None = None  # counted in IdleCycleRules.ready (waited past the threshold)
        self.expired_rank: int | None = None  # counted in IdleCycleRules.expired (ran past the quantum)


@dataclass
class SimResult:
    metrics: dict
    wall_s: float = 0.0
    cycles: int = 0
    notes: list[str] = field(default_factory=list)


class _Usage(Mapping[str, float]):
    """Each user's decayed GPU-seconds as of one cycle, computed when the scheduler asks (it
    reads a few users' values, when it orders time-sharing candidates)."""

    def __init__(self, sim: Simulation, t: float):
        self._sim = sim
        self._t = t

    def __getitem__(self, user: str) -> float:
        u = self._sim.usage[user]
        self._sim._usage_roll(u, self._t)
        return u[0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sim.usage)

    def __len__(self) -> int:
        return len(self._sim.usage)


class Simulation:
    def __init__(
        self,
        topology: list[TopologyNode],
        jobs: list[TraceJob],
        *,
        policy: Policy,
        scheduler: Scheduler = hai_schedule,
        policy_name: str = "hai",
        config: SimConfig = SimConfig(),
        quotas: tuple[Quota, ...] = (),
    ):
        if config.checkpoint_interval_s <= 0:
            raise ValueError("checkpoint interval must be > 0")
        self.grid = max(0.0, config.cycle_interval_s)
        self.eps = 0.0 if self.grid > 0 else _EPS
        self.policy = policy
        self.scheduler = scheduler
        # the queue kept across cycles for the hai scheduler (issue 12; the same decisions as
        # from scratch, the queue views are kept objects until a job's view changes)
        self.kept = KeptQueue() if scheduler is hai_schedule else None
        self.policy_name = policy_name
        self.cfg = config
        self.quotas = tuple(quotas)
        # skip cycles that cannot decide anything new (False: a cycle after every event, to
        # check that skipping changes no decision)
        self.skip_idle_cycles = True
        self.nodes = list(topology)
        self.node_ix = {n.name: i for i, n in enumerate(self.nodes)}
        self.free: list[list[int]] = [list(range(n.gpus)) for n in self.nodes]
        self.views: list[NodeView] = [NodeView(n.name, n.zone, n.leaf, n.gpus, tuple(range(n.gpus))) for n in self.nodes]
        self.dirty: list[int] = []
        self.total_gpus = sum(n.gpus for n in self.nodes)
        self.zone_leaf_idle: dict[str, dict[str, int]] = {}
        for n in self.nodes:
            zl = self.zone_leaf_idle.setdefault(n.zone, {})
            zl[n.leaf] = zl.get(n.leaf, 0) + 1
        # the largest job shape each zone can ever hold: whole nodes of >= g GPUs
        self.jobs = {t.id: _Job(t) for t in jobs}
        self.queue: dict[int, _Job] = {}
        self.running: dict[int, _Job] = {}
        self.reservations: dict[int, tuple[str, ...]] = {}
        # the snapshot's views, kept up to date as things change (not rebuilt each cycle)
        self.rviews: dict[int, RunningJob] = {}
        self.qviews: dict[int, QueuedJob] = {}
        self.ckpt_heap: list[tuple[float, int, int]] = []  # (next checkpoint, job id, attempt)
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.max_rank = max((t.priority.rank for t in jobs), default=0)
        self.min_rank = min((t.priority.rank for t in jobs), default=0)
        self.stale: dict[int, int] = {}  # running job id -> attempt whose checkpoint view lags
        self.queued_by_rank: dict[int, int] = {}
        self.running_by_rank: dict[int, int] = {}
        self.queued_shapes: dict[tuple[int, int], int] = {}  # (nodes, GPUs a node) -> queued jobs
        # which events are worth a cycle (sim/skipping.py)
        self.rules = IdleCycleRules(self)
        # a baseline (sim/las.py, sim/easy_fs.py) decides after every event and asks for a
        # cycle at its own wake-up times; it may read the simulator's oracle facts
        self.baseline = bool(getattr(scheduler, "every_event", False))
        # least attained service (Policy.service_classes_gpu_s): a running job's class changes
        # as it runs, which the idle-cycle rules do not model: a cycle after every event, and
        # at each time a running job crosses a class threshold or ends its minimum runtime
        self.las = bool(policy.service_classes_gpu_s) and not self.baseline
        self.every_event = self.baseline or self.las
        self._wake_at: float | None = None
        if hasattr(scheduler, "bind"):
            scheduler.bind(self)
        # usage per user: decayed GPU-seconds, updated when a user's GPU count changes
        self.half_life = policy.usage_half_life_s
        self.lam = math.log(2) / self.half_life if self.half_life > 0 else 0.0
        self.usage: dict[str, list[float]] = {}  # user -> [value, at, gpus held]
        # measurements
        self.allocated = 0
        self.busy_gpu_s = 0.0
        self.last_t = 0.0
        self.preemptions = 0
        self.lost_gpu_s = 0.0
        self.overhead_gpu_s = 0.0
        self.multi_node_starts = 0
        self.multi_node_jobs: dict[int, bool] = {}
        self.min_leaf_ok = 0
        self.cross_zone_jobs: dict[int, bool] = {}
        self.double_allocations = 0
        self.invalid_decisions = 0
        self.quota_violations = 0
        self.rejected = 0
        self.cycles = 0
        for t in jobs:
            self._push(t.submit_s, _ARRIVE, t.id, 0)

    # -- plumbing ------------------------------------------------------------------------------
    def _push(self, at: float, kind: int, job_id: int, attempt: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, kind, self.seq, job_id, attempt))

    def _advance(self, t: float) -> None:
        if t > self.last_t:
            self.busy_gpu_s += self.allocated * (t - self.last_t)
            self.last_t = t

    def _usage_set(self, user: str, t: float, delta: int) -> None:
        u = self.usage.get(user)
        if u is None:
            u = self.usage[user] = [0.0, t, 0]
        self._usage_roll(u, t)
        u[2] += delta

    def _usage_roll(self, u: list[float], t: float) -> None:
        dt = t - u[1]
        if dt > 0:
            if self.lam > 0:
                decay = math.exp(-self.lam * dt)
                u[0] = u[0] * decay + u[2] * (1 - decay) / self.lam
            else:
                u[0] += u[2] * dt
            u[1] = t

    def _fits_ever(self, t: TraceJob) -> bool:
        if t.nodes == 1:
            return any(n.gpus >= t.gpus_per_node for n in self.nodes)
        per_zone: dict[str, int] = {}
        for n in self.nodes:
            if n.gpus >= t.gpus_per_node:
                per_zone[n.zone] = per_zone.get(n.zone, 0) + 1
        return max(per_zone.values(), default=0) >= t.nodes

    def _hold(self, j: _Job, allocs) -> None:
        for a in allocs:
            i = self.node_ix[a.node]
            f = self.free[i]
            node = self.nodes[i]
            if len(f) == node.gpus:
                self.zone_leaf_idle[node.zone][node.leaf] -= 1
            for g in a.gpus:
                f.remove(g)
            self.dirty.append(i)
        n = sum(len(a.gpus) for a in allocs)
        self.allocated += n
        self._usage_set(j.t.user, self.last_t, n)

    def _release_gpus(self, j: _Job) -> None:
        for a in j.allocs:
            i = self.node_ix[a.node]
            f = self.free[i]
            f.extend(a.gpus)
            f.sort()
            node = self.nodes[i]
            if len(f) == node.gpus:
                self.zone_leaf_idle[node.zone][node.leaf] += 1
            self.dirty.append(i)
        n = sum(len(a.gpus) for a in j.allocs)
        self.allocated -= n
        self._usage_set(j.t.user, self.last_t, -n)
        j.allocs = ()
        self.rviews.pop(j.t.id, None)
        self.running_by_rank[j.priority.rank] -= 1

    def _enqueue(self, j: _Job, t: float) -> None:
        j.state = _QUEUED
        j.queued_since = t
        self.queue[j.t.id] = j
        self._qview(j, ())
        r = j.priority.rank
        self.queued_by_rank[r] = self.queued_by_rank.get(r, 0) + 1
        shape = (j.t.nodes, j.t.gpus_per_node)
        self.queued_shapes[shape] = self.queued_shapes.get(shape, 0) + 1
        if self.policy.time_sharing and self.policy.preemption and not self.baseline:
            self._push(t + self.policy.wait_threshold_s + self.eps, _W_THRESHOLD, j.t.id, j.attempt)

    # -- events --------------------------------------------------------------------------------
    def _handle(self, kind: int, job_id: int, attempt: int, t: float) -> bool | None:
        """Apply one event. True: a cycle now may decide something new; False: it cannot (its
        decisions would be the last cycle's); None: a stale event (nothing happened)."""
        if kind == _W_CYCLE:
            if self._wake_at is not None and t >= self._wake_at:
                self._wake_at = None
            return True
        j = self.jobs[job_id]
        if kind == _ARRIVE:
            if not self._fits_ever(j.t):
                j.state = _REJECTED
                self.rejected += 1
                return None
            self._enqueue(j, t)
            return self.rules.after_arrival(j)
        if kind == _FINISH:
            if j.attempt != attempt or j.state not in (_RUNNING, _SUSPENDING):
                return None
            freed = [self.node_ix[a.node] for a in j.allocs]
            self.rules.unexpire(j)
            self._release_gpus(j)
            del self.running[job_id]
            j.state = _DONE
            j.end = t
            return self.rules.after_finish(freed)
        if kind == _RELEASE:
            if j.attempt != attempt or j.state != _SUSPENDING:
                return None
            self._release_gpus(j)
            del self.running[job_id]
            j.suspensions += 1
            j.suspend_for = None
            self._enqueue(j, t)
            return True
        # a wake-up: worth a cycle only if the rule it stands for can fire now
        if kind == _W_THRESHOLD:
            if j.state != _QUEUED or j.attempt != attempt:
                return None
            return self.rules.after_threshold(j)
        if j.state != _RUNNING or j.attempt != attempt:
            return None
        if kind == _W_QUANTUM:
            if self.stale.pop(job_id, None) == attempt:
                self._rview(j, t)
            return self.rules.after_quantum(j)
        if kind == _W_MINRT:
            return self.rules.after_min_runtime(j)
        return self.rules.after_demotion_age(j)  # _W_DEMOTE

    # -- snapshot ------------------------------------------------------------------------------
    def _qview(self, j: _Job, reserved: tuple[str, ...]) -> None:
        t0 = j.t
        self.qviews[t0.id] = QueuedJob(
            id=t0.id,
            user=t0.user,
            group=t0.group,
            priority=j.priority,
            nodes=t0.nodes,
            gpus_per_node=t0.gpus_per_node,
            first_submitted_at=t0.submit_s,
            queued_at=j.queued_since,
            submitted_priority=t0.priority,
            suspensions=j.suspensions,
            reserved_nodes=reserved,
            attained_gpu_s=j.attained,
        )

    def _last_checkpoint(self, j: _Job, t: float) -> float | None:
        """The last periodic checkpoint of the current attempt at time t (None: none yet)."""
        ci = self.cfg.checkpoint_interval_s
        since = t - j.progress_start
        if since < ci:
            return None
        k = math.floor(since / ci)
        if j.progress_start + (k + 1) * ci <= t:  # float rounding
            k += 1
        return j.progress_start + k * ci

    def _rview(self, j: _Job, t: float) -> None:
        last_ckpt = self._last_checkpoint(j, t)
        t0 = j.t
        self.rviews[t0.id] = RunningJob(
            id=t0.id,
            user=t0.user,
            group=t0.group,
            priority=j.priority,
            nodes=t0.nodes,
            gpus_per_node=t0.gpus_per_node,
            allocations=j.allocs,
            state=JobState.SUSPENDING if j.state == _SUSPENDING else JobState.RUNNING,
            started_at=j.attempt_start,
            first_submitted_at=t0.submit_s,
            submitted_priority=t0.priority,
            last_checkpoint_at=last_ckpt,
            suspend_requested_for=j.suspend_for,
            attained_gpu_s=j.attained,
        )
        ci = self.cfg.checkpoint_interval_s
        k = 1 if last_ckpt is None else round((last_ckpt - j.progress_start) / ci) + 1
        nxt = j.progress_start + k * ci
        if nxt <= t:  # float rounding: never schedule the refresh in the past (it would spin)
            nxt = t + ci
        heapq.heappush(self.ckpt_heap, (nxt, t0.id, j.attempt))

    def _snapshot(self, t: float) -> Snapshot:
        if self.dirty:
            for i in dict.fromkeys(self.dirty):
                v = self.views[i]
                self.views[i] = NodeView(v.name, v.zone, v.leaf, v.gpus, tuple(self.free[i]))
            self.dirty.clear()
        # refresh the last checkpoint of jobs that passed one since the last cycle
        ch = self.ckpt_heap
        multi_prio = len([r for r, n in self.queued_by_rank.items() if n > 0]) > 1 or self.max_rank != self.min_rank
        while ch and ch[0][0] <= t:
            _at, jid, attempt = heapq.heappop(ch)
            j = self.jobs[jid]
            if j.attempt == attempt and j.state == _RUNNING:
                if multi_prio or j.expired_rank is not None or self.las:
                    # (least attained service: any running job past its minimum runtime may be
                    # a victim, chosen by the GPU-time since its last checkpoint, so that must
                    # be current, as the live snapshot's is)
                    self._rview(j, t)
                else:
                    # cannot be a victim now (a single priority, not past its quantum): its last
                    # checkpoint is refreshed when it passes the quantum
                    self.stale[jid] = attempt
        usage = _Usage(self, t)
        return Snapshot(tuple(self.views), tuple(self.rviews.values()), tuple(self.qviews.values()), self.quotas, usage)

    # -- applying decisions ----------------------------------------------------------------------
    def _apply(self, d: Decisions, t: float) -> None:
        pol, cfg = self.policy, self.cfg
        for dm in d.demotions:
            j = self.jobs.get(dm.job_id)
            if j is None or j.state != _RUNNING:
                self.invalid_decisions += 1
                continue
            self.running_by_rank[j.priority.rank] -= 1
            j.priority = dm.to
            self.running_by_rank[j.priority.rank] = self.running_by_rank.get(j.priority.rank, 0) + 1
            self._rview(j, t)
        for s in d.suspends:
            j = self.jobs.get(s.job_id)
            if j is None or j.state != _RUNNING:
                self.invalid_decisions += 1  # e.g. suspending a job twice
                continue
            self.preemptions += 1
            self.rules.unexpire(j)
            j.attained += max(0.0, t - j.attempt_start) * j.t.gpus
            j.suspend_for = s.for_job_id
            j.state = _SUSPENDING
            self._rview(j, t)
            g = j.t.gpus
            progress = max(0.0, t - j.progress_start)
            remaining = j.t.duration_s - j.work_done - progress
            if remaining <= cfg.checkpoint_cost_s:
                continue  # finishes before it could stop; its FINISH event stands
            last = self._last_checkpoint(j, t)
            saved = 0.0 if last is None else last - j.progress_start
            self.lost_gpu_s += max(0.0, progress - saved) * g
            self.overhead_gpu_s += cfg.checkpoint_cost_s * g
            j.work_done += saved
            j.attempt += 1  # the old FINISH event no longer counts
            self._push(t + cfg.checkpoint_cost_s, _RELEASE, j.t.id, j.attempt)
        old_res = self.reservations
        quota = None
        if self.quotas:
            quota = QuotaBook(self.quotas)
            for r in self.running.values():
                quota.charge(r.t.group, r.priority.rank, r.t.user, r.t.gpus)
        for st in d.starts:
            j = self.jobs.get(st.job_id)
            if j is None or j.state != _QUEUED:
                self.invalid_decisions += 1
                continue
            tj = j.t
            ok = len(st.allocations) == tj.nodes and len({a.node for a in st.allocations}) == tj.nodes
            if ok:
                for a in st.allocations:
                    i = self.node_ix.get(a.node)
                    if i is None or len(a.gpus) != tj.gpus_per_node or len(set(a.gpus)) != len(a.gpus):
                        ok = False
                        break
                    f = self.free[i]
                    if any(g not in f for g in a.gpus):
                        self.double_allocations += 1
                        ok = False
                        break
            if not ok:
                self.invalid_decisions += 1
                continue
            zones = {self.nodes[self.node_ix[a.node]].zone for a in st.allocations}
            if len(zones) > 1:
                self.cross_zone_jobs[tj.id] = True
            if tj.nodes > 1:
                self.multi_node_starts += 1
                self.multi_node_jobs[tj.id] = True
                if self._min_leaves_ok(j, st.allocations, old_res, d.reservations, t):
                    self.min_leaf_ok += 1
            if quota is not None:
                quota.charge(tj.group, j.priority.rank, tj.user, tj.gpus)
            # start it
            del self.queue[tj.id]
            del self.qviews[tj.id]
            self.queued_by_rank[j.priority.rank] -= 1
            self.queued_shapes[(tj.nodes, tj.gpus_per_node)] -= 1
            self.rules.left_queue(j)
            j.queued_total += t - j.queued_since
            j.allocs = st.allocations
            self._hold(j, st.allocations)
            j.state = _RUNNING
            if j.first_start is None:
                j.first_start = t
            j.attempt_start = t
            j.progress_start = t + (cfg.restart_cost_s if j.suspensions else 0.0)
            if j.suspensions:
                self.overhead_gpu_s += cfg.restart_cost_s * tj.gpus
            j.attempt += 1
            self.running[tj.id] = j
            r = j.priority.rank
            self.running_by_rank[r] = self.running_by_rank.get(r, 0) + 1
            self._rview(j, t)
            self._push(j.progress_start + (tj.duration_s - j.work_done), _FINISH, tj.id, j.attempt)
            if self.baseline:
                continue
            if pol.preemption and j.priority.rank < self.max_rank:
                self._push(t + pol.min_runtime_s + self.eps, _W_MINRT, tj.id, j.attempt)
            if pol.time_sharing and pol.preemption:
                self._push(t + max(pol.quantum_s, pol.min_runtime_s) + self.eps, _W_QUANTUM, tj.id, j.attempt)
            if j.priority == DEMOTED:
                self._push(t + pol.demote_after_s + self.eps, _W_DEMOTE, tj.id, j.attempt)
        # the per-cycle preemption cap was reached: the live loop runs again a second later
        if len({s.for_job_id for s in d.suspends}) >= pol.max_preemptions_per_cycle and self.queue:
            self._push(t + max(self.grid, 1.0), _W_CYCLE, 0, 0)
        if quota is not None and quota.violations():
            self.quota_violations += len(quota.violations())
        new_res = {jid: nodes for jid, nodes in d.reservations.items() if jid in self.queue}
        for jid in dict.fromkeys(list(old_res) + list(new_res)):
            if jid in self.queue and old_res.get(jid, ()) != new_res.get(jid, ()):
                self._qview(self.jobs[jid], new_res.get(jid, ()))
        self.reservations = new_res
        self.rules.reserved(new_res)
        if self.every_event:
            w = getattr(self.scheduler, "next_wakeup", None) if self.baseline else self._las_wakeup(t)
            if w is not None and w > t and (self._wake_at is None or w < self._wake_at or self._wake_at <= t):
                self._wake_at = w
                self._push(w, _W_CYCLE, 0, 0)

    def _queue_order_key(self, j: _Job, t: float) -> tuple:
        """A queued job's place in the order the hai policy walks the queue this cycle: level
        (high first), then its service class when least attained service is on, then first
        submission and id (``hai.domain.scheduler.core``)."""
        c = 0
        if self.policy.service_classes_gpu_s and not self.baseline:
            c = service_class(self.policy, j.attained, j.t.gpus, t - j.queued_since)
        return (-j.priority.rank, c, j.t.submit_s, j.t.id)

    def _min_leaves_ok(
        self, j: _Job, allocs, before: dict[int, tuple[str, ...]], after: dict[int, tuple[str, ...]], t: float
    ) -> bool:
        """Was this multi-node start on the fewest leaves possible given the idle nodes it could
        use at its turn in the cycle? An idle node reserved for another job of its priority or
        higher was not usable: if that owner comes before it in queue order, when the owner still
        holds the node after the cycle; if the owner comes after it, when the owner held the node
        before the cycle. Every other idle node counts."""
        blocked: dict[str, int] = {}
        rank = j.priority.rank
        me = self._queue_order_key(j, t)
        mine = {a.node for a in allocs}  # what it got was evidently usable to it
        for owner in dict.fromkeys(list(before) + list(after)):
            if owner == j.t.id:
                continue
            oj = self.jobs.get(owner)
            if oj is None or oj.priority.rank < rank:
                continue
            ahead = self._queue_order_key(oj, t) < me
            names = after.get(owner, ()) if ahead else before.get(owner, ())
            for name in names:
                if name in mine:
                    continue
                i = self.node_ix.get(name)
                if i is not None and len(self.free[i]) == self.nodes[i].gpus:
                    node = self.nodes[i]
                    key = node.zone + "\x00" + node.leaf
                    blocked[key] = blocked.get(key, 0) + 1
        best = None
        for zone, leaves in self.zone_leaf_idle.items():
            counts = [c - blocked.get(zone + "\x00" + leaf, 0) for leaf, c in leaves.items()]
            m = min_leaves(counts, j.t.nodes)
            if m is not None and (best is None or m < best):
                best = m
        used = len({(self.nodes[self.node_ix[a.node]].zone, self.nodes[self.node_ix[a.node]].leaf) for a in allocs})
        return best is not None and used <= best

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> SimResult:
        heap = self.heap
        grid = self.grid
        while heap:
            first = heap[0][0]
            t = math.ceil(first / grid) * grid if grid > 0 else first
            t = max(t, first)  # float rounding of the grid point
            worth = False
            while heap and heap[0][0] <= t:
                at, kind, _seq, job_id, attempt = heapq.heappop(heap)
                self._advance(at)
                useful = self._handle(kind, job_id, attempt, at)
                if useful or (useful is False and (not self.skip_idle_cycles or self.every_event)):
                    worth = True
            self._advance(t)
            if worth and self.queue:
                self.cycles += 1
                snap = self._snapshot(t)
                if self.kept is not None:
                    d = hai_schedule(snap, self.policy, t, kept=self.kept)
                else:
                    d = self.scheduler(snap, self.policy, t)
                self._apply(d, t)
        return SimResult(self._metrics(), cycles=self.cycles)

    def _las_wakeup(self, t: float) -> float | None:
        """(Least attained service) the next time a running job crosses a service-class
        threshold or ends its minimum runtime, while jobs wait; None: none."""
        if not self.queue:
            return None
        th = self.policy.service_classes_gpu_s
        mr = self.policy.min_runtime_s
        qf = self.policy.service_quantum_factor
        pwf = self.policy.service_protect_wait_factor
        nth = len(th)
        best = None
        for j in self.running.values():
            if j.state != _RUNNING:
                continue
            g = j.t.gpus
            start = j.attempt_start
            a = j.attained + (t - start) * g
            k = bisect_right(th, a)  # the first threshold above its attained service
            if k < nth:
                w = t + (th[k] - a) / g
                if best is None or w < best:
                    best = w
            w = start + (max(mr, qf * j.attained / max(1, g)) if qf else mr)
            if w > t and (best is None or w < best):
                best = w
            if pwf and (t - j.t.submit_s) * g >= (1.0 + pwf) * a:
                # kept for having waited: until it has run enough to be within the factor again
                w = ((1.0 + pwf) * (start - j.attained / g) - j.t.submit_s) / pwf
                if w > t and (best is None or w < best):
                    best = w
        return best + self.eps if best is not None else None

    def attained_gpu_s(self, job_id: int, t: float) -> float:
        """A job's attained service at t: GPU-seconds it has held over all its attempts."""
        j = self.jobs[job_id]
        if j.state == _RUNNING:
            return j.attained + max(0.0, t - j.attempt_start) * j.t.gpus
        return j.attained

    def job_results(self) -> dict[int, dict]:
        """Per job: submit, first start, end (None if it never ran/ended), queued time, suspensions."""
        return {
            jid: {
                "submit_s": j.t.submit_s,
                "first_start_s": j.first_start,
                "end_s": j.end,
                "queued_s": j.queued_total,
                "suspensions": j.suspensions,
                "rejected": j.state == _REJECTED,
            }
            for jid, j in self.jobs.items()
        }

    def _metrics(self) -> dict:
        done = [j for j in self.jobs.values() if j.state == _DONE]
        jct = sorted(j.end - j.t.submit_s for j in done)  # type: ignore[operator]
        accepted = [j for j in self.jobs.values() if j.state != _REJECTED]
        queue_by_p: dict[str, list[float]] = {}
        for j in done:
            queue_by_p.setdefault(j.t.priority.value, []).append(j.queued_total)
        first = min((j.t.submit_s for j in self.jobs.values()), default=0.0)
        last = max((j.end for j in done), default=first)  # type: ignore[type-var]
        makespan = max(0.0, last - first)
        capacity = self.total_gpus * makespan
        useful = sum(j.t.duration_s * j.t.gpus for j in done)

        def pct(p: float) -> float:
            if not jct:
                return 0.0
            k = min(len(jct) - 1, max(0, math.ceil(p * len(jct)) - 1))
            return jct[k]

        return {
            "policy": self.policy_name,
            "jobs": len(self.jobs),
            "completed": len(done),
            "rejected": self.rejected,
            "unfinished": len(accepted) - len(done),
            "avg_jct_s": round(statistics.fmean(jct), 1) if jct else 0.0,
            "p50_jct_s": round(pct(0.50), 1),
            "p99_jct_s": round(pct(0.99), 1),
            "avg_queue_s": round(statistics.fmean(j.queued_total for j in done), 1) if done else 0.0,
            "avg_queue_s_by_priority": {
                p.value: round(statistics.fmean(queue_by_p[p.value]), 1) for p in Priority if p.value in queue_by_p
            },
            "gpu_utilization": round(self.busy_gpu_s / capacity, 4) if capacity else 0.0,
            "useful_gpu_utilization": round(useful / capacity, 4) if capacity else 0.0,
            "makespan_s": round(makespan, 1),
            "preemptions": self.preemptions,
            "lost_gpu_s": round(self.lost_gpu_s, 1),
            "allocated_gpu_s": round(self.busy_gpu_s, 1),
            "overhead_gpu_s": round(self.overhead_gpu_s, 1),
            "multi_node_jobs": len(self.multi_node_jobs),
            "multi_node_starts": self.multi_node_starts,
            "min_leaves_ratio": round(self.min_leaf_ok / self.multi_node_starts, 4) if self.multi_node_starts else 1.0,
            "cross_zone_jobs": len(self.cross_zone_jobs),
            "double_allocations": self.double_allocations,
            "quota_violations": self.quota_violations,
            "invalid_decisions": self.invalid_decisions,
            "cycles": self.cycles,
        }
