"""Issue 12: on SQLite the scheduler keeps the queue across cycles and reads only the job rows
changed since the last one (services/scheduling.QueueCache, the marker of migration 0015). The
snapshot it builds must be the snapshot a fresh full read builds, after any sequence of writes:
here submissions, starts, pending reasons and reservations written by cycles, cancels, holds,
resumes, a suspension and the requeue after it, a restart, priority changes, raw SQL and a
deleted row, compared after every step."""

from __future__ import annotations

import threading
from datetime import timedelta

from sqlalchemy import delete, select, text, update

from hai.db.base import utcnow
from hai.db.models import Job
from hai.domain.jobs import JobState
from hai.services import scheduling
from hai.services.jobs import requeue_as_restart, transition
from hai.services.leader import leadership
from hai.services.runner import SchedulerLoop


def _snapshot(api, cache=None):  # noqa: ANN001, ANN202
    """(snapshot, current) as a cycle would read them now: with ``cache``, incrementally."""
    settings = api.platform.settings
    now = utcnow()
    with api.platform.read_sessions() as s:
        queued, _ = scheduling._queued_and_demotable(s)
        out = scheduling._load(s, now=now, lost_after_s=settings.agent.lost_after_s, queue=cache, queued_count=queued)
        s.rollback()
    return out


def _same(api, cache) -> int:  # noqa: ANN001
    """Asserts the incremental read equals a full read; returns the rows it read."""
    full_snap, full_now = _snapshot(api)
    last, full_reads = cache.ordered, cache.full_reads
    last_running, since = cache.active.ordered, cache.active.since
    snap, now = _snapshot(api, cache)
    assert snap.queued == full_snap.queued
    assert now == full_now
    assert snap.running == full_snap.running and snap.nodes == full_snap.nodes
    # the usage's input (each user's GPUs held): on PostgreSQL the active cache's counts, kept as
    # jobs came, changed and went, must be what walking every running job gives
    counted = scheduling.gpus_by_user(snap.running, cache.active)
    assert counted == scheduling.gpus_by_user(full_snap.running)
    if api.platform.engine.dialect.name == "postgresql":
        assert counted is cache.active.gpus_of_user
        _running_delta_true(snap, last_running, since == cache.active.since)
    if last:  # a read that found no row changed hands over the very tuple of the last (KeptQueue.sync: no proof)
        assert (snap.queued is last) == (cache.rows_read == 0 and cache.full_reads == full_reads)
    delta = snap.queue_delta
    if last and snap.queued is not last and cache.full_reads == full_reads:
        # a new tuple after an incremental read: with an account of how it differs from the last
        # one (KeptQueue.sync updates from it without proving the queue); the account must be true
        assert delta is not None and delta.base is last and delta.queued is snap.queued
        changed = {j.id: j for j in delta.changed}
        assert len(changed) == len(delta.changed) and not changed.keys() & set(delta.gone)
        assert len(changed) + len(delta.gone) <= cache.rows_read
        before = {j.id: j for j in last}
        assert {j.id for j in snap.queued} == (before.keys() - set(delta.gone)) | changed.keys()
        for j in snap.queued:  # every other job is the very object it was
            assert j is changed[j.id] if j.id in changed else j is before[j.id]
    elif cache.full_reads != full_reads:
        assert delta is None  # a full read: no account
    return cache.rows_read


def _running_delta_true(snap, last_running, incremental: bool) -> None:  # noqa: ANN001
    """PostgreSQL: a running tuple that is not the last one handed over comes, after an
    incremental read, with a true account of how it differs (``RunningDelta``: the domain keeps
    its quota charges by it without checking); the same tuple, or a first or full read, with none."""
    delta = snap.running_delta
    if last_running is None or not incremental or snap.running is last_running:
        assert delta is None
        return
    assert delta is not None and delta.base is last_running and delta.running is snap.running
    ids = set(map(id, snap.running))
    base = set(map(id, last_running))
    came, left = set(map(id, delta.came)), set(map(id, delta.left))
    assert len(came) == len(delta.came) and len(left) == len(delta.left)
    assert came <= ids and not came & base and left <= base and not left & ids
    assert ids == (base - left) | came  # every other job is the very object it was


def _cycle(api, loop, lease):  # noqa: ANN001, ANN202
    """One cycle of the scheduler loop (with its own cache); it considers exactly the queued
    jobs a full read finds just before it."""
    expected = tuple(q.id for q in _snapshot(api)[0].queued)
    result = loop.cycle_once(lease)
    assert result.considered == expected
    return result


def _write(api, fn) -> None:  # noqa: ANN001
    with api.platform.sessions() as s:
        fn(s)
        s.commit()


