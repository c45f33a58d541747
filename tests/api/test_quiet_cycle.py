"""Issue 14: a scheduling cycle with nothing to decide (no queued job that is not held, no
active job of the priority a cycle demotes) skips the snapshot and writes only the usage. It
must write what the full cycle would have written, and it may only be taken where the full
cycle would decide nothing."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from hai.db.base import utcnow
from hai.db.models import UserUsage
from hai.domain import scheduler as sched
from hai.services import scheduling


def _full_cycle_would(api, now):  # noqa: ANN001
    """What the full cycle decides and writes at ``now``, computed without writing."""
    settings = api.platform.settings
    with api.platform.sessions() as s:
        snapshot, _ = scheduling._load(s, now=now, lost_after_s=settings.agent.lost_after_s)
        usage = scheduling._update_usage(s, snapshot, now=now, half_life_s=settings.scheduler.usage_half_life_s,
                                         write=False)
        s.rollback()
    snapshot = sched.Snapshot(nodes=snapshot.nodes, running=snapshot.running, queued=snapshot.queued,
                              quotas=snapshot.quotas, usage=usage)
    return sched.schedule(snapshot, scheduling.policy_from_settings(settings), now.timestamp()), usage


def _cycle(api, now):  # noqa: ANN001
    with api.platform.sessions() as s:
        return scheduling.run_cycle(s, settings=api.platform.settings, now=now)


def _usage(api) -> dict[str, float]:  # noqa: ANN001
    with api.platform.sessions() as s:
        return {u.user_name: u.gpu_s for u in s.scalars(select(UserUsage))}


def _nothing(d: sched.Decisions) -> bool:
    return not (d.starts or d.suspends or d.demotions or d.reservations or d.pending_reasons)


@pytest.fixture
def busy(api):  # noqa: ANN001
    """Two users' jobs placed and active, a third user's job held in the queue."""
    for n in ("n0", "n1", "n2"):
        api.register_node(n)
    api.submit(gpus_per_node=8, name="a1")
    api.submit(gpus_per_node=4, name="a2")
    api.submit(api.bob, gpus_per_node=8, nodes=1, name="b1")
    held = api.submit(api.admin, gpus_per_node=8, name="held")
    r = api.post(f"/api/v1/jobs/{held['id']}/suspend", api.admin)
    assert r.status_code == 200, r.text
    t0 = utcnow()
    placed = _cycle(api, t0)
    assert len(placed.started) == 3 and held["id"] not in placed.started
    return t0


def test_a_cycle_with_nothing_to_decide_writes_the_usage_the_full_cycle_would(api, busy, monkeypatch):
    for dt in (40.0, 95.5):
        now = busy + timedelta(seconds=dt)
        decisions, usage = _full_cycle_would(api, now)
        assert _nothing(decisions)  # the case the quiet cycle is for
        monkeypatch.setattr(scheduling, "_load", lambda *a, **k: pytest.fail("the quiet cycle loaded the snapshot"))
        result = _cycle(api, now)
        monkeypatch.undo()
        assert result.started == [] and result.suspended == [] and result.considered == ()
        assert result.snapshot_jobs == 3  # a1, a2, b1 active
        assert _usage(api) == pytest.approx(usage, rel=1e-12)
    # (the first cycle that sees a user running starts the count at 0; the second adds the GPU-seconds)
    assert set(usage) == {"alice", "bob"} and usage["alice"] == pytest.approx(12 * 55.5)
    assert usage["bob"] == pytest.approx(8 * 55.5)


def test_a_queued_job_or_a_demotable_running_job_takes_the_full_cycle(api, busy, monkeypatch):
    loads = []
    real = scheduling._load
    monkeypatch.setattr(scheduling, "_load", lambda *a, **k: loads.append(1) or real(*a, **k))
    api.submit(gpus_per_node=8, name="waits")  # no room left for it: queued, with a pending reason
    now = busy + timedelta(seconds=10)
    decisions, _ = _full_cycle_would(api, now)
    assert decisions.pending_reasons
    _cycle(api, now)
    assert len(loads) == 2  # _full_cycle_would's and the cycle's own

    api.post(f"/api/v1/jobs/{api.get('/api/v1/jobs').json()['items'][0]['id']}/cancel")
    loads.clear()
    _cycle(api, now + timedelta(seconds=1))
    assert loads == []  # nothing queued: quiet again

    # an ABOVE_NORMAL job running past demote_after_s is demoted by a cycle, queue or not
    api.register_node("n3")
    job = api.submit(api.bob, gpus_per_node=8, name="above", priority="ABOVE_NORMAL")
    placed = _cycle(api, now + timedelta(seconds=2))
    assert placed.started == [job["id"]]
    later = now + timedelta(seconds=2 + api.platform.settings.scheduler.demote_after_s + 1)
    decisions, _ = _full_cycle_would(api, later)
    assert [d.job_id for d in decisions.demotions] == [job["id"]]
    loads.clear()
    _cycle(api, later)
    assert loads == [1]
    assert api.get(f"/api/v1/jobs/{job['id']}", api.bob).json()["priority"] == "NORMAL"
