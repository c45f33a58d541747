"""Issue 12: scheduler leadership is fenced, not only locked, and the database itself refuses to
give a GPU twice. Real `hai scheduler` processes on PostgreSQL: a leader paused (SIGSTOP) past
its lease, or whose lock connection dropped, while a second one took over must not commit a
single decision afterwards; every decision row carries the epoch of the leader that wrote it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError

from hai.db.base import utcnow
from hai.db.migrate import upgrade
from hai.db.models import GpuHold, Job, JobAllocation, JobEvent, SchedulerLease
from hai.domain import scheduler as sched
from hai.main import create_app
from hai.services import auth
from hai.services.context import Platform
from hai.services.reports import release
from hai.services.scheduling import apply_decisions, run_cycle
from hai.settings import Settings
from tests.conftest import Api
from tests.e2e.conftest import wait_for

REPO = Path(__file__).resolve().parents[2]
LEASE_S = 3.0


@pytest.fixture
def api(pg_api):
    return pg_api


class Scheduler:
    """One `hai scheduler` process; its output goes to a file the test reads."""

    def __init__(self, name: str, pg_url: str, tmp_path: Path, *, lease_s: float = LEASE_S, env: dict | None = None):
        self.log_path = tmp_path / f"scheduler-{name}.log"
        full_env = {
            **os.environ, "PYTHONUNBUFFERED": "1", "HAI_DB__URL": pg_url, "HAI_REDIS__URL": "",
            "HAI_DATA_DIR": str(tmp_path / name), "HAI_SCHEDULER__LEASE_S": str(lease_s),
            "HAI_SCHEDULER__INTERVAL_S": "0.3", "HAI_AGENT__LOST_AFTER_S": "3600", **(env or {}),
        }
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "hai.cli.main", "scheduler"], cwd=REPO, env=full_env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text()

    def stopped(self) -> bool:
        """The process is in the stopped state (SIGSTOP), as /proc says."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] == "T"

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


