"""Issue 13: the reaper on real PostgreSQL. It runs in the scheduler leader's loop and in Celery
beat, so two may run at once, and one may be stale: its scan read before a heartbeat arrived, it
was paused (SIGSTOP) inside its transaction, or its leader was superseded. None of them may mark
lost a node that has heartbeated since, nor requeue a job twice; a heartbeat caught across a
reap must not hand back the work the reap took away (services/reaper.py)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text, update
from sqlalchemy.exc import DBAPIError

from hai.db.base import utcnow
from hai.db.migrate import upgrade
from hai.db.models import Job, JobEvent, Node, SchedulerLease
from hai.main import create_app
from hai.services import reaper
from hai.services.context import Platform
from hai.services.leader import Fenced, Lease
from hai.settings import Settings
from tests.api.test_agent_protocol_api import cycle
from tests.api.test_node_health_api import heartbeat, node, running
from tests.conftest import Api
from tests.e2e.conftest import wait_for

LOST_AFTER_S = 30


@pytest.fixture
def api(pg_url, tmp_path):
    upgrade(pg_url)
    settings = Settings(data_dir=tmp_path, db={"url": pg_url}, frontend_dist=tmp_path / "none",
                        agent={"lost_after_s": LOST_AFTER_S})
    platform = Platform.from_settings(settings)
    with TestClient(create_app(platform)) as client:
        yield Api(client, platform)
    platform.close()


def _running_jobs(api, names: list[str]) -> dict[str, int]:
    """One 8-GPU job running on each node (started and reported); returns {node: job id}."""
    for name in names:
        api.register_node(name)
    ids = [api.submit(gpus_per_node=8, name=f"j{i}")["id"] for i in range(len(names))]
    assert sorted(cycle(api).started) == sorted(ids)
    where = {}
    for jid in ids:
        n = api.get(f"/api/v1/jobs/{jid}").json()["placement"][0]["node"]
        heartbeat(api, n, [running(jid)])
        where[n] = jid
    return where


def _silence(api, names: list[str], seconds: float = 3600) -> None:
    with api.platform.sessions() as s:
        s.execute(update(Node).where(Node.name.in_(names)).values(last_heartbeat_at=utcnow() - timedelta(seconds=seconds)))
        s.commit()


def _job(api, jid: int) -> dict:
    return api.get(f"/api/v1/jobs/{jid}").json()


def _lost_events(api, name: str) -> int:
    return sum(1 for e in node(api, name)["events"] if e["to_state"] == "lost")


def _requeues(api, jid: int) -> int:
    with api.platform.sessions() as s:
        return len(list(s.scalars(select(JobEvent).where(JobEvent.job_id == jid, JobEvent.reason.like("%was lost; requeued")))))


def _cutoff():
    now = utcnow()
    return now, now - timedelta(seconds=LOST_AFTER_S)


def test_two_reapers_at_once_mark_each_node_lost_once_and_requeue_each_job_once(api):
    names = [f"n{i}" for i in range(6)]
    where = _running_jobs(api, names)
    _silence(api, names)
    start = threading.Barrier(2)
    got: list[list[str]] = [[], []]
    errors: list[BaseException] = []

    def reap(i: int) -> None:
        try:
            with api.platform.sessions() as s:
                start.wait(timeout=30)
                got[i] = reaper.mark_lost_nodes(session=s, settings=api.platform.settings)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reap, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    # each node was reaped by exactly one of them
    assert sorted(got[0] + got[1]) == names and not set(got[0]) & set(got[1])
    for name, jid in where.items():
        assert node(api, name)["state"] == "lost" and _lost_events(api, name) == 1
        j = _job(api, jid)
        assert j["state"] == "queued" and j["restarts"] == 1 and _requeues(api, jid) == 1, j
    # and a third, later one finds nothing left to do
    with api.platform.sessions() as s:
        assert reaper.mark_lost_nodes(session=s, settings=api.platform.settings) == []
    assert all(_job(api, jid)["restarts"] == 1 for jid in where.values())


def test_a_reaper_whose_scan_is_stale_does_not_mark_lost_a_node_that_heartbeated_since(api):
    where = _running_jobs(api, ["n0", "n1"])
    _silence(api, ["n0", "n1"])
    now, cutoff = _cutoff()
    with api.platform.sessions() as s:
        assert reaper.silent_nodes(s, cutoff) == ["n0", "n1"]  # the scan, then both heartbeat
        s.rollback()
        heartbeat(api, "n0", [running(where["n0"])])
        assert reaper.reap_node(s, "n0", cutoff=cutoff, now=now) is False
        assert reaper.reap_node(s, "n1", cutoff=cutoff, now=now) is True
    assert node(api, "n0")["state"] == "ready" and _lost_events(api, "n0") == 0
    j0, j1 = _job(api, where["n0"]), _job(api, where["n1"])
    assert j0["state"] == "running" and j0["restarts"] == 0, j0
    assert j1["state"] == "queued" and j1["restarts"] == 1, j1


def _waiting_on_a_lock(api) -> bool:
    with api.platform.engine.connect() as c:
        return bool(c.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )).scalar())


def test_a_heartbeat_caught_across_a_reap_gets_reregister_not_the_work_taken_away(api):
    """A heartbeat arrives while a reap holds the node (not committed yet): once the reap
    commits, the heartbeat must not answer with the node's assignments as they were (the job
    was requeued: the agent would keep running it) nor renew the node's liveness. Before, it
    read the node unlocked (still ready), waited only at its UPDATE, and answered 'run'."""
    where = _running_jobs(api, ["n0"])
    jid = where["n0"]
    _silence(api, ["n0"])
    now, cutoff = _cutoff()
    out: dict = {}
    with api.platform.sessions() as s:
        assert reaper.reap_node(s, "n0", cutoff=cutoff, now=now, commit=False) is True
        t = threading.Thread(target=lambda: out.update(reply=heartbeat(api, "n0", [running(jid)])))
        t.start()
        wait_for(lambda: _waiting_on_a_lock(api), timeout=30, what="the heartbeat to wait for the reap's lock")
        s.commit()
    t.join(60)
    assert out["reply"]["reregister"] is True and out["reply"]["assignments"] == [], out
    assert node(api, "n0")["state"] == "lost"
    with api.platform.sessions() as s:  # the heartbeat's write was undone: the node is still silent
        assert s.scalar(select(Node.last_heartbeat_at).where(Node.name == "n0")) < cutoff
    j = _job(api, jid)
    assert j["state"] == "queued" and j["restarts"] == 1 and _requeues(api, jid) == 1, j


def test_a_reaper_of_a_superseded_leader_reaps_nothing(api):
    where = _running_jobs(api, ["n0"])
    _silence(api, ["n0"])
    with api.platform.sessions() as s:
        s.add(SchedulerLease(name="scheduler", holder="new", epoch=2, expires_at=utcnow() + timedelta(seconds=60)))
        s.commit()
    old = Lease(name="scheduler", holder="old", epoch=1, lease_s=10)
    with api.platform.sessions() as s, pytest.raises(Fenced):
        reaper.mark_lost_nodes(session=s, settings=api.platform.settings, lease=old)
    assert node(api, "n0")["state"] == "ready"
    assert _job(api, where["n0"])["restarts"] == 0
    # the current leader's reap goes through, and its rows carry its epoch
    current = Lease(name="scheduler", holder="new", epoch=2, lease_s=10)
    with api.platform.sessions() as s:
        assert reaper.mark_lost_nodes(session=s, settings=api.platform.settings, lease=current) == ["n0"]
    with api.platform.sessions() as s:
        ev = s.scalars(select(JobEvent).where(JobEvent.job_id == where["n0"], JobEvent.reason.like("%was lost%"))).one()
        assert ev.epoch == 2


def test_a_reaper_paused_inside_its_transaction_is_ended_and_the_heartbeat_goes_through(api):
    """A reaper stopped (SIGSTOP) after taking the node's row: PostgreSQL ends its idle
    transaction, its writes are undone, and the node's heartbeat is not held up for ever."""
    where = _running_jobs(api, ["n0"])
    jid = where["n0"]
    _silence(api, ["n0"])
    now, cutoff = _cutoff()
    out: dict = {}
    s = api.platform.sessions()
    try:
        assert reaper.reap_node(s, "n0", cutoff=cutoff, now=now, idle_timeout_s=1.0, commit=False) is True
        # the reaper is now paused, holding the row: the heartbeat waits, then goes through
        t = threading.Thread(target=lambda: out.update(reply=heartbeat(api, "n0", [running(jid)])))
        t.start()
        t.join(60)
        assert out["reply"]["reregister"] is False and [a["job_id"] for a in out["reply"]["assignments"]] == [jid]
        with pytest.raises(DBAPIError):  # the resumed reaper's commit: its session was ended
            s.execute(text("SELECT 1"))
            s.commit()
    finally:
        s.close()
    assert node(api, "n0")["state"] == "ready" and _lost_events(api, "n0") == 0
    j = _job(api, jid)
    assert j["state"] == "running" and j["restarts"] == 0, j
    with api.platform.sessions() as s2:
        assert s2.get(Job, jid).attempt == 1