def _late_submissions_and_a_deleted_row(api, cache, loop, lease):  # noqa: ANN001, ANN202
    """Three submissions between cycles (read by the cache, considered by the next cycle), then a
    queued row deleted behind the platform's back (nothing in it deletes jobs): the count check
    notices, and the cache reads the whole queue again (SQLite) or the ids still queued
    (PostgreSQL, as for a job cancelled while queued). Returns the cycle's outcome."""
    late = [api.submit(gpus_per_node=1, name=f"late{i}")["id"] for i in range(3)]
    assert _same(api, cache) == 3
    third = _cycle(api, loop, lease)
    assert set(late) <= set(third.considered)
    _same(api, cache)
    reads, departures = cache.full_reads, cache.departures_read
    victim = next(j for j in cache.jobs if j not in late)
    _write(api, lambda s: s.execute(delete(Job).where(Job.id == victim)))
    _same(api, cache)
    assert victim not in cache.jobs
    if api.platform.engine.dialect.name == "postgresql":
        assert (cache.full_reads, cache.departures_read) == (reads, departures + 1)
    else:
        assert cache.full_reads == reads + 1
    return third


def test_the_incremental_queue_equals_a_full_read_after_every_kind_of_write(api):
    api.register_node("n0")
    api.register_node("n1")
    cache = scheduling.QueueCache()
    loop = SchedulerLoop(api.platform)
    jobs = [api.submit(gpus_per_node=g, name=f"j{i}")["id"] for i, g in enumerate([8, 8, 4, 4, 8, 2, 8, 1])]
    jobs += [api.submit(api.bob, gpus_per_node=8, priority=p)["id"] for p in ("HIGH", "LOW", "NORMAL")]
    _same(api, cache)
    assert cache.full_reads == 1 and len(cache.jobs) == len(jobs)
    assert _same(api, cache) == 0  # nothing changed: nothing read

    with leadership(api.platform, stop=threading.Event()) as lease:
        first = _cycle(api, loop, lease)  # starts and pending reasons
        assert first.started and loop.queue.full_reads == 1
        assert _same(api, cache) > 0
        assert set(first.considered) == set(jobs)

        queued = [j for j in jobs if j not in first.started]
        api.post(f"/api/v1/jobs/{queued[0]}/cancel", api.admin).raise_for_status()
        api.post(f"/api/v1/jobs/{queued[1]}/suspend", api.admin).raise_for_status()  # held: leaves the snapshot
        assert _same(api, cache) == 2
        assert queued[0] not in cache.jobs and queued[1] not in cache.jobs
        api.post(f"/api/v1/jobs/{queued[1]}/resume", api.admin).raise_for_status()  # back, reason reset
        assert _same(api, cache) == 1

        # a running job suspended by its owner, then requeued (held) as its agent would report
        running = first.started[0]
        api.post(f"/api/v1/jobs/{running}/suspend", api.admin).raise_for_status()
        _same(api, cache)

        def requeue(s):  # noqa: ANN001
            job = s.get(Job, running)
            job.suspensions += 1
            transition(s, job, JobState.QUEUED, reason="suspended at a checkpoint")
        _write(api, requeue)
        _same(api, cache)
        api.post(f"/api/v1/jobs/{running}/resume", api.admin).raise_for_status()  # queued again, with its past
        _same(api, cache)
        assert running in cache.jobs and cache.jobs[running].suspensions == 1

        # a restart after a lost node: attained service, queued_at, restarts change
        other = first.started[1]

        def restart(s):  # noqa: ANN001
            job = s.get(Job, other)
            requeue_as_restart(s, job, reason="node lost", pending_reason="requeued after node n0 was lost",
                               now=utcnow() + timedelta(seconds=30))
        _write(api, restart)
        _same(api, cache)
        assert cache.jobs[other].attained_gpu_s > 0

        second = _cycle(api, loop, lease)
        _same(api, cache)

        # priority changes and other columns written behind the application's back
        _write(api, lambda s: s.execute(update(Job).where(Job.id == queued[2]).values(priority="VERY_HIGH")))
        _write(api, lambda s: s.execute(text("UPDATE jobs SET reserved_nodes = '[\"n1\"]', allow_cross_zone = 1"
                                             " WHERE id = :i"), {"i": queued[3]}))
        assert _same(api, cache) == 2
        assert cache.jobs[queued[2]].priority.value == "VERY_HIGH"
        assert cache.shows.reserved[queued[3]] == ("n1",)

        # more submissions between cycles, a cycle in between, a queued row deleted
        third = _late_submissions_and_a_deleted_row(api, cache, loop, lease)

        reads = loop.queue.full_reads
        _cycle(api, loop, lease)  # the loop's own cache notices the deletion too
        assert loop.queue.full_reads == reads + 1
        assert second.considered and third.considered