@pytest.fixture
def schedulers(pg_url, tmp_path):
    started: list[Scheduler] = []

    def start(name: str, **kw) -> Scheduler:
        s = Scheduler(name, pg_url, tmp_path, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


def lease(platform: Platform) -> SchedulerLease | None:
    with platform.sessions() as s:
        return s.get(SchedulerLease, "scheduler")


def leads(platform: Platform, sched_proc: Scheduler, epoch: int | None = None) -> SchedulerLease | None:
    row = lease(platform)
    if row is not None and f":{sched_proc.pid}:" in row.holder and (epoch is None or row.epoch == epoch):
        return row
    return None


def allocations(platform: Platform, job_id: int) -> list[JobAllocation]:
    with platform.sessions() as s:
        return list(s.scalars(select(JobAllocation).where(JobAllocation.job_id == job_id).order_by(JobAllocation.id)))


def placed_by(platform: Platform, job_id: int) -> int | None:
    allocs = allocations(platform, job_id)
    return allocs[0].epoch if allocs else None


def first_write_of(platform: Platform, epoch: int) -> datetime:
    with platform.sessions() as s:
        return s.scalar(select(func.min(JobEvent.at)).where(JobEvent.epoch == epoch))


def assert_nothing_of_epoch_after(platform: Platform, epoch: int, since: datetime) -> None:
    with platform.sessions() as s:
        late_events = s.scalars(select(JobEvent).where(JobEvent.epoch == epoch, JobEvent.at >= since)).all()
        late_allocs = s.scalars(select(JobAllocation).where(JobAllocation.epoch == epoch,
                                                            JobAllocation.created_at >= since)).all()
    assert late_events == [] and late_allocs == []


def assert_each_gpu_held_once(platform: Platform) -> None:
    with platform.sessions() as s:
        active = s.scalars(select(JobAllocation).where(JobAllocation.active.is_(True))).all()
        holds = s.execute(select(GpuHold.node_name, GpuHold.gpu, GpuHold.allocation_id)).all()
    expected = sorted((a.node_name, g, a.id) for a in active for g in a.gpus)
    assert sorted(holds) == expected
    assert len({(n, g) for n, g, _ in holds}) == len(holds)


def test_leader_paused_past_its_lease_commits_nothing_after_the_successor_led(api, pg_platform, schedulers):
    api.register_node("p0", gpus=8)
    api.register_node("p1", gpus=8)
    a = schedulers("a")
    wait_for(lambda: leads(pg_platform, a, 1), timeout=90, what="scheduler A to lead with epoch 1")
    j1 = api.submit(gpus_per_node=8, name="before-pause")
    wait_for(lambda: placed_by(pg_platform, j1["id"]) == 1, timeout=60, what="A to place j1")

    os.kill(a.pid, signal.SIGSTOP)
    wait_for(a.stopped, timeout=30, what="A to stop")
    j2 = api.submit(gpus_per_node=8, name="while-paused")
    b = schedulers("b")
    # B waits out A's lease (A's process and its lock connection are alive, only paused)
    wait_for(lambda: leads(pg_platform, b, 2), timeout=90, what="scheduler B to take over with epoch 2")
    assert "took over from epoch 1" in b.output()
    wait_for(lambda: placed_by(pg_platform, j2["id"]) == 2, timeout=60, what="B to place j2")
    b_first = first_write_of(pg_platform, 2)
    assert b_first is not None

    # A resumes: its next fenced transaction finds epoch 2 and steps down, writing nothing
    j3 = api.submit(gpus_per_node=8, name="after-resume")  # a decision A would take if it could
    os.kill(a.pid, signal.SIGCONT)
    wait_for(lambda: "fenced off" in a.output(), timeout=60, what="A to find itself fenced off")
    wait_for(lambda: "another scheduler leads" in a.output().split("fenced off", 1)[1], timeout=60,
             what="A to wait for leadership again")
    assert placed_by(pg_platform, j3["id"]) in (None, 2)  # queued (cluster full) or placed by B: never by A
    assert_nothing_of_epoch_after(pg_platform, 1, b_first)
    assert leads(pg_platform, b, 2)
    assert_each_gpu_held_once(pg_platform)


def test_leader_paused_inside_its_decision_transaction_commits_nothing(api, pg_platform, schedulers):
    api.register_node("p0", gpus=8)
    # A stops itself between writing j1's placement and committing it (holding the lease row)
    a = schedulers("a", env={"HAI_FAULT_STOP_AT": "scheduler_before_commit"})
    wait_for(lambda: leads(pg_platform, a, 1), timeout=90, what="scheduler A to lead")
    j1 = api.submit(gpus_per_node=8, name="contested")
    wait_for(a.stopped, timeout=60, what="A to stop inside its decision transaction")
    assert allocations(pg_platform, j1["id"]) == []  # not committed

    b = schedulers("b")
    # the server ends A's idle transaction after the lease; B takes over and places j1
    wait_for(lambda: leads(pg_platform, b, 2), timeout=90, what="B to take over")
    wait_for(lambda: placed_by(pg_platform, j1["id"]) == 2, timeout=60, what="B to place j1")
    os.kill(a.pid, signal.SIGCONT)
    wait_for(lambda: "fenced off" in a.output(), timeout=60, what="A to find itself fenced off")

    allocs = allocations(pg_platform, j1["id"])
    assert [(x.epoch, x.attempt) for x in allocs] == [(2, 1)]  # one placement, B's
    with pg_platform.sessions() as s:
        assert s.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.epoch == 1)) == 0
        assert s.get(Job, j1["id"]).attempt == 1
    assert_each_gpu_held_once(pg_platform)


