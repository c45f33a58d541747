"""The fast lane on a kept level below ``fast_lane_min_jobs`` whose jobs share few lane keys (a
sweep of like jobs, issue 12's deep queue of 1-GPU jobs): it is taken there, and decides as the
full ladder does; a kept level of many keys does not take it (its bookkeeping would cost more than
its hits: the Fire-Flyer kept cycle)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hai.domain.scheduler import KeptQueue, schedule
from hai.domain.scheduler.core import _Cycle

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import decision_hash  # noqa: E402
from scheduler_builders import cluster, job, policy  # noqa: E402

NOW = 100_000.0


def _full_cluster_and_queue(users: int, jobs: int):
    """Two 8-GPU nodes held by two jobs of other users; ``jobs`` queued 1-GPU jobs (some HIGH,
    which may preempt) spread over ``users`` users."""
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("r0").user("x").started(NOW - 7200))
    c.run(job("r1").user("y").started(NOW - 60))
    c.queue(*(job(f"q{i}").user(f"u{i % users}").gpus(1).priority("HIGH" if i % 97 == 0 else "NORMAL")
              .submitted(i).queued_at(NOW - 30) for i in range(jobs)))
    return c.snapshot()


def _cycles(snap, monkeypatch, *, lane: bool, spy: list | None = None) -> list[str]:
    """Three kept cycles, the queue growing between them (new like jobs); each cycle's decisions."""
    out = []
    with monkeypatch.context() as m:
        m.setattr(_Cycle, "fast_lane", lane)
        if spy is not None:
            real = _Cycle._lane_misses

            def counted(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
                spy.append(len(a[0]))
                return real(self, *a, **kw)

            m.setattr(_Cycle, "_lane_misses", counted)
        kept = KeptQueue()
        pol = policy()
        now = NOW
        for k in range(3):
            d = schedule(snap, pol, now, kept=kept)
            out.append(decision_hash.canonical(d))
            more = tuple(replace(q, id=q.id + 10_000 * (k + 1), first_submitted_at=1e4 * (k + 1) + q.first_submitted_at)
                         for q in snap.queued[:50])
            snap = replace(snap, queued=snap.queued + more)
            now += 10
    return out


def test_a_kept_level_of_few_keys_takes_the_lane_and_decides_as_the_ladder_does(monkeypatch):
    snap = _full_cluster_and_queue(users=3, jobs=1200)
    assert len(snap.queued) < _Cycle.fast_lane_min_jobs
    seen: list[int] = []
    with_lane = _cycles(snap, monkeypatch, lane=True, spy=seen)
    assert seen and max(seen) >= 1000  # the NORMAL level (~1,190 jobs) went through the kept lane
    assert with_lane == _cycles(snap, monkeypatch, lane=False)


def test_a_kept_level_of_many_keys_does_not_take_the_lane(monkeypatch):
    snap = _full_cluster_and_queue(users=600, jobs=1200)  # two jobs a key
    seen: list[int] = []
    with_lane = _cycles(snap, monkeypatch, lane=True, spy=seen)
    assert seen == []
    assert with_lane == _cycles(snap, monkeypatch, lane=False)


@pytest.mark.parametrize("users", [1, 8])
def test_few_keys_is_judged_on_the_kept_keys(users, monkeypatch):
    """8 jobs a key or more: few; the floor of 256 jobs."""
    snap = _full_cluster_and_queue(users=users, jobs=300)
    kept = KeptQueue()
    schedule(snap, policy(), NOW, kept=kept)
    cycle = _Cycle(snap, policy(), NOW + 1, kept)
    normal = [lv for _rank, lv in cycle.levels if len(lv) > 256]
    assert normal and all(cycle._few_keys(lv) for lv in normal)
    monkeypatch.setattr(_Cycle, "fast_lane_jobs_per_key", 64)
    assert all(cycle._few_keys(lv) == (users == 1) for lv in normal)
    monkeypatch.setattr(_Cycle, "fast_lane_kept_min_jobs", 400)
    assert not any(cycle._few_keys(lv) for lv in normal)
