"""Idle-cycle skipping: which simulator events can make a cycle decide something new.

The simulator runs a cycle on the grid whenever something happened; a cycle after an event that
provably cannot change any decision would decide exactly what the last one did, so it is
skipped (``tests/unit/test_sim.py::test_skipping_idle_cycles_changes_no_decision`` replays
traces both ways and requires identical results). The verdicts come from:

* what the scheduler declares about itself: ``starts_every_fit`` (the hai policy starts every
  queued job that fits, in the same cycle: after a cycle nothing that fits is left waiting, so a
  later change matters only through the nodes it touched) and ``strict_order`` (the fifo
  baseline starts jobs strictly in queue order: a newcomer matters only as the new head);
* the scheduler's own victim rules (``domain.scheduler.victims``: ``outranks`` for priority
  preemption, ``may_take_turn`` for time-sharing; ``DEMOTED`` is the priority the demotion
  rule applies to), asked over counters of who could be a victim or a time-sharing waiter now.

``IdleCycleRules`` owns the counters that only the verdicts read (waiters past the wait
threshold and jobs past the quantum by rank and user, their GPUs per node, reserved nodes);
the simulator tells it what happened (``past_threshold``, ``past_quantum``, ``left_queue``,
``unexpire``, ``reserved``) and asks it after each event (``after_*``: True when a cycle may
decide something new).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hai.domain.scheduler.victims import DEMOTED, may_take_turn, outranks

if TYPE_CHECKING:
    from hai.sim.engine import Simulation, _Job

_TOTAL = "\x00total"  # the per-rank total among the user counts


def _count(table: dict[int, dict[str, int]], rank: int, user: str, delta: int) -> None:
    users = table.setdefault(rank, {})
    users[user] = users.get(user, 0) + delta
    users[_TOTAL] = users.get(_TOTAL, 0) + delta


def _others(table: dict[int, dict[str, int]], rank: int, user: str) -> int:
    """Entries of ``table`` at ``rank`` of users other than ``user``."""
    users = table.get(rank)
    if not users:
        return 0
    return users.get(_TOTAL, 0) - users.get(user, 0)


class IdleCycleRules:
    def __init__(self, sim: Simulation):
        self.sim = sim
        self.policy = sim.policy
        # who could time-share right now: queued jobs past the wait threshold and running jobs
        # past the quantum, by (rank, user)
        self.ready: dict[int, dict[str, int]] = {}
        self.expired: dict[int, dict[str, int]] = {}
        # GPUs of jobs past the quantum on each node by (rank, user); one-node waiters past the
        # threshold by (rank, user, GPUs); multi-node ones by (rank, user, nodes, GPUs)
        self.exp_on_node: list[dict[tuple[int, str], int]] = [{} for _ in sim.nodes]
        self.ready_shapes: dict[tuple[int, str, int], int] = {}
        self.ready_multi_shapes: dict[tuple[int, str, int, int], int] = {}
        self.zone_nodes: dict[str, list[int]] = {}
        for i, node in enumerate(sim.nodes):
            self.zone_nodes.setdefault(node.zone, []).append(i)
        self.reserved_by: dict[int, int] = {}  # node index -> job it is reserved for
        self.starts_every_fit = bool(getattr(sim.scheduler, "starts_every_fit", False))
        self.strict_order = bool(getattr(sim.scheduler, "strict_order", False))
        # node-level time-sharing rules: one priority in the trace (with several, a waiter may
        # combine lower-priority and same-priority victims; then the coarser rule applies)
        self.node_rules = self.starts_every_fit and sim.max_rank == sim.min_rank

    # -- what happened -------------------------------------------------------------------------
    def past_threshold(self, j: _Job) -> None:
        j.ready_rank = j.priority.rank
        _count(self.ready, j.ready_rank, j.t.user, 1)
        self._ready_shape(j, 1)

    def left_queue(self, j: _Job) -> None:
        if j.ready_rank is not None:
            _count(self.ready, j.ready_rank, j.t.user, -1)
            self._ready_shape(j, -1)
            j.ready_rank = None

    def past_quantum(self, j: _Job) -> list[int]:
        """Counts the job as past the quantum; returns the node indices it holds."""
        sim = self.sim
        j.expired_rank = j.priority.rank
        _count(self.expired, j.expired_rank, j.t.user, 1)
        mine = []
        key = (j.expired_rank, j.t.user)
        for a in j.allocs:
            i = sim.node_ix[a.node]
            self.exp_on_node[i][key] = self.exp_on_node[i].get(key, 0) + len(a.gpus)
            mine.append(i)
        return mine

    def unexpire(self, j: _Job) -> None:
        """The job stops being a time-sharing victim (it ends or is suspended)."""
        if j.expired_rank is not None:
            _count(self.expired, j.expired_rank, j.t.user, -1)
            key = (j.expired_rank, j.t.user)
            for a in j.allocs:
                on = self.exp_on_node[self.sim.node_ix[a.node]]
                on[key] -= len(a.gpus)
                if on[key] <= 0:
                    del on[key]
            j.expired_rank = None

    def reserved(self, reservations: dict[int, tuple[str, ...]]) -> None:
        node_ix = self.sim.node_ix
        self.reserved_by = {node_ix[n]: jid for jid, names in reservations.items() for n in names if n in node_ix}

    def _ready_shape(self, j: _Job, delta: int) -> None:
        if j.t.nodes > 1:
            key = (j.ready_rank, j.t.user, j.t.nodes, j.t.gpus_per_node)
            self.ready_multi_shapes[key] = self.ready_multi_shapes.get(key, 0) + delta
        else:
            key = (j.ready_rank, j.t.user, j.t.gpus_per_node)
            self.ready_shapes[key] = self.ready_shapes.get(key, 0) + delta

    # -- verdicts: may a cycle now decide something new? ---------------------------------------
    def after_arrival(self, j: _Job) -> bool:
        """Arrivals free nothing: only if the newcomer could start on free GPUs or preempt; if
        neither holds (the common case on a full cluster), its decisions would equal the last
        cycle's."""
        sim, pol = self.sim, self.policy
        rank = j.priority.rank
        if (
            self.strict_order
            and not sim.quotas
            and (
                sim.queued_by_rank.get(rank, 0) > 1
                or any(n > 0 and outranks(r, rank) for r, n in sim.queued_by_rank.items())
            )
        ):
            return False  # not the new head: the queue's order is unchanged
        if pol.preemption:
            if any(n > 0 and outranks(rank, r) for r, n in sim.running_by_rank.items()):
                return True
            if pol.time_sharing and pol.wait_threshold_s <= 0:
                return True
        t = j.t
        if t.nodes == 1:
            g = t.gpus_per_node
            return any(len(f) >= g for f in sim.free)
        return any(sum(leaves.values()) >= t.nodes for leaves in sim.zone_leaf_idle.values())

    def after_finish(self, freed: list[int]) -> bool:
        """Freed GPUs matter if a queued job fits them, or if they complete a preemption plan."""
        if not self.starts_every_fit:
            return self._some_queued_job_fits() or self._preemption_possible()
        if not self.node_rules:
            return self._fits_on(freed) or self._preemption_possible()
        return self._fits_on(freed) or self._ts_possible_on(freed)

    def after_threshold(self, j: _Job) -> bool:
        """A job waited past the threshold: may it take a turn now?"""
        self.past_threshold(j)
        if not self.node_rules:
            return _others(self.expired, j.ready_rank, j.t.user) > 0
        if j.t.nodes > 1:
            return self._ts_multi_fits(j.ready_rank, j.t.user, j.t.nodes, j.t.gpus_per_node, list(self.zone_nodes))
        return self._ts_fits(j.ready_rank, j.t.user, j.t.gpus_per_node, range(len(self.sim.nodes)))

    def after_quantum(self, j: _Job) -> bool:
        """A job ran past the quantum: may a waiter take its turn now?"""
        mine = self.past_quantum(j)
        if not self.node_rules:
            return _others(self.ready, j.expired_rank, j.t.user) > 0
        return self._ts_possible_on(mine)

    def after_min_runtime(self, j: _Job) -> bool:
        """A job ran its minimum runtime: it may be a victim of a queued job it is outranked by."""
        rank = j.priority.rank
        return any(n > 0 and outranks(r, rank) for r, n in self.sim.queued_by_rank.items())

    def after_demotion_age(self, j: _Job) -> bool:
        return j.priority == DEMOTED

    # -- the rules' parts ----------------------------------------------------------------------
    def _fits_on(self, idxs: list[int]) -> bool:
        """Could a queued job start now thanks to GPUs freed on these nodes?"""
        sim = self.sim
        if not sim.queue:
            return False
        if sim.quotas:
            return True  # freed quota may let a job start anywhere
        min_g = min_k = None
        for (nodes, g), n in sim.queued_shapes.items():
            if n > 0:
                if nodes == 1:
                    min_g = g if min_g is None or g < min_g else min_g
                elif min_k is None or nodes < min_k:
                    min_k = nodes
        zones = []
        for i in idxs:
            free = len(sim.free[i])
            owner = self.reserved_by.get(i)
            if owner is not None:
                oj = sim.jobs[owner]
                if oj.t.nodes > 1 or free >= oj.t.gpus_per_node or sim.max_rank != sim.min_rank:
                    return True
                continue
            if min_g is not None and free >= min_g:
                return True
            node = sim.nodes[i]
            if node.zone not in zones:
                zones.append(node.zone)
        if min_k is not None:
            for z in zones:
                if sum(sim.zone_leaf_idle[z].values()) >= min_k:
                    return True
        return False

    def _ts_fits(self, rank: int, user: str, g: int, idxs) -> bool:
        """Could a one-node waiter (rank, user, g GPUs) take one of these nodes by suspending
        jobs that ran past the quantum and whose turn it may take?"""
        sim = self.sim
        for i in idxs:
            exp = self.exp_on_node[i]
            if not exp or sim.nodes[i].gpus < g:
                continue
            have = len(sim.free[i])
            for (r, u), n in exp.items():
                if may_take_turn(rank, user, r, u):
                    have += n
            if have >= g:
                return True
        return False

    def _ts_possible_on(self, idxs: list[int]) -> bool:
        """Could time-sharing now make a plan that involves these nodes?"""
        if not (self.policy.preemption and self.policy.time_sharing) or not self.sim.queue:
            return False
        for (rank, user, g), n in self.ready_shapes.items():
            if n > 0 and self._ts_fits(rank, user, g, idxs):
                return True
        zones = list(dict.fromkeys(self.sim.nodes[i].zone for i in idxs))
        for (rank, user, k, g), n in self.ready_multi_shapes.items():
            if n > 0 and self._ts_multi_fits(rank, user, k, g, zones):
                return True
        return False

    def _ts_multi_fits(self, rank: int, user: str, k: int, g: int, zones) -> bool:
        """Could a multi-node waiter find k whole nodes in one of these zones, each idle or held
        only by jobs that ran past the quantum and whose turn it may take?"""
        sim = self.sim
        for z in zones:
            count = 0
            for i in self.zone_nodes[z]:
                node = sim.nodes[i]
                if node.gpus < g:
                    continue
                have = len(sim.free[i])
                if have < node.gpus:
                    for (r, u), n in self.exp_on_node[i].items():
                        if may_take_turn(rank, user, r, u):
                            have += n
                if have >= node.gpus:
                    count += 1
                    if count >= k:
                        return True
        return False

    def _some_queued_job_fits(self) -> bool:
        """Could any queued job start on the free GPUs (reserved ones included)? A necessary
        condition for a cycle after an end to start anything: ends free GPUs, they add no
        victims, so when no queued shape fits, that cycle's decisions would be the last one's."""
        sim = self.sim
        if not sim.queue:
            return False
        min_g = min_k = None
        for (nodes, g), n in sim.queued_shapes.items():
            if n <= 0:
                continue
            if nodes == 1:
                if min_g is None or g < min_g:
                    min_g = g
            elif min_k is None or nodes < min_k:
                min_k = nodes
        if min_g is not None and any(len(f) >= min_g for f in sim.free):
            return True
        return min_k is not None and any(sum(leaves.values()) >= min_k for leaves in sim.zone_leaf_idle.values())

    def _preemption_possible(self) -> bool:
        """Could some queued job preempt now (time-sharing pairs: a waiter past the threshold and
        another user's job past the quantum at its priority; or any outranked job running)?"""
        sim = self.sim
        if not self.policy.preemption:
            return False
        for rank, ready in self.ready.items():
            exp = self.expired.get(rank)
            if not exp or exp.get(_TOTAL, 0) <= 0:
                continue
            for user, n in ready.items():
                if n > 0 and user != _TOTAL and _others(self.expired, rank, user) > 0:
                    return True
        if sim.max_rank != sim.min_rank:
            low = min((r for r, n in sim.running_by_rank.items() if n > 0), default=None)
            if low is not None and any(n > 0 and outranks(r, low) for r, n in sim.queued_by_rank.items()):
                return True
        return False