def test_a_cycle_with_the_cache_decides_as_a_cycle_without_it(api):
    """The same database state, one cycle each way: the same starts, suspensions, reservations and
    pending reasons written (two copies of one database file). The cache was warmed by an
    earlier cycle, so this one reads only what changed since."""
    import sqlite3

    for n in ("n0", "n1", "n2"):
        api.register_node(n)
    for i, (g, p) in enumerate([(8, "NORMAL"), (8, "HIGH"), (4, "LOW"), (8, "NORMAL"), (8, "NORMAL"), (4, "HIGH"),
                                (8, "LOW"), (2, "NORMAL"), (8, "VERY_HIGH")]):
        api.submit(api.alice if i % 2 else api.bob, gpus_per_node=g, priority=p, name=f"j{i}")
    loop = SchedulerLoop(api.platform)
    # every changed reason written at once, as a cycle without the cache writes them (the cache
    # also remembers when it wrote each reason, and a change of numbers alone waits for the job's
    # refresh moment: tests/api/test_pending_reason_refresh.py)
    settings = api.platform.settings.model_copy(deep=True)
    settings.scheduler.pending_reason_refresh_s = 0
    with leadership(api.platform, stop=threading.Event()) as lease:
        loop.cycle_once(lease)  # starts; the rows it wrote are marked changed
        loop.cycle_once(lease)  # reads them again: the cache is settled
        api.register_node("n3")  # room for more
        api.submit(gpus_per_node=8, name="after")
        db = api.platform.engine.url.database
        src, dst = sqlite3.connect(db), sqlite3.connect(db + ".copy")  # a consistent copy (the backup API)
        src.backup(dst)
        src.close()
        dst.close()
        now = utcnow()

        def written(session_factory, queue):  # noqa: ANN001, ANN202
            with session_factory() as w, api.platform.read_sessions() as r:
                if queue is not None:
                    res = scheduling.run_cycle(w, settings=settings, now=now, read_session=r, queue=queue, lease=lease)
                else:
                    res = scheduling.run_cycle(w, settings=settings, now=now, lease=lease)
            return res

        reads, accounts = loop.queue.full_reads, loop.queue.kept.accounts
        with_cache = written(api.platform.sessions, loop.queue)
        assert loop.queue.full_reads == reads and 0 < loop.queue.rows_read < len(with_cache.considered)
        # the kept queue order was updated from the rows read (the account), not proved job by job
        assert loop.queue.kept.accounts == accounts + 1
        with api.platform.sessions() as s:
            after_cache = [tuple(r) for r in s.execute(
                select(Job.id, Job.state, Job.pending_reason, Job.reserved_nodes).order_by(Job.id))]
    # the same cycle over the copy, reading everything
    from hai.db.session import make_engine, make_session_factory
    engine = make_engine(f"sqlite:///{db}.copy")
    try:
        sessions = make_session_factory(engine)
        with sessions() as w:
            without = scheduling.run_cycle(w, settings=settings, now=now)
        with sessions() as s:
            after_full = [tuple(r) for r in s.execute(
                select(Job.id, Job.state, Job.pending_reason, Job.reserved_nodes).order_by(Job.id))]
    finally:
        engine.dispose()
    assert (with_cache.started, with_cache.suspended, sorted(with_cache.considered)) == (
        without.started, without.suspended, sorted(without.considered))
    assert with_cache.started or with_cache.suspended  # a cycle that decides something
    assert after_cache == after_full


def test_a_running_job_is_built_again_only_when_its_row_its_allocations_or_the_numbering_change(api):
    """The cache also keeps each active job's RunningJob with the row and the active allocations
    it was built from: an unchanged job is the very object of the last read, a changed one is
    built again, and every read equals a full read (``_same``)."""
    from hai.db.models import JobAllocation, Node

    for n in ("n0", "n1"):
        api.register_node(n)
    ids = [api.submit(gpus_per_node=g, name=f"r{i}")["id"] for i, g in enumerate([8, 4, 4])]
    loop = SchedulerLoop(api.platform)
    with leadership(api.platform, stop=threading.Event()) as lease:
        assert sorted(_cycle(api, loop, lease).started) == sorted(ids)
    cache = scheduling.QueueCache()

    def objects() -> dict[int, object]:
        _same(api, cache)
        return {r.id: r for r in _snapshot(api, cache)[0].running}

    first = objects()
    assert sorted(first) == sorted(ids)
    again = objects()
    assert all(again[i] is first[i] for i in ids)  # nothing changed: nothing built

    a, b, c = ids
    # a checkpoint reported for one job: its row changed, only it is built again
    _write(api, lambda s: s.execute(update(Job).where(Job.id == a).values(
        last_checkpoint={"at": utcnow().timestamp(), "duration_s": 2.0})))
    got = objects()
    assert got[a] is not again[a] and got[a].last_checkpoint_at is not None
    assert got[b] is again[b] and got[c] is again[c]

    # an allocation released behind the job's row: the job's allocations changed, only it is built again
    _write(api, lambda s: s.execute(update(JobAllocation).where(JobAllocation.job_id == b).values(active=False)))
    after = objects()
    assert after[b] is not got[b] and after[b].allocations == ()
    assert after[a] is got[a] and after[c] is got[c]

    # a node's GPUs numbered anew: every job is built again with positions by the new numbering
    _write(api, lambda s: s.execute(update(Node).where(Node.name == after[c].allocations[0].node)
                                    .values(gpu_indices=[0, 1, 2, 3, 4, 5, 6, 9])))
    renumbered = objects()
    assert all(renumbered[i] is not after[i] for i in ids)
