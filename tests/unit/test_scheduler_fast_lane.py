"""The cycle's fast lane (``_Cycle._nominate_level``): a plain job whose rungs the memos answer
leaves its outcome under its lane key, and later jobs of that key reuse it while nothing the
rungs read has changed. It must never change a decision: the same cycles with the lane off
(every job walks the ladder) decide exactly the same, and an outcome whose facts changed in
between (a quota bucket filled by a start) is recomputed, not reused."""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hai.domain.scheduler import Policy, schedule
from hai.domain.scheduler.model import FIFO_LEVELS
from hai.domain.scheduler.core import _Cycle

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import decision_hash  # noqa: E402
from scheduler_builders import cluster, job, policy  # noqa: E402

NOW = 100_000.0


@pytest.fixture(autouse=True)
def _lane_on_every_level(monkeypatch):
    # the lane serves long levels only; here it serves every level, small ones too
    monkeypatch.setattr(_Cycle, "fast_lane_min_jobs", 0)


def _decide_without_lane(snap, pol, now, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(_Cycle, "fast_lane", False)
        return schedule(snap, pol, now)


def _bucket_of_nine():
    """Group g may hold 9 GPUs at NORMAL and holds 8 (one running job)."""
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("r").group("g").user("x").started(NOW - 3600))
    c.quota("g", "NORMAL", 9)
    return c


def _queue_a_b_a_a(c, t: float) -> None:
    """"a1" (2 GPUs) then "b" (1 GPU) then "a2", "a3" (a1's user and shape), from time ``t``."""
    c.queue(
        job("a1").group("g").user("u").gpus(2).submitted(t),
        job("b").group("g").user("v").gpus(1).submitted(t + 1),
        job("a2").group("g").user("u").gpus(2).submitted(t + 2),
        job("a3").group("g").user("u").gpus(2).submitted(t + 3),
    )


def _assert_b_filled_the_bucket(c, d) -> None:
    assert [s.job_id for s in d.starts] == [c.id_of("b")]
    assert d.pending_reasons[c.id_of("a1")] == "group g at NORMAL uses 8 of 9 GPUs; this job needs 2"
    assert d.pending_reasons[c.id_of("a2")] == "group g at NORMAL uses 9 of 9 GPUs; this job needs 2"
    assert d.pending_reasons[c.id_of("a3")] == "group g at NORMAL uses 9 of 9 GPUs; this job needs 2"


def test_a_lane_reason_is_recomputed_after_a_start_fills_the_quota_bucket(monkeypatch):
    # "a1" is blocked by the bucket, "b" starts and fills it, "a2" must see the bucket as it is now
    c = _bucket_of_nine()
    _queue_a_b_a_a(c, 0)
    snap = c.snapshot()
    d = schedule(snap, policy(), NOW)
    _assert_b_filled_the_bucket(c, d)
    assert d == _decide_without_lane(snap, policy(), NOW, monkeypatch)