def test_leader_whose_lock_connection_dropped_is_replaced_at_once_and_fenced(api, pg_platform, schedulers, pg_url):
    api.register_node("p0", gpus=8)
    # a lease far longer than the test: B can only take over because A's lock connection died
    a = schedulers("a", lease_s=600)
    wait_for(lambda: leads(pg_platform, a, 1), timeout=90, what="scheduler A to lead")
    j1 = api.submit(gpus_per_node=4, name="by-a")
    wait_for(lambda: placed_by(pg_platform, j1["id"]) == 1, timeout=60, what="A to place j1")
    b = schedulers("b", lease_s=600)
    wait_for(lambda: "another scheduler leads" in b.output(), timeout=90, what="B to wait")

    with pg_platform.engine.connect() as conn:
        killed = conn.execute(text(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE :n"
        ), {"n": f"hai-scheduler-lock %:{a.pid}:%"}).scalars().all()
    assert killed == [True]
    wait_for(lambda: leads(pg_platform, b, 2), timeout=60, what="B to take over once A's lock is gone")
    j2 = api.submit(gpus_per_node=4, name="by-b")
    wait_for(lambda: placed_by(pg_platform, j2["id"]) == 2, timeout=60, what="B to place j2")
    b_first = first_write_of(pg_platform, 2)
    # A notices (its lock is gone, or its next fenced transaction fails) and waits again
    wait_for(lambda: "another scheduler leads" in a.output().split("scheduler: leading", 1)[1], timeout=60,
             what="A to step down")
    assert_nothing_of_epoch_after(pg_platform, 1, b_first)
    assert leads(pg_platform, b, 2)
    assert_each_gpu_held_once(pg_platform)


def _platform_on(backend: str, request, tmp_path: Path) -> Platform:  # noqa: ANN001
    """The ``pg_platform`` fixture's PostgreSQL, or an SQLite file migrated the same way."""
    if backend == "postgresql":
        return request.getfixturevalue("pg_platform")
    url = f"sqlite:///{tmp_path / 'hai.db'}"
    upgrade(url)
    platform = Platform.from_settings(Settings(data_dir=tmp_path, db={"url": url}, frontend_dist=tmp_path / "none"))
    request.addfinalizer(platform.close)
    return platform


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_the_database_refuses_to_give_a_gpu_twice(backend, request, tmp_path):
    platform = _platform_on(backend, request, tmp_path)
    with TestClient(create_app(platform)) as client:
        api = Api(client, platform)
        api.register_node("p0", gpus=8)
        j1 = api.submit(gpus_per_node=8, name="holder")
        j2 = api.submit(gpus_per_node=8, name="intruder")
        with platform.sessions() as s:
            assert run_cycle(s, settings=platform.settings).started == [j1["id"]]
        # a bug above the database: j2 is started on GPUs 2 and 5 that j1 holds
        forced = sched.Decisions(starts=[sched.Start(job_id=j2["id"], allocations=(sched.Allocation("p0", (2, 5)),),
                                                     reason="a buggy placement")])
        with platform.sessions() as s:
            with pytest.raises(IntegrityError, match="gpu_holds"):
                apply_decisions(s, forced, settings=platform.settings, now=utcnow())
                s.commit()
            s.rollback()
        with platform.sessions() as s:
            assert s.get(Job, j2["id"]).state == "queued"
            assert s.scalars(select(JobAllocation).where(JobAllocation.job_id == j2["id"])).all() == []
        assert_each_gpu_held_once(platform)
        # released with its allocation, the same GPUs can be held again
        with platform.sessions() as s:
            for alloc in s.scalars(select(JobAllocation).where(JobAllocation.job_id == j1["id"])):
                release(alloc, utcnow())
            s.commit()
        with platform.sessions() as s:
            assert s.scalar(select(func.count()).select_from(GpuHold)) == 0
            apply_decisions(s, forced, settings=platform.settings, now=utcnow())
            s.commit()
        with platform.sessions() as s:
            assert sorted(s.scalars(select(GpuHold.gpu))) == [2, 5]
        assert_each_gpu_held_once(platform)


