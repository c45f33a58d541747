"""Issue 12 on PostgreSQL: the scheduler keeps the queue across cycles and reads only the job
rows written by transactions not known to have ended at its last read (the snapshot's xmin,
services/scheduling._refresh_pg). The incremental snapshot must equal a fresh full read after
every kind of write, and in particular after a write by a transaction that was open across a
read and commits after it (what a "changed since the largest id seen" marker misses: the last
test shows that such a marker gets this very sequence wrong)."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import text, update

from hai.db.base import utcnow
from hai.db.models import Job
from hai.domain.jobs import JobState
from hai.services import scheduling
from hai.services.jobs import requeue_as_restart, transition
from hai.services.leader import leadership
from hai.services.runner import SchedulerLoop
from tests.api.test_queue_cache import _cycle, _late_submissions_and_a_deleted_row, _same, _snapshot, _write


@pytest.fixture
def api(pg_api):
    return pg_api


def _open(api, sql: str, **params):  # noqa: ANN001, ANN003, ANN202
    """A transaction that has written (so it has its id) and is left open: (connection, commit)."""
    conn = api.platform.engine.connect()
    conn.execute(text(sql), params)

    def commit() -> None:
        conn.commit()
        conn.close()
    return conn, commit


def test_the_incremental_queue_equals_a_full_read_after_every_kind_of_write_on_postgresql(api):
    api.register_node("n0")
    api.register_node("n1")
    cache = scheduling.QueueCache()
    loop = SchedulerLoop(api.platform)
    jobs = [api.submit(gpus_per_node=g, name=f"j{i}")["id"] for i, g in enumerate([8, 8, 4, 4, 8, 2, 8, 1])]
    jobs += [api.submit(api.bob, gpus_per_node=8, priority=p)["id"] for p in ("HIGH", "LOW", "NORMAL")]
    _same(api, cache)
    assert cache.full_reads == 1 and len(cache.jobs) == len(jobs)
    assert _same(api, cache) == 0  # nothing written since: nothing read

    with leadership(api.platform, stop=threading.Event()) as lease:
        first = _cycle(api, loop, lease)  # starts and pending reasons, written by the fenced transaction
        assert first.started and loop.queue.full_reads == 1
        assert set(first.considered) == set(jobs)
        assert _same(api, cache) > 0
        _cycle(api, loop, lease)  # the loop's cache reads its own cycle's writes again
        assert loop.queue.full_reads == 1

        queued = [j for j in jobs if j not in first.started]
        reads = cache.full_reads
        api.post(f"/api/v1/jobs/{queued[0]}/cancel", api.admin).raise_for_status()
        api.post(f"/api/v1/jobs/{queued[1]}/suspend", api.admin).raise_for_status()  # held: leaves the snapshot
        _same(api, cache)
        assert queued[0] not in cache.jobs and queued[1] not in cache.jobs
        # the cancelled row is not read (a terminal state): the count noticed, the queued ids said which
        assert (cache.full_reads, cache.departures_read) == (reads, 1)
        # a finished job's row written again is not read at all (the history is not scanned)
        _write(api, lambda s: s.execute(update(Job).where(Job.id == queued[0]).values(name="renamed")))
        assert _same(api, cache) == 0 and cache.departures_read == 1
        api.post(f"/api/v1/jobs/{queued[1]}/resume", api.admin).raise_for_status()
        _same(api, cache)
        assert queued[1] in cache.jobs

        running = first.started[0]
        api.post(f"/api/v1/jobs/{running}/suspend", api.admin).raise_for_status()
        _same(api, cache)

        def requeue(s):  # noqa: ANN001
            job = s.get(Job, running)
            job.suspensions += 1
            transition(s, job, JobState.QUEUED, reason="suspended at a checkpoint")
        _write(api, requeue)
        _same(api, cache)
        api.post(f"/api/v1/jobs/{running}/resume", api.admin).raise_for_status()
        _same(api, cache)
        assert cache.jobs[running].suspensions == 1

        other = first.started[1]

        def restart(s):  # noqa: ANN001
            requeue_as_restart(s, s.get(Job, other), reason="node lost", pending_reason="requeued after node n0 was lost",
                               now=utcnow())
        _write(api, restart)
        _same(api, cache)
        assert cache.jobs[other].attained_gpu_s > 0
        accounts = loop.queue.kept.accounts
        _cycle(api, loop, lease)  # its queue differs from the last cycle's by the rows written since
        assert loop.queue.kept.accounts == accounts + 1  # updated from the rows read, not proved
        _same(api, cache)

        # raw SQL behind the application's back; the second a HOT update (no indexed column changes)
        _write(api, lambda s: s.execute(update(Job).where(Job.id == queued[2]).values(priority="VERY_HIGH")))

        def hot(s):  # noqa: ANN001
            hot_updates = text("SELECT n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = 'jobs'")
            before = s.execute(hot_updates).scalar_one()  # this backend's counts not yet reported
            s.execute(text("UPDATE jobs SET reserved_nodes = '[\"n1\"]', allow_cross_zone = true WHERE id = :i"),
                      {"i": queued[3]})
            assert s.execute(hot_updates).scalar_one() == before + 1
        _write(api, hot)
        _same(api, cache)
        assert cache.jobs[queued[2]].priority.value == "VERY_HIGH"
        assert cache.shows.reserved[queued[3]] == ("n1",)

        # a subtransaction: a savepoint's write committed with its parent, one rolled back
        def savepoints(s):  # noqa: ANN001
            with s.begin_nested():
                s.execute(update(Job).where(Job.id == queued[4]).values(suspensions=7))
            nested = s.begin_nested()
            s.execute(update(Job).where(Job.id == queued[5]).values(suspensions=9))
            nested.rollback()
        _write(api, savepoints)
        _same(api, cache)
        assert cache.jobs[queued[4]].suspensions == 7 and cache.jobs[queued[5]].suspensions == 0

        # a row lock (FOR UPDATE sets xmax, not xmin) changes nothing to read; a frozen table neither
        _write(api, lambda s: s.execute(text("SELECT id FROM jobs WHERE id = :i FOR UPDATE"), {"i": queued[6]}))
        assert _same(api, cache) == 0
        with api.platform.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(text("VACUUM (FREEZE) jobs"))
        assert _same(api, cache) == 0

        _late_submissions_and_a_deleted_row(api, cache, loop, lease)


def _open_across_a_read(api, cache, loop, lease):  # noqa: ANN001, ANN202
    """Transactions that write, stay open while the cache and a cycle read, and commit after:
    an update of a queued job, an insert, and one that takes a job out of the queue; a later
    transaction commits before the read."""
    ids = sorted(cache.jobs)
    a, commit_a = _open(api, "UPDATE jobs SET priority = 'VERY_HIGH' WHERE id = :i", i=ids[0])
    b, commit_b = _open(api, "UPDATE jobs SET state = 'cancelled' WHERE id = :i", i=ids[1])
    c, commit_c = _open(api, "INSERT INTO jobs SELECT (jsonb_populate_record(NULL::jobs, to_jsonb(j) || jsonb_build_object("
                        "'id', nextval(pg_get_serial_sequence('jobs', 'id')), 'name', 'copy'))).* FROM jobs j WHERE id = :i",
                        i=ids[2])
    # a transaction begun after them commits first (a submission): its id, larger than theirs, is
    # below the read's xmax and among the rows it sees
    api.submit(gpus_per_node=8, name="after", priority="LOW")
    try:
        _snapshot(api, cache)  # reads, and moves its horizon, while the three are open
        loop.cycle_once(lease)
    finally:
        commit_a(), commit_b(), commit_c()
    return ids


def test_a_write_open_across_a_read_and_committed_after_it_is_read_next_time(api):
    api.register_node("n0")
    for i in range(6):
        api.submit(gpus_per_node=8, name=f"j{i}", priority="LOW")  # one starts, five wait
    cache = scheduling.QueueCache()
    loop = SchedulerLoop(api.platform)
    _same(api, cache)
    with leadership(api.platform, stop=threading.Event()) as lease:
        loop.cycle_once(lease)
        _same(api, cache)
        reads = cache.full_reads
        ids = _open_across_a_read(api, cache, loop, lease)
        _same(api, cache)  # the three commits are in the cache
        # the update and the insert found by the horizon, the cancellation by the count and the ids
        assert cache.full_reads == reads and cache.departures_read == 1
        assert cache.jobs[ids[0]].priority.value == "VERY_HIGH" and ids[1] not in cache.jobs
        expected = tuple(q.id for q in _snapshot(api)[0].queued)
        assert loop.cycle_once(lease).considered == expected


def test_a_marker_of_the_newest_transaction_seen_misses_that_write(api, monkeypatch):
    """The negative control: the same sequence with the horizon taken as the snapshot's xmax (the
    next transaction id, "everything before it was read") leaves the cache stale."""
    api.register_node("n0")
    for i in range(6):
        api.submit(gpus_per_node=8, name=f"j{i}", priority="LOW")
    monkeypatch.setattr(scheduling, "PG_HORIZON", "pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
    cache = scheduling.QueueCache()
    loop = SchedulerLoop(api.platform)
    _same(api, cache)
    with leadership(api.platform, stop=threading.Event()) as lease:
        loop.cycle_once(lease)
        _same(api, cache)
        _open_across_a_read(api, cache, loop, lease)
        full, _ = _snapshot(api)
        stale, _ = _snapshot(api, cache)
        assert stale.queued != full.queued


def test_a_horizon_too_many_transactions_old_makes_a_full_read(api):
    """Past PG_HORIZON_MAX_AGE transactions the 32-bit xmin comparison is no longer trusted."""
    api.register_node("n0")
    for i in range(3):
        api.submit(gpus_per_node=8, name=f"j{i}")
    cache = scheduling.QueueCache()
    _same(api, cache)
    _same(api, cache)  # (how many rows an incremental read takes depends on every open transaction
    assert cache.full_reads == 1  # of the server, other databases' too: not asserted here)
    cache.mark -= scheduling.PG_HORIZON_MAX_AGE + 1  # as if ~1e9 transactions had run since
    rows = _same(api, cache)
    assert cache.full_reads == 2 and rows == len(cache.jobs) == 3
    _same(api, cache)
    assert cache.full_reads == 2  # a fresh horizon again: incremental


def test_a_running_job_is_built_again_only_when_its_row_its_allocations_or_the_numbering_change_on_postgresql(api):
    """The same sequence as on SQLite, through the PostgreSQL cache of the active side
    (``ActiveCache``: rows kept by their version, ``xmin``)."""
    from tests.api.test_queue_cache import (
        test_a_running_job_is_built_again_only_when_its_row_its_allocations_or_the_numbering_change as same_on_sqlite)

    same_on_sqlite(api)


def test_the_active_side_reads_only_the_rows_whose_version_changed(api):
    """``ActiveCache`` reads in full only the active jobs' and allocations' rows written since the
    last read (an agent's report rewrites an allocation's status; a job ends; another starts),
    and everything again once its first read is PG_HORIZON_MAX_AGE transactions old. Every
    snapshot equals a full read (``_same``)."""
    from hai.db.models import JobAllocation

    for n in ("n0", "n1"):
        api.register_node(n)
    ids = [api.submit(gpus_per_node=8, name=f"r{i}")["id"] for i in range(3)]  # the third waits
    loop = SchedulerLoop(api.platform)
    with leadership(api.platform, stop=threading.Event()) as lease:
        started = _cycle(api, loop, lease).started
    assert len(started) == 2
    cache = scheduling.QueueCache()
    _same(api, cache)
    assert cache.active.rows_read == 4  # the first read: two jobs and their two allocations
    _same(api, cache)
    assert cache.active.rows_read == 0  # nothing written since
    before = {r.id: r for r in _snapshot(api, cache)[0].running}

    a, b = started
    _write(api, lambda s: s.execute(update(JobAllocation).where(JobAllocation.job_id == a).values(
        status={"state": "running", "ranks": 8})))
    _same(api, cache)
    assert cache.active.rows_read == 1  # that allocation alone
    after = {r.id: r for r in _snapshot(api, cache)[0].running}
    assert after[b] is before[b] and after[a] == before[a]

    # one job ends (its row and its allocation), the waiting one takes its place in a cycle
    def end(s):  # noqa: ANN001, ANN202
        from sqlalchemy import select

        from hai.services.reports import release

        transition(s, s.get(Job, a), JobState.SUCCEEDED, reason="done", now=utcnow())
        for alloc in s.scalars(select(JobAllocation).where(JobAllocation.job_id == a)):
            release(alloc, utcnow())
    _write(api, end)
    _same(api, cache)
    assert [r.id for r in _snapshot(api, cache)[0].running] == [b]
    with leadership(api.platform, stop=threading.Event()) as lease:
        assert _cycle(api, loop, lease).started == [ids[2]]
    _same(api, cache)
    assert sorted(r.id for r in _snapshot(api, cache)[0].running) == sorted([b, ids[2]])

    first = cache.active.since
    cache.active.since -= scheduling.PG_HORIZON_MAX_AGE + 1  # as if ~1e9 transactions had run since
    _same(api, cache)
    assert cache.active.rows_read == 4 and cache.active.since >= first  # all read again, from now


def test_a_nodes_view_is_built_again_only_when_its_row_or_its_held_gpus_change(api):
    """``NodeCache``: a heartbeat that keeps a node fresh changes nothing the snapshot uses (the
    same view object); a start (its held GPUs), a drain (its state) and a silence past
    ``lost_after_s`` (its freshness, judged by the database) each build that node's view again,
    and a node's new GPU numbering hands the active side a new numbering. Every snapshot equals
    a full read (``_same``)."""
    from datetime import timedelta

    from hai.db.models import Node

    for n in ("n0", "n1", "n2"):
        api.register_node(n)
    cache = scheduling.QueueCache()

    def views() -> dict[str, object]:
        _same(api, cache)
        return {v.name: v for v in _snapshot(api, cache)[0].nodes}

    first = views()
    _write(api, lambda s: s.execute(update(Node).values(last_heartbeat_at=utcnow())))  # heartbeats
    beat = views()
    assert all(beat[n] is first[n] for n in first)

    job = api.submit(gpus_per_node=4, name="one")["id"]
    loop = SchedulerLoop(api.platform)
    with leadership(api.platform, stop=threading.Event()) as lease:
        assert _cycle(api, loop, lease).started == [job]
    started = views()
    placed = [n for n in first if started[n] is not first[n]]
    assert len(placed) == 1 and len(started[placed[0]].free_gpus) == 4  # that node alone
    other, last = [n for n in first if n not in placed]

    _write(api, lambda s: s.execute(update(Node).where(Node.name == other).values(state="draining")))
    drained = views()
    assert drained[other] is not started[other] and not drained[other].schedulable
    assert drained[last] is started[last] and drained[placed[0]] is started[placed[0]]

    lost_after = api.platform.settings.agent.lost_after_s
    _write(api, lambda s: s.execute(update(Node).where(Node.name == last).values(
        last_heartbeat_at=utcnow() - timedelta(seconds=lost_after + 5))))
    silent = views()
    assert silent[last] is not drained[last] and not silent[last].schedulable

    numbering = cache.nodes.indices
    views()
    assert cache.nodes.indices is numbering  # nothing renumbered: the very numbering
    _write(api, lambda s: s.execute(update(Node).where(Node.name == placed[0]).values(
        gpu_indices=[0, 1, 2, 3, 4, 5, 6, 9])))
    views()
    assert cache.nodes.indices is not numbering and cache.nodes.indices[placed[0]][-1] == 9

    # a node's row gone (raw SQL; nothing in the platform deletes one): its view leaves too
    _write(api, lambda s: s.execute(text("DELETE FROM nodes WHERE name = :n"), {"n": other}))
    assert sorted(views()) == sorted(n for n in first if n != other)
