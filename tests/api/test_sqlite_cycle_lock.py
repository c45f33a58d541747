"""Issue 12: on SQLite (``hai dev``), a scheduling cycle plans in a deferred read and takes the
database's write lock only to write its decisions. A cycle at 10,000 queued jobs held the lock
while it planned, and submissions queued behind it past the busy timeout ("database is
locked"). Here a submission is made, and the write lock probed, from inside the planning step."""

from __future__ import annotations

import sqlite3
import threading

import pytest
from sqlalchemy import select

from hai.db.models import Job, SchedulerLease
from hai.domain import scheduler as sched
from hai.services.leader import leadership
from hai.services.runner import SchedulerLoop


def _write_lock_free(db_path: str) -> bool:
    conn = sqlite3.connect(db_path, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError as exc:
        assert "locked" in str(exc)
        return False
    finally:
        conn.close()


def test_a_submission_commits_while_a_cycle_plans_and_the_next_cycle_places_it(api, monkeypatch):
    api.register_node("n0")
    first = api.submit(gpus_per_node=4, name="first")
    db_path = api.platform.engine.url.database
    real = sched.schedule
    during: dict = {}

    def planning(snapshot, policy, now, **kw):  # noqa: ANN001, ANN003
        if not during:
            during["lock_free"] = _write_lock_free(db_path)
            during["submitted"] = api.submit(gpus_per_node=4, name="during-planning")["id"]
        return real(snapshot, policy, now, **kw)

    monkeypatch.setattr(sched, "schedule", planning)
    loop = SchedulerLoop(api.platform)
    with leadership(api.platform, stop=threading.Event()) as lease:
        one = loop.cycle_once(lease)
        assert during["lock_free"] is True  # nobody held the write lock while the cycle planned
        assert one.started == [first["id"]] and during["submitted"] not in one.considered
        two = loop.cycle_once(lease)
        assert two.started == [during["submitted"]]
        with api.platform.sessions() as s:
            assert {j.state for j in s.scalars(select(Job))} == {"starting"}
            events = [e.epoch for j in s.scalars(select(Job)) for e in j.events if e.to_state == "starting"]
            assert events == [lease.epoch, lease.epoch]  # written fenced, by this leader
            assert s.get(SchedulerLease, lease.name).epoch == lease.epoch


def test_a_cycle_whose_leader_was_superseded_while_it_planned_writes_nothing(api, monkeypatch):
    """The fence moved to the writing transaction: a takeover during planning still wins."""
    from sqlalchemy import update

    from hai.services.leader import Fenced

    api.register_node("n0")
    job = api.submit(gpus_per_node=4)
    real = sched.schedule

    def planning(snapshot, policy, now, **kw):  # noqa: ANN001, ANN003
        with api.platform.sessions() as s:  # another scheduler took over meanwhile
            s.execute(update(SchedulerLease).values(epoch=SchedulerLease.epoch + 1, holder="someone-else"))
            s.commit()
        return real(snapshot, policy, now, **kw)

    monkeypatch.setattr(sched, "schedule", planning)
    with leadership(api.platform, stop=threading.Event()) as lease, pytest.raises(Fenced, match="superseded"):
        SchedulerLoop(api.platform).cycle_once(lease)
    with api.platform.sessions() as s:
        assert s.get(Job, job["id"]).state == "queued"
