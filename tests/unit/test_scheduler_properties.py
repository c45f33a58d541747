"""Property tests over random clusters, running jobs and queues (hypothesis).

Invariants of every cycle: no GPU given twice, no zone spanned, unschedulable and reserved
nodes respected, quotas hold, victims are legal, every queued job is started or explained, the
snapshot is unchanged and the result deterministic. And: a higher-priority job never waits
while preemptible lower-priority jobs hold what it needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import copy
import random

from hai.domain.jobs import JobState, Priority
from hai.domain.scheduler import (
    Allocation,
    NodeView,
    Policy,
    QueuedJob,
    Quota,
    RunningJob,
    Snapshot,
    schedule,
)
from hai.domain.scheduler.model import FIFO_LEVELS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NOW = 1_000_000.0
HOUR = 3600.0
PRIOS = list(Priority)
USERS = ["ann", "bob", "cat", "dan"]
GROUPS = ["g1", "g2"]
SHAPES = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8), (2, 4)]


def _build(rng: random.Random, *, n_queued: int, allow_reservations: bool, allow_quotas: bool, suspending: bool):
    zones = rng.randint(1, 3)
    nodes: list[dict] = []
    for z in range(zones):
        for leaf in range(rng.randint(1, 3)):
            for k in range(rng.randint(1, 4)):
                gpus = 8 if rng.random() < 0.85 else 4
                nodes.append(
                    dict(
                        name=f"{'ABC'[z]}-l{leaf}-n{k}",
                        zone="ABC"[z],
                        leaf=f"{'ABC'[z]}-l{leaf}",
                        gpus=gpus,
                        free=list(range(gpus)),
                        schedulable=rng.random() < 0.9,
                    )
                )
    running: list[RunningJob] = []
    next_id = 1
    for _ in range(rng.randint(0, 2 * len(nodes))):
        n_nodes, per = rng.choice(SHAPES)
        if n_nodes == 1:
            cands = [n for n in nodes if len(n["free"]) >= per]
        else:
            cands = [n for n in nodes if len(n["free"]) == n["gpus"] and n["gpus"] >= per]
            zone = rng.choice(sorted({n["zone"] for n in cands})) if cands else None
            cands = [n for n in cands if n["zone"] == zone]
        if len(cands) < n_nodes:
            continue
        chosen = rng.sample(cands, n_nodes)
        allocs = []
        for n in chosen:
            take = sorted(rng.sample(n["free"], per))
            n["free"] = [g for g in n["free"] if g not in take]
            allocs.append(Allocation(n["name"], tuple(take)))
        started = NOW - rng.choice([60, 10 * 60, 20 * 60, 2 * HOUR, 5 * HOUR])
        prio = rng.choice(PRIOS)
        state = JobState.SUSPENDING if suspending and rng.random() < 0.1 else rng.choice([JobState.RUNNING, JobState.STARTING])
        running.append(
            RunningJob(
                id=next_id,
                user=rng.choice(USERS),
                group=rng.choice(GROUPS),
                priority=prio,
                nodes=n_nodes,
                gpus_per_node=per,
                allocations=tuple(allocs),
                state=state,
                started_at=started,
                first_submitted_at=started - 100,
                submitted_priority=prio,
                last_checkpoint_at=started + rng.random() * (NOW - started) if rng.random() < 0.7 else None,
                min_runtime_s=rng.choice([None, None, None, 2 * HOUR]),
            )
        )
        next_id += 1
    queued: list[QueuedJob] = []
    reserved_taken: list[str] = []
    for _ in range(n_queued):
        n_nodes, per = rng.choice(SHAPES)
        reserved: tuple[str, ...] = ()
        if allow_reservations and rng.random() < 0.2:
            pool = [n["name"] for n in nodes if n["name"] not in reserved_taken]
            reserved = tuple(sorted(rng.sample(pool, min(len(pool), rng.randint(1, 2)))))
            reserved_taken.extend(reserved)
        sub = NOW - rng.choice([0, 60, 20 * 60, 3 * HOUR])
        queued.append(
            QueuedJob(
                id=next_id,
                user=rng.choice(USERS),
                group=rng.choice(GROUPS),
                priority=rng.choice(PRIOS),
                nodes=n_nodes,
                gpus_per_node=per,
                first_submitted_at=sub - rng.choice([0, 5 * HOUR]),
                queued_at=sub,
                allow_cross_zone=rng.random() < 0.1,
                reserved_nodes=reserved,
            )
        )
        next_id += 1
    if suspending and queued:
        # some suspending jobs are freeing GPUs for a queued job
        running = [
            dataclasses.replace(r, suspend_requested_for=rng.choice(queued).id)
            if r.state == JobState.SUSPENDING and rng.random() < 0.7
            else r
            for r in running
        ]
    quotas: list[Quota] = []
    if allow_quotas:
        for g in GROUPS:
            for p in PRIOS:
                if rng.random() < 0.3:
                    quotas.append(Quota(g, p, rng.choice([0, 4, 8, 16, 64])))
                if rng.random() < 0.1:
                    quotas.append(Quota(g, p, rng.choice([2, 8]), user=rng.choice(USERS)))
    snap = Snapshot(
        nodes=tuple(NodeView(n["name"], n["zone"], n["leaf"], n["gpus"], tuple(n["free"]), n["schedulable"]) for n in nodes),
        running=tuple(running),
        queued=tuple(queued),
        quotas=tuple(quotas),
        usage={u: rng.random() * 1e5 for u in USERS},
    )
    return snap


@st.composite
def snapshots(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    n_queued = draw(st.integers(0, 10))
    return _build(random.Random(seed), n_queued=n_queued, allow_reservations=True, allow_quotas=True, suspending=True)


policies = st.builds(
    Policy,
    min_runtime_s=st.sampled_from([0.0, 15 * 60.0, HOUR]),
    quantum_s=st.sampled_from([HOUR, 4 * HOUR]),
    wait_threshold_s=st.sampled_from([0.0, 15 * 60.0]),
    preemption=st.booleans(),
    time_sharing=st.booleans(),
    max_preemptions_per_cycle=st.sampled_from([1, 32]),
    **{k: st.just(v) for k, v in FIFO_LEVELS.items()},  # the FIFO levels: the rules checked below
)


def _effective_rank(snap: Snapshot, pol: Policy, d) -> dict[int, int]:
    demoted = {x.job_id for x in d.demotions}
    return {r.id: (Priority.NORMAL.rank if r.id in demoted else r.priority.rank) for r in snap.running}


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snap=snapshots(), pol=policies)
def test_cycle_invariants(snap: Snapshot, pol: Policy):
    _invariants(snap, pol)


@st.composite
def snapshots_with_service(draw):
    """As ``snapshots``, with attained service from earlier attempts (log-uniform up to 10^7
    GPU-s, or none) and checkpoints of various ages: every service class is reached."""
    snap = draw(snapshots())
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))

    def attained() -> float:
        return 0.0 if rng.random() < 0.3 else 10 ** rng.uniform(1, 7)

    running = tuple(replace(r, attained_gpu_s=attained(),
                            last_checkpoint_at=None if rng.random() < 0.3 else NOW - rng.uniform(0, 600))
                    for r in snap.running)
    queued = tuple(replace(q, attained_gpu_s=attained()) for q in snap.queued)
    return replace(snap, running=running, queued=queued)


las_policies = st.builds(
    Policy,  # the defaults since issue 16: eight service classes, checkpoint slack, wait factor
    min_runtime_s=st.sampled_from([0.0, 15 * 60.0]),
    preemption=st.booleans(),
    time_sharing=st.booleans(),
    max_preemptions_per_cycle=st.sampled_from([1, 32]),
    service_checkpoint_slack_s=st.sampled_from([0.0, 30.0]),
    service_protect_wait_factor=st.sampled_from([0.0, 0.5]),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snap=snapshots_with_service(), pol=las_policies)
def test_cycle_invariants_with_least_attained_service(snap: Snapshot, pol: Policy):
    """The same invariants under the default policy, where a job may also be suspended for one
    of its own priority with less attained service (only as the policy allows it)."""
    assert pol.service_classes_gpu_s  # the default has classes
    _invariants(snap, pol)


def _las_victim_ok(pol: Policy, v: RunningJob, w: QueuedJob) -> bool:
    """Whether least attained service may suspend ``v`` for ``w`` (same priority)."""
    from bisect import bisect_right
    th = pol.service_classes_gpu_s
    if not th or w.nodes != 1 or len(v.allocations) != 1:
        return False
    g = len(v.allocations[0].gpus)
    ran = NOW - v.started_at
    attained = v.attained_gpu_s + ran * g
    if bisect_right(th, attained) <= bisect_right(th, w.attained_gpu_s):
        return False  # only jobs of a higher service class than the waiting job's
    if pol.service_protect_wait_factor and (NOW - v.first_submitted_at) * g >= (1 + pol.service_protect_wait_factor) * attained:
        return False  # kept: it waited long enough
    since = v.last_checkpoint_at if v.last_checkpoint_at is not None else v.started_at
    return not (pol.service_checkpoint_slack_s and NOW - since > pol.service_checkpoint_slack_s)


def _invariants(snap: Snapshot, pol: Policy) -> None:
    before = copy.deepcopy(snap)
    d = schedule(snap, pol, NOW)
    assert snap == before, "planning must not mutate the snapshot"
    assert schedule(snap, pol, NOW) == d, "same snapshot, same decisions"

    nodes = {n.name: n for n in snap.nodes}
    queued = {q.id: q for q in snap.queued}
    running = {r.id: r for r in snap.running}
    started = [s.job_id for s in d.starts]

    # every queued job is started or explained, never both
    assert len(started) == len(set(started))
    assert set(started) <= set(queued)
    assert set(started).isdisjoint(d.pending_reasons)
    assert set(started) | set(d.pending_reasons) == set(queued)
    assert all(isinstance(r, str) and r for r in d.pending_reasons.values())

    # no GPU given twice; only free GPUs of schedulable nodes; gang shape respected
    given_out: set[tuple[str, int]] = set()
    cross = 0
    owner_of = {}
    for q in snap.queued:  # first owner in queue order wins a node (none overlap here)
        for name in q.reserved_nodes:
            owner_of.setdefault(name, q)
    for s in d.starts:
        q = queued[s.job_id]
        assert len(s.allocations) == q.nodes
        assert len({a.node for a in s.allocations}) == q.nodes
        zones = {nodes[a.node].zone for a in s.allocations}
        for a in s.allocations:
            n = nodes[a.node]
            assert n.schedulable
            assert len(a.gpus) == q.gpus_per_node
            for g in a.gpus:
                assert g in n.free_gpus, f"GPU {g} of {n.name} is not free"
                assert (a.node, g) not in given_out, f"GPU {g} of {n.name} given twice"
                given_out.add((a.node, g))
            if q.nodes > 1:
                assert len(n.free_gpus) == n.gpus, "multi-node jobs take whole idle nodes"
            owner = owner_of.get(a.node)
            if owner is not None and owner.id != q.id and owner.priority.rank >= q.priority.rank:
                # only after its owner gave the reservation up (started elsewhere, quota-blocked,
                # or nothing left to wait for), never while the owner keeps it
                assert a.node not in d.reservations.get(owner.id, ()), "a reserved node went to another job"
                assert owner.id in started or owner.id in d.pending_reasons
        if len(zones) > 1:
            assert q.allow_cross_zone, "a job spanned zones"
            cross += 1
        assert s.reason
    running_cross = any(len({nodes[a.node].zone for a in r.allocations if a.node in nodes}) > 1 for r in snap.running)
    assert cross <= (0 if running_cross else 1)

    # quotas hold after the starts (for buckets that were within their cap before)
    eff = _effective_rank(snap, pol, d)
    group_use: dict[tuple[str, int], int] = {}
    user_use: dict[tuple[str, int, str], int] = {}
    for r in snap.running:
        k = (r.group, eff[r.id])
        group_use[k] = group_use.get(k, 0) + r.gpu_count
        uk = (r.group, eff[r.id], r.user)
        user_use[uk] = user_use.get(uk, 0) + r.gpu_count
    before_group = dict(group_use)
    before_user = dict(user_use)
    for s in d.starts:
        q = queued[s.job_id]
        k = (q.group, q.priority.rank)
        group_use[k] = group_use.get(k, 0) + q.gpu_count
        uk = (q.group, q.priority.rank, q.user)
        user_use[uk] = user_use.get(uk, 0) + q.gpu_count
    for qt in snap.quotas:
        if qt.user is None:
            k = (qt.group, qt.priority.rank)
            if group_use.get(k, 0) != before_group.get(k, 0):
                assert group_use[k] <= qt.gpus, f"group quota exceeded: {qt}"
        else:
            uk = (qt.group, qt.priority.rank, qt.user)
            if user_use.get(uk, 0) != before_user.get(uk, 0):
                assert user_use[uk] <= qt.gpus, f"user quota exceeded: {qt}"

    # victims are legal
    victims = [s.job_id for s in d.suspends]
    assert len(victims) == len(set(victims))
    if not pol.preemption:
        assert all(running[v].suspend_requested_for is not None for v in victims) and not victims
    for s in d.suspends:
        v = running[s.job_id]
        assert v.state != JobState.SUSPENDING and v.suspend_requested_for is None
        w = queued[s.for_job_id]
        assert s.for_job_id not in started
        ran = NOW - v.started_at
        min_rt = v.min_runtime_s if v.min_runtime_s is not None else pol.min_runtime_s
        assert ran >= min_rt, "suspended before its minimum runtime"
        if eff[v.id] < w.priority.rank:
            continue
        if eff[v.id] == w.priority.rank and _las_victim_ok(pol, v, w):
            continue  # least attained service (issue 16)
        assert pol.time_sharing, "same-priority victim without time-sharing or least attained service"
        assert eff[v.id] == w.priority.rank and v.user != w.user, "never the same user at the same priority"
        assert ran >= pol.quantum_s and NOW - w.queued_at >= pol.wait_threshold_s
    for jid, names in d.reservations.items():
        assert jid in queued and jid not in started
        assert all(n in nodes for n in names)
    reserved_now = [n for names in d.reservations.values() for n in names]
    assert len(reserved_now) == len(set(reserved_now)), "a node reserved for two jobs"


def _preemptible(r: RunningJob, rank: int, pol: Policy) -> bool:
    min_rt = r.min_runtime_s if r.min_runtime_s is not None else pol.min_runtime_s
    eff = r.priority.rank
    if r.priority == Priority.ABOVE_NORMAL and NOW - r.started_at >= pol.demote_after_s:
        eff = Priority.NORMAL.rank  # demoted in this very cycle
    return (
        r.state != JobState.SUSPENDING
        and r.suspend_requested_for is None
        and eff < rank
        and NOW - r.started_at >= min_rt
    )


def _could_fit_after_preemption(snap: Snapshot, job: QueuedJob, pol: Policy) -> bool:
    """Brute force: suspend every preemptible lower-priority job; is there a valid placement?"""
    holders: dict[str, list[tuple[RunningJob, int]]] = {}
    for r in snap.running:
        for a in r.allocations:
            holders.setdefault(a.node, []).append((r, len(a.gpus)))
    rank = job.priority.rank
    freeable: dict[str, int] = {}
    whole: dict[str, bool] = {}
    for n in snap.nodes:
        if not n.schedulable:
            continue
        hs = holders.get(n.name, [])
        extra = sum(g for r, g in hs if _preemptible(r, rank, pol))
        freeable[n.name] = len(n.free_gpus) + extra
        whole[n.name] = all(_preemptible(r, rank, pol) for r, _ in hs) and len(n.free_gpus) + sum(
            g for _, g in hs
        ) == n.gpus
    if job.nodes == 1:
        return any(freeable[n.name] >= job.gpus_per_node for n in snap.nodes if n.schedulable and n.gpus >= job.gpus_per_node)
    per_zone: dict[str, int] = {}
    for n in snap.nodes:
        if n.schedulable and n.gpus >= job.gpus_per_node and whole[n.name]:
            per_zone[n.zone] = per_zone.get(n.zone, 0) + 1
    return max(per_zone.values(), default=0) >= job.nodes


@st.composite
def contended(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    snap = _build(rng, n_queued=draw(st.integers(0, 4)), allow_reservations=False, allow_quotas=False, suspending=False)
    nodes, per = rng.choice(SHAPES)
    top = QueuedJob(
        id=10_000,
        user="zed",
        group="g1",
        priority=draw(st.sampled_from(PRIOS[1:])),
        nodes=nodes,
        gpus_per_node=per,
        first_submitted_at=0.0,
        queued_at=NOW,
    )
    # the other queued jobs rank below it, so it is the first the cycle considers
    others = tuple(q for q in snap.queued if q.priority.rank < top.priority.rank)
    return Snapshot(snap.nodes, snap.running, (top,) + others, (), snap.usage)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snap=contended(), min_rt=st.sampled_from([0.0, 15 * 60.0]))
def test_a_higher_priority_job_never_waits_while_preemptible_lower_priority_jobs_hold_what_it_needs(snap, min_rt):
    pol = replace(Policy(**FIFO_LEVELS), min_runtime_s=min_rt, time_sharing=False)
    top = snap.queued[0]
    d = schedule(snap, pol, NOW)
    if any(s.job_id == top.id for s in d.starts):
        return
    fits = _could_fit_after_preemption(snap, top, pol)
    mine = [s for s in d.suspends if s.for_job_id == top.id]
    if fits:
        assert mine, f"job waits although lower-priority jobs could make room: {d.pending_reasons[top.id]}"
        assert top.id in d.reservations
        freed = {a.node for s in mine for a in next(r for r in snap.running if r.id == s.job_id).allocations}
        assert set(d.reservations[top.id]) & freed, "the reservation holds the nodes its victims free"
    else:
        assert not mine