def test_fence_on_sqlite_refuses_a_superseded_leader(tmp_path):
    """The same fence on SQLite (the embedded mode): B takes over once A's lease ran out; A's
    next fenced transaction fails and what it wrote is rolled back."""
    import threading

    from hai.services.leader import Fenced, fence, leadership

    url = f"sqlite:///{tmp_path / 'hai.db'}"
    upgrade(url)

    def platform() -> Platform:
        return Platform.from_settings(Settings(data_dir=tmp_path, db={"url": url}, frontend_dist=tmp_path / "none",
                                               scheduler={"lease_s": 1.0}))

    pa, pb = platform(), platform()
    stop = threading.Event()
    try:
        with leadership(pa, stop=stop) as la:
            with pa.sessions() as s:
                fence(s, la)
                s.commit()
            b_leads = threading.Event()
            b_lease = []

            def b() -> None:
                with leadership(pb, stop=stop, poll_s=0.1) as lb:
                    b_lease.append(lb)
                    b_leads.set()
                    stop.wait(60)

            t = threading.Thread(target=b)
            t.start()
            assert b_leads.wait(60)  # A is silent past its lease (same process: not known dead)
            assert (la.epoch, b_lease[0].epoch) == (1, 2)
            with pa.sessions() as s:
                api_user, _ = auth.create_user(session=s, name="u", group="g")
            with pa.sessions() as s:
                s.add(Job(name="late", user_id=api_user.id, user_name="u", group="g", command=["true"],
                          queued_at=utcnow()))
                with pytest.raises(Fenced, match="superseded"):
                    fence(s, la)
                s.rollback()
            with pb.sessions() as s:
                assert s.scalars(select(Job)).all() == []
                fence(s, b_lease[0])
                s.commit()
            stop.set()
            t.join(30)
    finally:
        stop.set()
        pa.close()
        pb.close()


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_a_cycle_longer_than_the_lease_does_not_fence_its_own_leader(backend, request, tmp_path, monkeypatch):
    """Issue 14: the first cycle placing 1,000 jobs on a loaded machine outlasted the lease. The
    cycle holds the lease row from its fence to its commit, so no one can have taken over; it
    renews the lease before it commits, and the next cycle finds its leader current. The lease
    running out *inside* the transaction is made by moving ``expires_at`` into the past there."""
    import threading

    from hai.services.leader import Fenced, fence, leadership

    platform = _platform_on(backend, request, tmp_path)

    def run_out(s) -> None:  # noqa: ANN001 - the lease ends while the cycle's transaction runs
        s.execute(text("UPDATE scheduler_leases SET expires_at = :t"), {"t": datetime(2000, 1, 1)})

    with TestClient(create_app(platform)) as client:
        api = Api(client, platform)
        api.register_node("p0", gpus=8)
        j1 = api.submit(gpus_per_node=4, name="long-cycle")
        with leadership(platform, stop=threading.Event()) as lease:
            from hai.services import scheduling

            real_load = scheduling._load

            def slow_load(session, **kw):  # noqa: ANN001, ANN003
                out = real_load(session, **kw)
                run_out(session)
                return out

            monkeypatch.setattr(scheduling, "_load", slow_load)
            with platform.sessions() as s:
                assert run_cycle(s, settings=platform.settings, lease=lease).started == [j1["id"]]
            monkeypatch.setattr(scheduling, "_load", real_load)
            with platform.sessions() as s:  # the next cycle: still the leader
                fence(s, lease)
                s.rollback()
            # without the renewal at the end, a lease that ran out is found out: the check is real
            with platform.sessions() as s:
                fence(s, lease)
                run_out(s)
                s.commit()
            with platform.sessions() as s, pytest.raises(Fenced, match="ran out"):
                fence(s, lease)
    assert placed_by(platform, j1["id"]) == lease.epoch