def test_a_kept_level_decides_afresh_after_the_lane_is_emptied_in_a_later_block(monkeypatch):
    # The same quota bucket as above, on the kept queue (``_lane_misses``), its level in two
    # blocks: "a0" leaves the 8-of-9 reason in the lane at the end of the first block, so the
    # second block starts with that key held; "b" starts there and the lane is emptied. "a2"
    # and "a3" must be decided against the bucket as it is then (9 of 9), not from the lane's
    # entries as they were read before "b" (the runs reuse the lookups made when their misses
    # were predicted).
    from hai.domain.scheduler import KeptQueue
    from hai.domain.scheduler.kept import _SPLIT

    c = _bucket_of_nine()
    # the first block: jobs of two whole nodes, which the busy node never leaves (the first
    # one's placement failure is a new memo: the lane is emptied), then "a0"
    c.queue(*(job(f"f{i}").group("h").user("w").nodes(2).submitted(i) for i in range(_SPLIT // 2 - 1)))
    c.queue(job("a0").group("g").user("u").gpus(2).submitted(4000))
    _queue_a_b_a_a(c, 5000)
    snap = c.snapshot()
    kept = KeptQueue()
    d = schedule(snap, policy(), NOW, kept=kept)
    (level,) = kept.sync(snap, policy())
    assert len(level.blocks) == 2
    assert [j.id for j in level.blocks[1].jobs[:4]] == [c.id_of(n) for n in ("a1", "b", "a2", "a3")]
    assert d.pending_reasons[c.id_of("a0")] == "group g at NORMAL uses 8 of 9 GPUs; this job needs 2"
    _assert_b_filled_the_bucket(c, d)
    without = _decide_without_lane(snap, policy(), NOW, monkeypatch)
    assert decision_hash.canonical(d) == decision_hash.canonical(without)
    assert list(d.pending_reasons.items()) == list(without.pending_reasons.items())


@pytest.mark.parametrize("case", list(decision_hash.cases()), ids=lambda c: c[0])
def test_the_lane_decides_as_the_full_ladder_does(case, monkeypatch):
    _name, snap, pol, now = case
    with_lane = schedule(snap, pol, now)
    without = _decide_without_lane(snap, pol, now, monkeypatch)
    assert decision_hash.canonical(with_lane) == decision_hash.canonical(without)
    # the order in which the reasons were recorded too (the service writes them in that order)
    assert list(with_lane.pending_reasons.items()) == list(without.pending_reasons.items())


def _two_users_past_the_threshold():
    """A full cluster of LOW jobs of other users that ran past the quantum; 40 waiting jobs of
    two users and two shapes, all past the wait threshold (FIFO levels)."""
    c = cluster().zone("A", leaves=2, nodes_per_leaf=4)
    for i in range(8):
        c.run(job(f"r{i}").user(f"o{i}").started(NOW - 6 * 3600).checkpoint(NOW - 60))
    for i in range(40):
        c.queue(job(f"q{i}").user("ann" if i % 3 else "bob").gpus(8 if i % 2 else 4).submitted(i).queued_at(NOW - 7200 + i))
    return c.snapshot(), Policy(**FIFO_LEVELS)


def test_the_lane_groups_time_sharing_candidates_as_the_ladder_does(monkeypatch):
    # a full cluster of LOW jobs of other users that ran past the quantum; many waiting jobs of
    # two users and two shapes, all past the wait threshold: each (user, shape) group must hold
    # its jobs in FIFO order whichever way they were answered, so time-sharing picks the same
    snap, pol = _two_users_past_the_threshold()
    d = schedule(snap, pol, NOW)
    assert d.suspends  # time-sharing found victims for some of them
    assert d == _decide_without_lane(snap, pol, NOW, monkeypatch)


def _with_attained_service(snap, seed):
    """The case's queue with attained service from earlier attempts (60% none, the rest
    log-uniform up to 10^7 GPU-seconds), so it spreads over the service classes."""
    rng = random.Random(seed)
    got = [0.0 if rng.random() < 0.6 else 10 ** rng.uniform(2, 7) for _ in snap.queued]
    return replace(snap, queued=tuple(replace(q, attained_gpu_s=a) for q, a in zip(snap.queued, got)))


CLASSES = (1000.0, 3250.0, 10_000.0, 32_500.0, 100_000.0, 325_000.0, 1_000_000.0, 3_250_000.0)


@pytest.mark.parametrize(
    "knobs",
    [{"service_checkpoint_slack_s": 30.0}, {"starvation_factor": 2.0}, {"service_quantum_factor": 1.0}],
    ids=["slack", "starvation", "quantum"],
)
@pytest.mark.parametrize("case", list(decision_hash.cases())[::3], ids=lambda c: c[0])
def test_the_lane_decides_as_the_full_ladder_does_with_service_classes(case, knobs, monkeypatch):
    # with classes the lane key holds the job's class: the same decisions, in the same order
    _name, snap, pol, now = case
    snap = _with_attained_service(snap, 7)
    pol = replace(pol, service_classes_gpu_s=CLASSES, **knobs)
    with_lane = schedule(snap, pol, now)
    without = _decide_without_lane(snap, pol, now, monkeypatch)
    assert decision_hash.canonical(with_lane) == decision_hash.canonical(without)
    assert list(with_lane.pending_reasons.items()) == list(without.pending_reasons.items())


@pytest.fixture
def user_blind_lane(monkeypatch):
    """The lane keyed without the user on every level (the fine lane off), the keys counted."""
    from hai.domain.scheduler import core

    monkeypatch.setattr(_Cycle, "fast_lane_min_jobs", 10**9)
    monkeypatch.setattr(_Cycle, "coarse_lane_min_jobs", 0)
    made = []
    real = core._COARSE_KEY

    def counted(job):
        made.append(job.id)
        return real(job)

    monkeypatch.setattr(core, "_COARSE_KEY", counted)
    return made


@pytest.mark.parametrize("case", list(decision_hash.cases()), ids=lambda c: c[0])
def test_the_lane_without_the_user_decides_as_the_full_ladder_does(case, user_blind_lane, monkeypatch):
    # a level of many (user, shape) keys takes the lane keyed by shape and group alone: the
    # same decisions, the reasons recorded in the same order
    _name, snap, pol, now = case
    with_lane = schedule(snap, pol, now)
    assert user_blind_lane or not snap.queued
    without = _decide_without_lane(snap, pol, now, monkeypatch)
    assert decision_hash.canonical(with_lane) == decision_hash.canonical(without)
    assert list(with_lane.pending_reasons.items()) == list(without.pending_reasons.items())


def test_the_lane_without_the_user_leaves_time_sharing_groups_to_the_ladder(user_blind_lane, monkeypatch):
    # the jobs past the wait threshold join their own user's group: keyed without the user, a
    # second user's job must not join the first user's group
    snap, pol = _two_users_past_the_threshold()
    d = schedule(snap, pol, NOW)
    assert user_blind_lane and d.suspends
    assert d == _decide_without_lane(snap, pol, NOW, monkeypatch)


def test_the_lane_without_the_user_is_not_taken_when_a_quota_is_per_user(user_blind_lane, monkeypatch):
    # ann's quota in group g is full, bob's is not: jobs of one shape and group, told apart by
    # their user alone
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("r").group("g").user("ann").gpus(4).started(NOW - 3600))
    c.quota("g", "NORMAL", 4, user="ann")
    c.quota("g", "NORMAL", 8, user="bob")
    for i in range(6):
        c.queue(job(f"q{i}").group("g").user("ann" if i % 2 == 0 else "bob").gpus(4).submitted(i))
    snap = c.snapshot()
    d = schedule(snap, policy(), NOW)
    assert not user_blind_lane
    assert d.pending_reasons[c.id_of("q0")].startswith("user ann in group g at NORMAL uses 4 of 4 GPUs")
    assert [s.job_id for s in d.starts] == [c.id_of("q1"), c.id_of("q3")]
    assert d == _decide_without_lane(snap, policy(), NOW, monkeypatch)


def _decide_deferring_late(snap, pol, now, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(_Cycle, "defer_early", False)
        return schedule(snap, pol, now)


@pytest.fixture
def early_groups(monkeypatch):
    """The time-sharing groups whose reason the level wrote deferred already, per user (counted
    as ``_time_share`` receives them), and the users that also had special jobs."""
    seen: dict[str, list[bool]] = {}
    real = _Cycle._time_share

    def counted(self, waiters):
        for user, byshape in waiters.groups.items():
            seen.setdefault(user, []).extend(g[4] for g in byshape.values())
            if user in waiters.specials:
                seen.setdefault("<specials>", []).append(any(g[4] for g in byshape.values()))
        return real(self, waiters)

    monkeypatch.setattr(_Cycle, "_time_share", counted)
    return seen


@pytest.mark.parametrize("cap", [0, 2])
@pytest.mark.parametrize("case", list(decision_hash.cases())[::2], ids=lambda c: c[0])
def test_a_group_deferred_by_the_level_ends_with_the_reasons_time_sharing_gives(case, cap, early_groups, monkeypatch):
    # a group formed after the cycle's plans were spent has its jobs' deferred reason written
    # by the level: the same decisions and reasons, recorded in the same order, as writing the
    # level's reason and then time-sharing's
    _name, snap, pol, now = case
    pol = replace(pol, max_preemptions_per_cycle=cap)
    got = schedule(snap, pol, now)
    want = _decide_deferring_late(snap, pol, now, monkeypatch)
    assert decision_hash.canonical(got) == decision_hash.canonical(want)
    assert list(got.pending_reasons.items()) == list(want.pending_reasons.items())


def test_cases_with_groups_deferred_by_the_level_exist(early_groups, monkeypatch):
    # (the comparison above is not empty) with no plan allowed, some case's groups are
    # deferred by the level
    for _name, snap, pol, now in list(decision_hash.cases())[::2]:
        schedule(snap, replace(pol, max_preemptions_per_cycle=0), now)
    assert any(any(v) for u, v in early_groups.items() if u != "<specials>")


def test_groups_deferred_by_the_level_only_where_time_sharing_would_defer_them(early_groups, monkeypatch):
    # no plan allowed this cycle; every running job is ann's and ran past the quantum, so only
    # bob's jobs could take a turn from others': only bob's groups are deferred by the level.
    # Bob's first job of each shape walks the placement itself (time-shared on its own), so
    # time-sharing takes his groups in turn: it writes back the level's reason first, which his
    # jobs of 16 GPUs a node keep (no node could ever hold them: not deferred). Ann's jobs find
    # every shape failed already: her groups keep the level's reason, untouched.
    c = cluster().zone("A", leaves=2, nodes_per_leaf=4)
    for i in range(8):
        c.run(job(f"r{i}").user("ann").started(NOW - 6 * 3600).checkpoint(NOW - 60))
    shapes = (4, 8, 16)
    for i, g in enumerate(shapes):
        c.queue(job(f"b{i}").user("bob").gpus(g).submitted(i).queued_at(NOW - 7200 + i))
    for i in range(3, 30):
        c.queue(job(f"q{i}").user("ann" if i % 2 else "bob").gpus(shapes[i % 3]).submitted(i).queued_at(NOW - 7200 + i))
    snap = c.snapshot()
    pol = Policy(**FIFO_LEVELS, max_preemptions_per_cycle=0)
    got = schedule(snap, pol, NOW)
    assert all(early_groups["bob"]) and not any(early_groups["ann"]) and early_groups["<specials>"] == [True]
    want = _decide_deferring_late(snap, pol, NOW, monkeypatch)
    assert got == want
    assert list(got.pending_reasons.items()) == list(want.pending_reasons.items())
    bob16 = [got.pending_reasons[c.id_of(f"q{i}")] for i in range(3, 30) if i % 2 == 0 and shapes[i % 3] == 16]
    bob8 = [got.pending_reasons[c.id_of(f"q{i}")] for i in range(3, 30) if i % 2 == 0 and shapes[i % 3] == 8]
    assert bob16 and bob8 and set(bob16).isdisjoint(bob8)


def test_a_user_with_jobs_of_its_own_to_time_share_gets_back_the_levels_reason(early_groups, monkeypatch):
    # no plan allowed this cycle: ann's and bob's groups are deferred by the level; both also
    # have jobs time-shared on their own (the first job of each shape walks the placement
    # itself), so their groups are taken in turn by time-sharing, which first writes back the
    # reason the level would have written
    snap, pol = _two_users_past_the_threshold()
    pol = replace(pol, max_preemptions_per_cycle=0)
    got = schedule(snap, pol, NOW)
    assert all(early_groups["ann"]) and all(early_groups["bob"]) and early_groups["<specials>"] == [True, True]
    want = _decide_deferring_late(snap, pol, NOW, monkeypatch)
    assert got == want
    assert list(got.pending_reasons.items()) == list(want.pending_reasons.items())


def test_the_rest_of_a_group_deferred_by_the_cap_in_its_turn_is_told_so():
    # one plan allowed: bob's first 4-GPU job takes it; time-sharing then reaches each other
    # group in turn, whose first job finds the cycle's plans spent: that job and the rest of its
    # group wait for the next cycle, and every one of them is told so
    snap, pol = _two_users_past_the_threshold()
    d = schedule(snap, replace(pol, max_preemptions_per_cycle=1), NOW)
    assert len(d.reservations) == 1 and len(d.suspends) == 1
    waiting = [r for jid, r in d.pending_reasons.items() if jid not in d.reservations]
    assert len(waiting) == 39
    assert all(r.endswith("this cycle already planned 1 preemptions, the next cycle continues") for r in waiting)
