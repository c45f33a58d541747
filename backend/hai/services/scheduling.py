"""One scheduling cycle: load a snapshot in one read, call the pure scheduler, persist all of
its decisions in one transaction. The notifications go out after the commit (agents' long polls
wake up and receive their new assignments)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from bisect import bisect_left
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from operator import attrgetter
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Integer, Row, Text, and_, any_, bindparam, case, cast, func, literal_column, select, text, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from hai.db.base import Unlikely, utcnow
from hai.db.models import GpuHold, Job, JobAllocation, JobChangeCounter, Node, Quota, UserUsage
from hai.domain import scheduler as sched
from hai.domain.jobs import ACTIVE_STATES, JobState, Priority
from hai.domain.nodes import SCHEDULABLE_STATES
from hai.domain.scheduler.victims import DEMOTED
from hai.services import faults, notify, queued_counts
from hai.services.jobs import SCHEDULER_EPOCH, publish_after_commit, record_event, transition
from hai.settings import Settings, get_settings

if TYPE_CHECKING:
    from hai.services.leader import Lease

log = logging.getLogger(__name__)

SCHEDULABLE_NODE_STATES = frozenset(s.value for s in SCHEDULABLE_STATES)


def policy_from_settings(settings: Settings | None = None) -> sched.Policy:
    """The scheduling policy of ``settings`` (default: ``get_settings()``): HAI_SCHEDULER__*.
    The one place the server, ``hai scheduler`` and ``hai sim`` get their policy from."""
    return (settings if settings is not None else get_settings()).scheduler.policy()


@dataclass
class CycleResult:
    started: list[int]
    suspended: list[int]
    snapshot_jobs: int
    at: datetime | None = None  # the cycle's ``now`` (its snapshot's instant)
    considered: tuple[int, ...] = ()  # the queued jobs it considered


def _ts(dt: datetime | None) -> float | None:
    return dt.timestamp() if dt is not None else None


def gpu_indices(node: Node | Row) -> list[int]:
    """The node's GPU indices as its agent numbers them (an agent may own GPUs 4-7 of a host).
    The domain counts a node's GPUs by position 0..gpus-1; the service translates both ways.
    ``Node.gpu_indices`` is NULL for the common 0..gpus-1 (registration writes it)."""
    indices = node.gpu_indices
    return sorted(indices) if indices is not None and len(indices) == node.gpus else list(range(node.gpus))


def _numbering(gpus: int, listed: list[int] | None, plain: dict[int, list[int]]) -> list[int]:
    """``gpu_indices`` of a node's GPU count and listed indices; the common 0..gpus-1 is one list
    per GPU count from ``plain``, shared and read only."""
    if listed is not None and len(listed) == gpus:
        return sorted(listed)
    return plain.get(gpus) or plain.setdefault(gpus, list(range(gpus)))


def _positions(indices: list[int], held: set[int] | list[int]) -> tuple[int, ...]:
    if indices and indices[-1] == len(indices) - 1:  # sorted, so 0..n-1: positions are the indices
        got = sorted(held)
        if not got or (got[0] >= 0 and got[-1] < len(indices)):  # (all of them on the node: the rule)
            return tuple(got)
        return tuple(g for g in got if 0 <= g < len(indices))
    where = {idx: pos for pos, idx in enumerate(indices)}
    return tuple(sorted(where[g] for g in held if g in where))


def _free(indices: list[int], held: set[int] | None) -> tuple[int, ...]:
    """The positions of the node's GPUs that no active allocation holds."""
    if not held:
        return tuple(range(len(indices)))
    return tuple(pos for pos, g in enumerate(indices) if g not in held)


# the columns of a job the snapshot needs (issue 12: a cycle reads rows, not ORM objects with
# their events and allocations; at 10,000 queued jobs that load was most of the cycle)
_JOB_COLUMNS = (
    Job.id, Job.user_name, Job.group, Job.priority, Job.submitted_priority, Job.nodes, Job.gpus_per_node,
    Job.created_at, Job.allow_cross_zone, Job.state, Job.user_suspended, Job.queued_at, Job.suspensions,
    # the two JSON documents as their text: decoded only when not empty, and the checkpoint only
    # for an active job (issue 12: with 10,000 queued jobs, decoding "[]" and null for each was a
    # quarter of a cycle's CPU)
    cast(Job.reserved_nodes, Text).label("reserved_json"), cast(Job.last_checkpoint, Text).label("checkpoint_json"),
    Job.attempt_started_at, Job.suspend_for_job_id, Job.attempt, Job.pending_reason, Job.run_s,
)
_EMPTY_JSON = (None, "[]", "{}", "null")
_PRIORITIES = {p.value: p for p in Priority}  # a dict look-up; Priority(value) is slow in a loop of 10,000


def _json(text: str | None, empty):  # noqa: ANN001, ANN202
    return empty if text in _EMPTY_JSON else (json.loads(text) or empty)


@dataclass
class Shown:
    """What the snapshot's queued jobs show now, so that apply_decisions writes only what
    changes: each one's pending reason, and the reservation of each that holds one. Kept by
    QueueCache across cycles (updated from the rows read), so that a cycle compares the domain's
    reasons with plain strings and the reservations over the reserved jobs alone (issue 12: a
    cycle's cost should follow what changed)."""

    reasons: dict[int, str | None] = field(default_factory=dict)
    reserved: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # when this process last wrote each job's pending reason (the cycle's ``now``, in seconds):
    # a change of its numbers alone waits for the job's next refresh moment (``_throttled``)
    written_at: dict[int, float] = field(default_factory=dict)

    def set(self, job_id: int, reason: str | None, reserved_nodes: tuple[str, ...]) -> None:
        self.reasons[job_id] = reason
        if reserved_nodes:
            self.reserved[job_id] = reserved_nodes
        else:
            self.reserved.pop(job_id, None)

    def drop(self, job_id: int) -> None:
        self.reasons.pop(job_id, None)
        self.reserved.pop(job_id, None)
        self.written_at.pop(job_id, None)

    def clear(self) -> None:
        self.reasons.clear()
        self.reserved.clear()
        self.written_at.clear()


def load_snapshot(session: Session, *, now: datetime, lost_after_s: float) -> sched.Snapshot:
    return _load(session, now=now, lost_after_s=lost_after_s)[0]


_ACTIVE_VALUES = tuple(s.value for s in ACTIVE_STATES)
# the active jobs, few beside the queue and the history: SQLite's planner told so (``Unlikely``;
# tests/api/test_sqlite_cycle_plans.py)
_ACTIVE_JOBS = Unlikely(Job.state.in_(_ACTIVE_VALUES))
# (id, row version) of every active job and allocation: two integers a row, read through the
# driver's own cursor (20,000 rows in ~5 ms of CPU, against ~55 ms for the allocations' full rows)
_ACTIVE_JOB_VERSIONS = "SELECT id, xmin::text::bigint FROM jobs WHERE state = ANY(%s)"
_ALLOC_VERSIONS = "SELECT id, xmin::text::bigint FROM job_allocations WHERE active"
_ALLOC_COLUMNS = (JobAllocation.id, literal_column("job_allocations.xmin::text::bigint").label("version"),
                  JobAllocation.job_id, JobAllocation.attempt, JobAllocation.node_rank, JobAllocation.node_name,
                  JobAllocation.gpus)


def _any_id(ids: list[int]):  # noqa: ANN202
    """``= ANY(array)``: one parameter however many ids (an IN list binds one each, and the
    driver takes at most 65,535: a first read of more active rows than that would fail)."""
    return any_(bindparam("ids", ids, type_=ARRAY(Integer)))


def _versions_changed(kept: dict[int, tuple], versions: dict[int, int], at: int) -> tuple[list[int], list[int]]:
    """The ids of ``versions`` (id -> row version as read now) whose version differs from the one
    at index ``at`` of their ``kept`` entry, or that are new; and the kept ids no longer listed
    (looked for only when the counts say some are gone)."""
    changed = [i for i, v in versions.items() if (k := kept.get(i)) is None or k[at] != v]
    if len(kept) + sum(i not in kept for i in changed) == len(versions):
        return changed, []
    return changed, [i for i in kept if i not in versions]


class ActiveCache:
    """PostgreSQL: every active job's row and active allocation of the last cycle, each with the
    version it was read at (its ``xmin``), and each active job's RunningJob (issue 12: at 10,000
    nodes and 20,000 running jobs, reading every active job's row and allocation again each
    cycle was ~55% of the scheduler's read, benchmarks/sqlite_cycle.py).

    A cycle reads the (id, xmin) of every active job and allocation, two integers a row, and
    reads in full only the rows whose version differs from the one kept, or that are new; an
    id no longer listed left the active set. A row version's ``xmin`` is the transaction that
    wrote it: two versions of a row with the same xmin were written by one transaction, and
    only its last one is ever seen after it committed; a version frozen by VACUUM may show
    another xmin: read again, harmless. So the kept rows are those of this cycle's reads, with
    no horizon to reason about (the 32-bit xmin repeats after 2**32 transactions: past
    PG_HORIZON_MAX_AGE since the first read everything is read again). A job whose row or
    allocations changed gets its RunningJob built again; so does one whose attempt has no start
    yet (it counts from ``now``), and every job when a node's GPU numbering changed.
    ``tests/integration/test_queue_cache_pg.py`` compares the snapshot with a full read."""

    def __init__(self) -> None:
        self.jobs: dict[int, tuple[int, Row]] = {}  # id -> (version, row)
        self.allocs: dict[int, tuple] = {}  # id -> the row (id, version, job_id, attempt, node_rank, node_name, gpus)
        self.of_job: dict[int, dict[int, tuple[int, int, str, list[int]]]] = {}  # job -> alloc id -> (attempt, rank, node, gpus)
        self.held: dict[str, set[int]] = {}  # node -> the GPU indices its active allocations hold
        self.held_changed: set[str] = set()  # the nodes whose ``held`` changed in the last refresh
        self.built: dict[int, sched.RunningJob] = {}
        # over ``built``: each user's GPUs and jobs (``gpus_by_user``: the usage's input)
        self.gpus_of_user: dict[str, int] = {}
        self.jobs_of_user: dict[str, int] = {}
        self.unstarted: set[int] = set()  # the active jobs whose attempt has no start yet
        self.ordered: tuple[sched.RunningJob, ...] | None = None  # ``built`` by id; None after a change
        # how ``ordered`` differs from the tuple the refresh before handed over (the domain keeps
        # its quota charges by it: ``quota.KeptCharges``); None when it is that very tuple, or
        # after a first or full read. The jobs built (``_came``) and dropped (``_left``) since
        self.delta: sched.RunningDelta | None = None
        self._came: list[sched.RunningJob] = []
        self._left: list[sched.RunningJob] = []
        self.indices: dict[str, list[int]] | None = None  # the nodes' GPU numbering ``built`` used
        self.since: int | None = None  # the transaction id of the first read
        self.rows_read = 0  # job and allocation rows read in full by the last cycle

    def refresh(self, conn: Connection, indices: dict[str, list[int]], now: datetime) -> tuple[sched.RunningJob, ...]:
        """The active jobs as of now (sorted by id); ``held`` the GPUs held on each node."""
        cur = conn.connection.driver_connection.cursor()
        cur.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
        next_xid = cur.fetchone()[0]
        held_changed: set[str] = set()
        handed = self.ordered  # the tuple handed over last (None: not known)
        if self.since is None or next_xid - self.since > PG_HORIZON_MAX_AGE:
            held_changed = set(self.held)  # (their views held GPUs that are read again now)
            self.__init__()
            self.since = next_xid
            handed = None
        self.held_changed = held_changed
        self._came, self._left = [], []
        dirty: set[int] = set()
        self.rows_read = 0
        # the allocations first: a removed one's GPUs leave ``held`` before a new one's come in
        cur.execute(_ALLOC_VERSIONS)
        versions = dict(cur.fetchall())
        allocs = self.allocs
        changed, gone = _versions_changed(allocs, versions, 1)
        for i in gone:
            self._drop_alloc(i, dirty)
        if changed:
            for i in changed:
                if i in allocs:
                    self._drop_alloc(i, dirty)
            for a in conn.execute(select(*_ALLOC_COLUMNS).where(JobAllocation.id == _any_id(changed), JobAllocation.active)):
                self._add_alloc(a, dirty)
            self.rows_read += len(changed)
        cur.execute(_ACTIVE_JOB_VERSIONS, (list(_ACTIVE_VALUES),))
        versions = dict(cur.fetchall())
        cur.close()
        jobs, built = self.jobs, self.built
        changed, gone = _versions_changed(jobs, versions, 0)
        unstarted = self.unstarted
        for i in gone:
            self._drop_job(i)
        if changed:
            for i in changed:
                self._drop_job(i)
            for j in conn.execute(select(literal_column("jobs.xmin::text::bigint").label("version"), *_JOB_COLUMNS)
                                  .where(Job.id == _any_id(changed), Job.state.in_(_ACTIVE_VALUES))):
                jobs[j.id] = (j.version, j)
                if j.attempt_started_at is None:
                    unstarted.add(j.id)
            dirty.update(changed)
            self.rows_read += len(changed)
        if indices is not self.indices and indices != self.indices:
            self.indices = indices
            dirty = set(jobs)
        for i in dirty | unstarted:  # (a job whose attempt has no start yet counts from ``now``)
            got = jobs.get(i)
            if got is not None:
                mine = self.of_job.get(i)
                allocs = [(attempt, node, gpus) for attempt, _rank, node, gpus in sorted(mine.values())] if mine else ()
                old = built.get(i)
                if old is not None:
                    self._uncount(old)
                    self._left.append(old)
                built[i] = r = _running(got[1], allocs, indices, now)
                self._came.append(r)
                self._count(r)
                self.ordered = None
        self.delta = None
        if self.ordered is None:
            self.ordered = tuple(built[i] for i in sorted(built))
            if handed is not None:
                self.delta = sched.RunningDelta(handed, self.ordered, tuple(self._came), tuple(self._left))
        return self.ordered

    def _drop_job(self, i: int) -> None:
        if self.jobs.pop(i, None) is not None:
            self.unstarted.discard(i)
            old = self.built.pop(i)
            self._uncount(old)
            self._left.append(old)
            self.ordered = None

    def _count(self, r: sched.RunningJob) -> None:
        u = r.user
        self.gpus_of_user[u] = self.gpus_of_user.get(u, 0) + r.gpu_count
        self.jobs_of_user[u] = self.jobs_of_user.get(u, 0) + 1

    def _uncount(self, r: sched.RunningJob) -> None:
        u = r.user
        left = self.jobs_of_user[u] - 1
        if left:
            self.jobs_of_user[u] = left
            self.gpus_of_user[u] -= r.gpu_count
        else:
            del self.jobs_of_user[u], self.gpus_of_user[u]

    def _drop_alloc(self, i: int, dirty: set[int]) -> None:
        _, _, job_id, _, _, node, gpus = self.allocs.pop(i)
        self.held[node].difference_update(gpus)
        self.held_changed.add(node)
        mine = self.of_job[job_id]
        del mine[i]
        if not mine:
            del self.of_job[job_id]
        dirty.add(job_id)

    def _add_alloc(self, a: Row, dirty: set[int]) -> None:
        self.allocs[a.id] = tuple(a)
        self.held.setdefault(a.node_name, set()).update(a.gpus)
        self.held_changed.add(a.node_name)
        self.of_job.setdefault(a.job_id, {})[a.id] = (a.attempt, a.node_rank, a.node_name, a.gpus)
        dirty.add(a.job_id)


# what the snapshot uses of a node, its schedulable flag computed by the database (the heartbeat's
# time itself changes every second: a row of these columns stays the same while the node does)
_NODE_ROWS = ("SELECT name, zone, leaf, gpus, gpu_indices,"
              " coalesce(state = ANY(%s) AND last_heartbeat_at >= %s, false) FROM nodes ORDER BY name")


class NodeCache:
    """PostgreSQL: each node's view of the last cycle (issue 12: at 10,000 nodes, building every
    NodeView from every node's row again was ~85% of a steady cycle's read once the active side
    was kept, benchmarks/sqlite_cycle.py). A cycle reads what the snapshot uses of each node as
    a plain row, with its schedulable flag (state and heartbeat's freshness) computed by the
    database, and builds again only the views of the nodes whose row changed or whose held GPUs
    changed (``ActiveCache.held_changed``); the GPU numbering is a new dict only when a node's
    changed, so that ActiveCache sees it unchanged without comparing it."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple] = {}
        self.views: dict[str, sched.NodeView] = {}
        self.indices: dict[str, list[int]] = {}
        self.ordered: tuple[sched.NodeView, ...] = ()
        self._plain: dict[int, list[int]] = {}  # one 0..gpus-1 list per GPU count, read only
        self._order: list[str] = []  # the nodes' names in the database's order

    def read(self, conn: Connection, fresh_after: datetime) -> tuple[set[str], dict[str, list[int]]]:
        """The nodes' rows as of now: the names whose row changed (or is new, or gone), and the
        numbering."""
        with conn.connection.driver_connection.cursor() as cur:
            cur.execute(_NODE_ROWS, (sorted(SCHEDULABLE_NODE_STATES), fresh_after))
            rows = cur.fetchall()
        last, changed = self.rows, set()
        if len(rows) != len(last) or any(last.get(r[0]) != r for r in rows):
            self.rows = {r[0]: r for r in rows}
            changed = {r[0] for r in rows if last.get(r[0]) != r} | (last.keys() - self.rows.keys())
            renumbered = len(rows) != len(last) or any(last[n][3:5] != self.rows[n][3:5] for n in changed if n in last)
            if renumbered:
                self.indices = {name: _numbering(gpus, ix, self._plain) for name, _z, _l, gpus, ix, _s in rows}
            self._order = [r[0] for r in rows]
        return changed, self.indices

    def views_of(self, changed: set[str], held: dict[str, set[int]]) -> tuple[sched.NodeView, ...]:
        """Every node's view, those of ``changed`` built again (or dropped: a node gone)."""
        if changed:
            views, rows, indices = self.views, self.rows, self.indices
            for name in changed:
                row = rows.get(name)
                if row is None:
                    views.pop(name, None)
                    continue
                _, zone, leaf, gpus, _ix, schedulable = row
                views[name] = sched.NodeView(name=name, zone=zone, leaf=leaf, gpus=gpus,
                                             free_gpus=_free(indices[name], held.get(name)),
                                             schedulable=schedulable)
            self.ordered = tuple(views[n] for n in self._order)
        return self.ordered


class QueueCache:
    """The queue of the last cycle, kept across cycles by the scheduler process (issue 12).

    A cycle read every queued job's row and built its QueuedJob (at 10,000 queued ~0.25 s of CPU
    a cycle, in the process that also serves the API); what a queued job is for the scheduler
    depends only on its row, so the next cycle reads only the rows changed since:
    ``Job.change_seq > mark``, where ``mark`` is ``job_change_counter.seq`` as the last read
    saw it. The database's triggers give every insert and update of a job row the next marker,
    under SQLite's one write lock, so a read that saw the counter at ``m`` saw every change
    marked ``<= m``: the changed rows are exactly those marked ``> m``. A changed job that is no
    longer queued (or is held) leaves the cache. The read then checks the cache's size against
    the database's count of queued jobs (one aggregate the cycle makes anyway, in the same read
    transaction); on a mismatch (a row deleted, a counter reset) it reads the whole queue again.
    ``tests/api/test_queue_cache.py`` compares the snapshot with a fresh full load after
    submissions, starts, cancels, holds, resumes, suspensions, requeues and priority changes.

    PostgreSQL (``_refresh_pg``; a counter row would serialise every job write) uses what it
    records already: each row version's ``xmin``, the transaction that wrote it. ``mark`` is
    the horizon of the last read, ``pg_snapshot_xmin`` of that read's own snapshot (every
    transaction older had ended: its rows were seen, or it aborted); the next read takes the
    queued and active rows whose xmin is not older, through the state index (not the finished
    ones: the table keeps every job ever run, and a scan of it all cost PostgreSQL 194 ms a
    cycle with 1,000,000 of them). A job that left the queue for a terminal state (or whose row
    was deleted) is not read: the cache is then larger than the count of queued jobs, and the
    ids still queued (the state index again) say which to drop. A transaction open across the
    read and committed after it is not older (a sequence number, or the newest id seen, misses it:
    ``tests/integration/test_queue_cache_pg.py``). A savepoint's rows carry its subtransaction's
    id, which is larger than its parent's; a HOT update writes a new row version with its own
    xmin like any update; a row lock (``FOR UPDATE``) sets xmax only and changes nothing the
    cycle reads; freezing keeps (or hides as 2) an xmin older than any horizon. The 32-bit xmin
    is compared modulo 2**32, exact while the horizon is under 2**31 transactions old: past
    PG_HORIZON_MAX_AGE, any error, or a cache smaller than the count, the whole queue is read again."""

    def __init__(self) -> None:
        self.mark: int | None = None  # None: the next read is a full one
        self.jobs: dict[int, sched.QueuedJob] = {}
        self.shows = Shown()  # (handed to apply_decisions as ``current``: read only)
        self.full_reads = 0
        self.departures_read = 0  # PostgreSQL: reads of the queued ids, after jobs left for a terminal state
        self.rows_read = 0  # rows of queued (or formerly queued) jobs read by the last cycle
        # ``jobs`` ordered by id as the snapshot holds them; None after any row read: a cycle that
        # read none hands the domain the very tuple of the last one (``KeptQueue.sync`` then has
        # nothing to prove, and the cycle sorts nothing)
        self.ordered: tuple[sched.QueuedJob, ...] | None = None
        # how ``ordered`` differs from the tuple handed over before it (``sched.QueueDelta``: the
        # jobs of the rows read since, in the queue or gone), so that the kept queue updates its
        # order from them instead of proving the whole queue; None after a full read
        self.delta: sched.QueueDelta | None = None
        self._base: tuple[sched.QueuedJob, ...] | None = None  # the tuple handed over before the rows read
        self._touched: set[int] | None = None  # ids of the rows read since ``_base``; None: unknown
        self._ids: list[int] | None = None  # the ids of the tuple handed over last, in its order
        # the queue in the cycle's order, kept across cycles by the domain (issue 12): it follows
        # the jobs objects above (an unchanged row keeps its object), whatever reset() does
        self.kept = sched.KeptQueue()
        # SQLite: each active job's RunningJob with what it was built from (its row, its active
        # allocations), and the nodes' GPU numbering it was built with: a cycle builds again
        # only the jobs whose row or allocations changed (``_running``). Kept by what they were
        # built from, not by a marker, so reset() leaves them: they are never stale
        self.running: dict[int, tuple[tuple, sched.RunningJob]] = {}
        self.node_indices: dict[str, list[int]] = {}
        # PostgreSQL keeps the active side by each row's version instead (``ActiveCache``), and
        # the nodes' views while their rows and held GPUs are unchanged (``NodeCache``)
        self.active = ActiveCache()
        self.nodes = NodeCache()

    def reset(self) -> None:
        self.mark = None
        self.jobs = {}
        self.shows = Shown()
        self.ordered = None
        self._base = self._touched = self._ids = None

    def _read(self, ids: list[int], full: bool) -> None:
        """The rows of ``ids`` were read (``full``: the whole queue): the next tuple is a new one,
        differing from the last one handed over in those jobs only unless the read was full."""
        if full:
            self.ordered = self._base = self._touched = self._ids = None
            return
        if not ids:
            return
        if self.ordered is not None:  # the first rows read since a tuple was handed over
            self._base, self._touched = self.ordered, set(ids)
            self.ordered = None
        elif self._touched is not None:
            self._touched.update(ids)

    def queued(self) -> tuple[sched.QueuedJob, ...]:
        """The cached queue ordered by id: the same tuple as last time while no row was read;
        else a new one, with ``delta`` saying how it differs from the last (when known)."""
        if self.ordered is None:
            jobs = self.jobs
            touched, base, ids = self._touched, self._base, self._ids
            if touched is not None and base is not None and ids is not None and len(touched) * 8 < len(base):
                # few rows read since: the last tuple with those jobs taken out and put in (a
                # sort of every job was ~1 ms a cycle at 10,000 queued)
                self.ordered, self._ids = _merged(base, ids, touched, jobs)
            else:
                self.ordered = tuple(sorted(jobs.values(), key=_by_id))
                self._ids = list(map(_by_id, self.ordered))
            self.delta = None if touched is None or base is None else sched.QueueDelta(
                base, self.ordered, tuple(jobs[i] for i in touched if i in jobs),
                tuple(i for i in touched if i not in jobs))
            self._base = self._touched = None
        return self.ordered


# the columns of a node the snapshot needs: not its GPU inventory and metrics, NICs and labels
# (JSON documents that a cycle decoded for every node of the cluster, twice; issue 14's profile)
_NODE_COLUMNS = (Node.name, Node.zone, Node.leaf, Node.gpus, Node.gpu_indices, Node.state, Node.last_heartbeat_at)


def _load(
    session: Session, *, now: datetime, lost_after_s: float, queue: QueueCache | None = None,
    queued_count: int | None = None,
) -> tuple[sched.Snapshot, Shown]:
    """The snapshot and each queued job's pending reason and reservation. ``queue`` (on SQLite
    with ``queued_count``: the number of queued jobs not held, read in the same transaction;
    on PostgreSQL the count is read in the queue's own statement):
    the queued jobs come from the cache, refreshed with the rows changed since its last read."""
    # plain column reads go through the connection (Core rows): the ORM's loading of column rows
    # cost ~15% of this read at 10,000 nodes and 20,000 running jobs (benchmarks/sqlite_cycle.py)
    conn = session.connection()
    pg = queue is not None and session.get_bind().dialect.name == "postgresql"
    fresh_after = now - timedelta(seconds=lost_after_s)
    active_allocs: dict[int, list[tuple[int, str, list[int]]]] = {}
    if pg:  # the nodes' views and the active side kept across cycles, their changed rows read
        changed_nodes, indices = queue.nodes.read(conn, fresh_after)
        kept_running = queue.active.refresh(conn, indices, now)
        changed_nodes |= queue.active.held_changed
        node_views = queue.nodes.views_of(changed_nodes, queue.active.held)
    else:
        nodes = conn.execute(select(*_NODE_COLUMNS).order_by(Node.name)).all()
        plain: dict[int, list[int]] = {}
        indices = {n.name: _numbering(n.gpus, n.gpu_indices, plain) for n in nodes}
        held: dict[str, set[int]] = {}
        for job_id, attempt, node_name, gpus in conn.execute(
            select(JobAllocation.job_id, JobAllocation.attempt, JobAllocation.node_name, JobAllocation.gpus)
            .where(JobAllocation.active)
            .order_by(JobAllocation.job_id, JobAllocation.attempt, JobAllocation.node_rank)
        ):
            got = held.get(node_name)
            if got is None:
                held[node_name] = set(gpus)
            else:
                got.update(gpus)
            got = active_allocs.get(job_id)
            if got is None:
                active_allocs[job_id] = [(attempt, node_name, gpus)]
            else:
                got.append((attempt, node_name, gpus))
        node_views = tuple(
            sched.NodeView(
                name=n.name,
                zone=n.zone,
                leaf=n.leaf,
                gpus=n.gpus,
                free_gpus=_free(indices[n.name], held.get(n.name)),
                schedulable=n.state in SCHEDULABLE_NODE_STATES
                and n.last_heartbeat_at is not None
                and n.last_heartbeat_at >= fresh_after,
            )
            for n in nodes
        )
    mark = None
    if queue is not None and not pg:
        mark = session.scalar(select(JobChangeCounter.seq).where(JobChangeCounter.id == 1))
        if mark is None:  # no counter (not migrated): no markers either
            queue = None
    if pg:
        rows = ()  # (the active jobs came with ActiveCache, the queued ones come with _refresh_pg)
    elif queue is None:
        rows = conn.execute(
            select(*_JOB_COLUMNS).where(Job.state.in_([s.value for s in ACTIVE_STATES] + [JobState.QUEUED.value]))
        )
    else:
        rows = conn.execute(select(*_JOB_COLUMNS).where(_ACTIVE_JOBS))
    running: list[sched.RunningJob] = []
    queued: list[sched.QueuedJob] = []
    current = Shown()
    built: dict[int, tuple[tuple, sched.RunningJob]] = {}
    last: dict[int, tuple[tuple, sched.RunningJob]] = {}
    if queue is not None and not pg:
        if queue.node_indices != indices:  # a node's GPU numbering changed (or the first cycle)
            queue.running = {}
        last, queue.node_indices = queue.running, indices
    for j in rows:
        if j.state == JobState.QUEUED.value:
            if not j.user_suspended:
                q = _queued(j)
                queued.append(q)
                current.set(j.id, j.pending_reason, q.reserved_nodes)
            continue
        allocs = active_allocs.get(j.id, ())
        # (a job with no attempt start yet counts from ``now``: built again every cycle)
        key = (j, allocs) if j.attempt_started_at is not None else None
        got = last.get(j.id)
        if got is not None and key is not None and got[0] == key:
            r = got[1]
        else:
            r = _running(j, allocs, indices, now)
        if key is not None:
            built[j.id] = (key, r)
        running.append(r)
    if queue is not None and not pg:
        queue.running = built
    if pg:
        current = _refresh_pg(session, queue)
    elif queue is not None:
        current = _refresh(session, queue, mark, queued_count)
    quotas = tuple(
        sched.Quota(group=q.group, priority=Priority(q.priority), gpus=q.gpus, user=q.user_name)
        for q in session.scalars(select(Quota).order_by(Quota.id))
    )
    usage = {u.user_name: u.gpu_s for u in session.scalars(select(UserUsage))}
    snapshot = sched.Snapshot(
        nodes=node_views,
        running=kept_running if pg else tuple(sorted(running, key=lambda r: r.id)),
        queued=queue.queued() if queue is not None else tuple(sorted(queued, key=_by_id)),
        quotas=quotas,
        usage=usage,
        queue_delta=queue.delta if queue is not None else None,
        running_delta=queue.active.delta if pg else None,
    )
    return snapshot, current


_by_id = attrgetter("id")  # (a job's id: the queue's order)


def _merged(base: tuple[sched.QueuedJob, ...], ids: list[int], touched: set[int],
            jobs: dict[int, sched.QueuedJob]) -> tuple[tuple[sched.QueuedJob, ...], list[int]]:
    """``base`` (ordered by id, ``ids`` its ids) with each job of ``touched`` as ``jobs`` holds
    it now: replaced, taken out (no longer in ``jobs``) or put in at its place; every other job
    of ``base`` as it is. The new tuple and its ids."""
    out: list[sched.QueuedJob] = []
    out_ids: list[int] = []
    prev = 0
    for i in sorted(touched):
        pos = bisect_left(ids, i, prev)
        out += base[prev:pos]
        out_ids += ids[prev:pos]
        prev = pos + 1 if pos < len(ids) and ids[pos] == i else pos  # (the job's old entry left out)
        job = jobs.get(i)
        if job is not None:
            out.append(job)
            out_ids.append(i)
    out += base[prev:]
    out_ids += ids[prev:]
    return tuple(out), out_ids


def _common(j: Row) -> dict:
    """The fields a queued and a running job share, from its row."""
    return dict(
        id=j.id,
        user=j.user_name,
        group=j.group,
        priority=_PRIORITIES[j.priority],
        submitted_priority=_PRIORITIES[j.submitted_priority],
        nodes=j.nodes,
        gpus_per_node=j.gpus_per_node,
        first_submitted_at=j.created_at.timestamp(),
        allow_cross_zone=j.allow_cross_zone,
        # attained service (least attained service, Policy.service_classes_gpu_s): the
        # GPU-seconds of its finished attempts; a running job's current attempt is added by
        # the policy from started_at, as in the simulator
        attained_gpu_s=(j.run_s or 0.0) * j.nodes * j.gpus_per_node,
    )


def _queued(j: Row) -> sched.QueuedJob:
    """A queued job of the snapshot from its row alone (no ``now``, nothing of another row: what
    QueueCache relies on)."""
    return sched.QueuedJob(
        **_common(j), queued_at=j.queued_at.timestamp(), suspensions=j.suspensions,
        reserved_nodes=tuple(_json(j.reserved_json, ())),
    )


def _running(j: Row, allocs: list[tuple[int, str, list[int]]] | tuple, indices: dict[str, list[int]],
             now: datetime) -> sched.RunningJob:
    """An active job of the snapshot from its row, its active allocations (attempt, node, GPU
    indices) and the nodes' GPU numbering; ``now`` only for a job whose attempt has no start."""
    ckpt = _json(j.checkpoint_json, {})
    attempt_start = (j.attempt_started_at or now).timestamp()
    ckpt_at = ckpt.get("at")
    return sched.RunningJob(
        **_common(j),
        allocations=tuple(
            sched.Allocation(node_name, _positions(indices.get(node_name, []), gpus))
            for attempt, node_name, gpus in allocs
            if attempt == j.attempt
        ),
        state=JobState(j.state),
        started_at=attempt_start,
        # only a checkpoint of this attempt bounds the work a suspension would lose
        last_checkpoint_at=ckpt_at if ckpt_at and ckpt_at >= attempt_start else None,
        checkpoint_duration_s=ckpt.get("duration_s"),
        suspend_requested_for=j.suspend_for_job_id,
    )


def _absorb(jobs: dict[int, sched.QueuedJob], shows: Shown, j) -> None:  # noqa: ANN001
    """One job row read again: in the cache while it is queued and not held, out of it otherwise."""
    if j.state == JobState.QUEUED.value and not j.user_suspended:
        job = jobs[j.id] = _queued(j)
        shows.set(j.id, j.pending_reason, job.reserved_nodes)
    else:
        jobs.pop(j.id, None)
        shows.drop(j.id)


def _refresh(session: Session, queue: QueueCache, mark: int, queued_count: int | None) -> Shown:
    """``queue`` (the queued jobs not held) refreshed to ``mark`` (see QueueCache); returns
    their pending reasons and reservations as read."""
    for _ in range(2):
        full = queue.mark is None or mark < queue.mark
        if full:
            queue.reset()
            rows = session.execute(select(*_JOB_COLUMNS).where(Job.state == JobState.QUEUED.value))
            queue.full_reads += 1
        else:
            rows = session.execute(select(*_JOB_COLUMNS).where(Job.change_seq > queue.mark))
        jobs, shows = queue.jobs, queue.shows
        ids: list[int] = []
        for j in rows:
            ids.append(j.id)
            _absorb(jobs, shows, j)
        queue.rows_read = len(ids)
        queue._read(ids, full)
        queue.mark = mark
        if queued_count is None or len(jobs) == queued_count:
            break
        log.warning("scheduler: the queue cache holds %d jobs, the database %d queued: reading it all again",
                    len(jobs), queued_count)
        queue.reset()
    return queue.shows


# PostgreSQL: a transaction id ages out of the 32-bit comparison after 2**31 transactions; a
# cache whose horizon is this many transactions old is read again in full instead
PG_HORIZON_MAX_AGE = 1_000_000_000
_XID_WRAP = 1 << 32
# the states whose rows the queue's read looks at: a job that left the queue for one of the others
# (terminal) is found by the count of queued jobs instead (its row is not read: the table keeps
# every finished job, and a scan of it all cost PostgreSQL 194 ms a cycle with 1,000,000 of them)
_QUEUE_SIDE = (JobState.QUEUED.value, *_ACTIVE_VALUES)
_QUEUED_IDS = f"SELECT id FROM jobs WHERE state = '{JobState.QUEUED.value}' AND NOT user_suspended"
# the oldest transaction the next read must look at again: the snapshot's xmin, or this
# transaction's own id if smaller (least() ignores NULL: no id yet)
PG_HORIZON = ("least(pg_snapshot_xmin(pg_current_snapshot())::text::bigint,"
              " pg_current_xact_id_if_assigned()::text::bigint)")


def _refresh_pg(session: Session, queue: QueueCache) -> Shown:
    """``queue`` (the queued jobs not held) refreshed with the queued and active job rows written
    by every transaction not known to have ended at its last read, and rid of the jobs no longer
    queued at all (PostgreSQL, see QueueCache); returns their pending reasons and reservations as
    read.

    One statement, so one snapshot (at any isolation level) for the horizon, the count of queued
    jobs not held (queued_counts, written by the same transactions as the rows it counts) and
    the rows: ``h``, one row, LEFT JOINed to the rows to read (so the horizon comes
    even when none is). The horizon is the snapshot's xmin: every transaction with a smaller id
    had ended when the rows were read (its rows were seen, or it aborted), and this one's own id
    if it is smaller (a fenced transaction has one from its UPDATE of the lease row; what it
    writes after the read must be read again next cycle). A later write is by a transaction whose id is not
    smaller: in progress at the read (>= xmin) or begun after it (>= xmax)."""
    h = select(
        literal_column(PG_HORIZON).label("horizon"),
        literal_column("pg_snapshot_xmax(pg_current_snapshot())::text::bigint").label("next_xid"),
        queued_counts.ready().label("queued"),  # the queued jobs not held, kept by the database
    ).subquery("h")
    while True:
        full = queue.mark is None
        if full:
            on = Job.state == JobState.QUEUED.value
        else:
            # the row's xmin (32 bits) not older than the horizon: ``age`` counts back from one
            # transaction id for both (this one's, or the next to be given), modulo 2**32, exact
            # while the horizon is less than 2**31 transactions old (PG_HORIZON_MAX_AGE, checked
            # below); a row written after that id has a negative age (read); a frozen row keeps its
            # old xmin or shows 2, whose age is the largest there is: older, not read. (``age``
            # takes a third less of PostgreSQL's time than the modular arithmetic on
            # ``xmin::text::bigint`` it replaced: EXPLAIN ANALYZE, benchmarks/README.md)
            on = and_(Job.state.in_(_QUEUE_SIDE), text("age(jobs.xmin) <= age(CAST(CAST(:h32 AS text) AS xid))")
                      .bindparams(h32=queue.mark % _XID_WRAP))
        rows = session.execute(select(h.c.horizon, h.c.next_xid, h.c.queued, *_JOB_COLUMNS)
                               .select_from(h.outerjoin(Job, on)))
        jobs, shows = queue.jobs, queue.shows
        if full:
            jobs.clear()
            shows.clear()
            queue.full_reads += 1
        ids: list[int] = []
        horizon = next_xid = queued_count = None
        for j in rows:
            horizon, next_xid, queued_count = j.horizon, j.next_xid, j.queued
            if j.id is None:  # the LEFT JOIN's row when no job row is read
                continue
            ids.append(j.id)
            _absorb(jobs, shows, j)
        queue.rows_read = len(ids)
        queue._read(ids, full)
        if full:  # the whole queue as of this snapshot
            queue.mark = horizon
            break
        if next_xid - queue.mark > PG_HORIZON_MAX_AGE:
            log.warning("scheduler: the queue cache's horizon is %d transactions old: reading it all again",
                        next_xid - queue.mark)
        elif len(jobs) > queued_count:
            # jobs left the queue for a state not read (cancelled, failed): the ids still queued,
            # through the state index, and the cache's others dropped (what changed after this
            # statement's snapshot is written by a transaction not older than its horizon: read
            # next cycle, as any other write)
            cur = session.connection().connection.driver_connection.cursor()
            cur.execute(_QUEUED_IDS)
            still = {i for i, in cur}
            cur.close()
            left = [i for i in jobs if i not in still]
            for i in left:
                del jobs[i]
                shows.drop(i)
            queue.departures_read += 1
            queue.rows_read += len(left)
            queue._read(left, False)
            queue.mark = horizon
            break
        elif len(jobs) != queued_count:
            log.warning("scheduler: the queue cache holds %d jobs, the database %d queued: reading it all again",
                        len(jobs), queued_count)
        else:
            queue.mark = horizon
            break
        queue.reset()  # and read it all, once
    return queue.shows


def _update_usage(
    session: Session, snapshot: sched.Snapshot, *, now: datetime, half_life_s: float, write: bool = True,
    counted: ActiveCache | None = None,
) -> dict[str, float]:
    """Decay each user's GPU-seconds with the half-life and add what their running jobs used
    since the last cycle. Returns the values as of ``now``; ``write=False`` only computes them
    (a cycle's planning read; the same call with ``write`` in its writing transaction stores
    the same values)."""
    return _write_usage(session, gpus_by_user(snapshot.running, counted), now=now, half_life_s=half_life_s, write=write)


def gpus_by_user(running: tuple[sched.RunningJob, ...], counted: ActiveCache | None = None) -> dict[str, int]:
    """The GPUs each user's active jobs hold (a user with an active job holding none: 0). With
    ``counted`` (PostgreSQL's ActiveCache), its running counts when ``running`` is the very tuple
    it built (kept as jobs came, changed and went: walking 20,000 running jobs was ~8 ms a cycle)."""
    if counted is not None and counted.ordered is running:
        return counted.gpus_of_user
    out: dict[str, int] = {}
    for r in running:
        out[r.user] = out.get(r.user, 0) + r.gpu_count
    return out


def _write_usage(
    session: Session, gpus_by_user: dict[str, int], *, now: datetime, half_life_s: float, write: bool = True
) -> dict[str, float]:
    rows = {u.user_name: u for u in session.scalars(select(UserUsage))}
    result: dict[str, float] = {}
    for user in sorted(set(rows) | set(gpus_by_user)):
        row = rows.get(user)
        gpu_s, updated_at = (row.gpu_s, row.updated_at) if row is not None else (0.0, now)
        dt = max(0.0, (now - updated_at).total_seconds())
        decay = 0.5 ** (dt / half_life_s) if half_life_s > 0 else 0.0
        result[user] = gpu_s * decay + gpus_by_user.get(user, 0) * dt
        if write:
            if row is None:
                row = UserUsage(user_name=user, gpu_s=0.0, updated_at=now)
                session.add(row)
            row.gpu_s = result[user]
            row.updated_at = now
    return result


@dataclass(frozen=True)
class _Quiet:
    """What a cycle with nothing to decide needs: the GPUs each user's active jobs hold (the
    usage's input) and how many active jobs there are."""

    gpus_by_user: dict[str, int]
    running: int


_DEMOTABLE = DEMOTED.value  # the one priority whose running jobs a cycle demotes


def _queued_and_demotable(session: Session) -> tuple[int, int]:
    """How many queued jobs are not held (kept by the database: queued_counts, a few rows
    whatever the queue's depth), and how many active jobs have the priority a cycle demotes
    (ix_jobs_state_priority over the active jobs): one statement, one snapshot."""
    active = [s.value for s in ACTIVE_STATES]
    demotable = (select(func.count()).select_from(Job)
                 .where(Job.state.in_(active), Job.priority == _DEMOTABLE).scalar_subquery())
    queued, demotable = session.execute(select(queued_counts.ready(), demotable)).one()
    return int(queued), int(demotable)


def _quiet(session: Session, counts: tuple[int, int] | None = None) -> _Quiet | None:
    """None unless this cycle has nothing to decide: no queued job that is not held (so no
    start, suspension, reservation or pending reason) and no active job of the one priority a
    cycle demotes (so no demotion). Then the full cycle's only effect is the usage update, and
    its input is the GPUs each user's active jobs hold, read here without the snapshot (issue
    14's profile: ~95 cycles after the placement, with an empty queue, each loading every node,
    allocation and job). Two small queries instead of the snapshot's three large ones."""
    queued, demotable = counts if counts is not None else _queued_and_demotable(session)
    if queued or demotable:
        return None
    # as the snapshot counts a running job's GPUs: its current attempt's active allocations, each
    # GPU that is one of its node's GPUs (``_positions``); a job holding none still names its user
    gpus_by_user: dict[str, int] = {}
    jobs: set[int] = set()
    for job_id, user, gpus, node_gpus, node_indices in session.execute(
        select(Job.id, Job.user_name, JobAllocation.gpus, Node.gpus, Node.gpu_indices)
        .outerjoin(JobAllocation, and_(JobAllocation.job_id == Job.id, JobAllocation.attempt == Job.attempt,
                                       JobAllocation.active))
        .outerjoin(Node, Node.name == JobAllocation.node_name)
        .where(_ACTIVE_JOBS)
    ):
        jobs.add(job_id)
        n = 0
        if gpus:
            indices = [] if node_gpus is None else gpu_indices(_NodeGpus(node_gpus, node_indices))
            n = len(_positions(indices, gpus))
        gpus_by_user[user] = gpus_by_user.get(user, 0) + n
    return _Quiet(gpus_by_user=gpus_by_user, running=len(jobs))


@dataclass(frozen=True)
class _NodeGpus:
    gpus: int
    gpu_indices: list[int] | None


def _quiet_cycle(
    session: Session, quiet: _Quiet, *, now: datetime, half_life_s: float, lease: "Lease | None",
    read_session: Session | None,
) -> CycleResult:
    """A cycle with nothing to decide (``_quiet``): the usage update the full cycle would write
    (the same values: its decisions would be empty), fenced and renewed as every cycle."""
    from hai.services.leader import fence, renew

    if read_session is not None:
        read_session.rollback()  # the planning read ends here
        if lease is not None:
            fence(session, lease)
    _write_usage(session, quiet.gpus_by_user, now=now, half_life_s=half_life_s)
    if lease is not None:
        renew(session, lease)
    session.commit()
    return CycleResult(started=[], suspended=[], snapshot_jobs=quiet.running, at=now, considered=())


def _used_master_ports(session: Session, heads: list[str]) -> dict[str, set[int]]:
    """The rendezvous ports of the active jobs whose rank 0 is on each of these nodes, in one
    query for a cycle's starts (issue 14: one query and one flush per start was a tenth of the
    cycle that places 1,000 jobs)."""
    used: dict[str, set[int]] = {h: set() for h in heads}
    if heads:
        for node, port in session.execute(
            select(JobAllocation.node_name, Job.master_port)
            .join(Job, Job.id == JobAllocation.job_id)
            .where(
                JobAllocation.node_name.in_(heads), JobAllocation.node_rank == 0, Job.master_addr.is_not(None),
                Job.state.in_([s.value for s in ACTIVE_STATES]),
            )
        ):
            if port is not None:
                used[node].add(port)
    return used


def _pick_master_port(used: set[int], *, base: int) -> int:
    port = base
    while port in used:
        port += 1
    used.add(port)
    return port


def run_cycle(
    session: Session, *, settings: Settings, now: datetime | None = None, lease: "Lease | None" = None,
    read_session: Session | None = None, queue: QueueCache | None = None,
) -> CycleResult:
    """One full cycle; its decisions are written in one transaction. With ``lease`` (the
    scheduler process), the writing transaction is fenced first: it fails with
    ``leader.Fenced`` and writes nothing unless this leader's epoch is still current, and the
    rows it writes carry the epoch.

    ``read_session`` (SQLite): the snapshot is read and the cycle planned in that read-only
    (deferred) transaction, and ``session`` takes the database's write lock only to fence and
    write the decisions. Otherwise a cycle at 10,000 queued jobs held the write lock while it
    planned and submissions queued behind it past the busy timeout ("database is locked",
    issue 12). What changed in between is what apply_decisions re-checks anyway (a job no
    longer queued or held is skipped; a GPU is held once by the database's own index), as on
    PostgreSQL, whose reads never block a writer.

    ``queue`` (the scheduler process): the queued jobs of the last cycle, refreshed with the
    rows changed since (QueueCache) instead of read again every cycle.

    The cyclic garbage collector is paused for the whole cycle, as the domain pauses it for its
    own part: the snapshot's read builds a RunningJob, a NodeView and their tuples for every
    running job and node, and with Python's thresholds that set off collections that walked
    every object the process keeps, the queue cache's jobs included (at 10,000 nodes, 20,000
    running and 100,000 queued jobs, ~40% of the read: benchmarks/sqlite_cycle.py). Nothing
    here needs a cycle of references collected before the cycle ends; the collector takes them
    afterwards."""
    with sched.collector_paused():
        return _cycle(session, settings=settings, now=now, lease=lease, read_session=read_session, queue=queue)


def _cycle(
    session: Session, *, settings: Settings, now: datetime | None, lease: "Lease | None",
    read_session: Session | None, queue: QueueCache | None,
) -> CycleResult:
    from hai.services.leader import fence, renew

    if lease is not None and read_session is None:
        fence(session, lease)
    now = now or utcnow()
    planner = read_session if read_session is not None else session
    half_life_s = settings.scheduler.usage_half_life_s
    counts = _queued_and_demotable(planner)
    quiet = _quiet(planner, counts)
    if quiet is not None:
        return _quiet_cycle(session, quiet, now=now, half_life_s=half_life_s, lease=lease, read_session=read_session)
    snapshot, current = _load(planner, now=now, lost_after_s=settings.agent.lost_after_s, queue=queue,
                              queued_count=counts[0])
    counted = queue.active if queue is not None else None
    usage = _update_usage(planner, snapshot, now=now, half_life_s=half_life_s, write=read_session is None,
                          counted=counted)
    if read_session is not None:
        read_session.rollback()  # the planning read ends here
    snapshot = dataclasses.replace(snapshot, usage=usage)  # (the queue and its delta as read)
    decisions = sched.schedule(snapshot, policy_from_settings(settings), now.timestamp(),
                               kept=queue.kept if queue is not None else None)
    if read_session is not None:
        if lease is not None:
            fence(session, lease)  # the write lock from here to the commit
        _update_usage(session, snapshot, now=now, half_life_s=half_life_s, counted=counted)
    apply_decisions(session, decisions, settings=settings, now=now, current=current)
    if decisions.starts:
        faults.stop_point("scheduler_before_commit")
    if lease is not None:
        renew(session, lease)
    session.commit()
    return CycleResult(
        started=[s.job_id for s in decisions.starts],
        suspended=[s.job_id for s in decisions.suspends],
        snapshot_jobs=len(snapshot.running) + len(snapshot.queued),
        at=now,
        considered=tuple(map(_by_id, snapshot.queued)),
    )


def new_allocation(session: Session, *, attempt: int, node: str, node_rank: int, gpus: list[int]) -> JobAllocation:
    """An active allocation; ``hold_gpus`` writes its ``gpu_holds`` rows once it has an id."""
    return JobAllocation(
        attempt=attempt, node_name=node, node_rank=node_rank, gpus=list(gpus),
        epoch=session.info.get(SCHEDULER_EPOCH),
    )


def hold_gpus(session: Session, allocations: list[JobAllocation]) -> None:
    """One ``gpu_holds`` row per GPU of these (flushed) allocations, in one INSERT at the next
    flush: the unique index over held (node, GPU) refuses a GPU another allocation holds."""
    session.add_all(
        GpuHold(allocation_id=a.id, node_name=a.node_name, gpu=g) for a in allocations for g in a.gpus
    )


_jobs = Job.__table__
# a queued job's reservation and (unless its owner holds it; None: unchanged) pending reason
_WRITE_QUEUED = (
    update(_jobs)
    .where(_jobs.c.id == bindparam("i"), _jobs.c.state == JobState.QUEUED.value)
    .values(
        reserved_nodes=bindparam("n", type_=_jobs.c.reserved_nodes.type),
        pending_reason=case(
            (_jobs.c.user_suspended.is_(True), _jobs.c.pending_reason),
            else_=func.coalesce(bindparam("r", type_=Text), _jobs.c.pending_reason),
        ),
    )
)

# PostgreSQL: the same write for all of them as one UPDATE over arrays (issue 12:
# executemany sent one UPDATE a job, each ~50 us of PostgreSQL's execution, pg_stat_statements,
# and one parameter set through SQLAlchemy and psycopg a job; a new job gets its pending reason
# in its first cycle, so that was an UPDATE a submission). The rows are first locked in id order
# (``_LOCK_QUEUED_PG``, by the primary key), as executemany's sorted UPDATEs locked them; the
# UPDATE then finds them locked, whatever join its planner picks. (Locking inside the UPDATE, by
# a sub-select or a CTE, let the planner rescan the lock once per row when it misjudged a join's
# size: a quadratic plan, EXPLAIN ANALYZE.) ``jobs.id = ANY`` repeats the join's condition for
# the planner: without it, it joined the whole table to the arrays (to write 100 of 10,000 queued
# jobs, a sequential scan of all of them: 1.8 of the statement's 2.7 ms).
# The values travel as text the database parses: the ids as one array literal ("{1,2,3}"), the
# writes as one JSON document ([[id, reservation, reason or null], ...], by ``json.dumps``, C).
# Passed as Python lists, psycopg dumped every element of the three arrays in Python (its
# ListDumper): 22 ms of the scheduler's CPU to write 4,000 jobs, 560 ms for 100,000; as text,
# 3 ms and 47 ms (benchmarks/write_queued.py).
_LOCK_QUEUED_PG = text("SELECT id FROM jobs WHERE id = ANY(CAST(:i AS INTEGER[])) ORDER BY id FOR UPDATE")
_WRITE_QUEUED_PG = text(
    "UPDATE jobs SET reserved_nodes = v.n, "
    "pending_reason = CASE WHEN jobs.user_suspended IS true THEN jobs.pending_reason "
    "ELSE coalesce(v.r, jobs.pending_reason) END "
    "FROM (SELECT CAST(e->>0 AS INTEGER) AS i, e->1 AS n, e->>2 AS r "
    "FROM json_array_elements(CAST(:w AS JSON)) AS e) AS v "
    "WHERE jobs.id = ANY(CAST(:i AS INTEGER[])) AND jobs.id = v.i AND jobs.state = :queued"
).bindparams(queued=JobState.QUEUED.value)


def _write_queued(session: Session, writes: list[tuple[int, list[str], str | None]]) -> None:
    """Each (job id, reservation, pending reason or None: unchanged) of ``writes``, sorted by id:
    written only if the job is still queued, its reason only if its owner does not hold it."""
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        write_queued_pg(conn, writes)
    else:
        conn.execute(_WRITE_QUEUED, [{"i": i, "n": n, "r": r} for i, n, r in writes])


def write_queued_pg(conn: Connection, writes: list[tuple[int, list[str], str | None]]) -> None:
    """``_write_queued`` on PostgreSQL: two statements, whatever the number of jobs."""
    ids = "{" + ",".join([str(i) for i, _, _ in writes]) + "}"
    conn.execute(_LOCK_QUEUED_PG, {"i": ids})
    conn.execute(_WRITE_QUEUED_PG, {"i": ids, "w": json.dumps(writes, ensure_ascii=False)})


_DIGITS = re.compile(r"[0-9]+")
_GOLDEN = 0.6180339887498949  # (spreads consecutive job ids evenly over a refresh span)


def _throttled(pending: dict[int, str | None], shown: Shown, forced: set[int], now_s: float,
               refresh_s: float) -> dict[int, str | None]:
    """Of the changed pending reasons ``pending``, the ones to write now (issue 12, as Kueue
    skips a pending workload's status update when only its message changed: kubernetes-sigs/kueue
    #8095). A reason whose words are the ones the job shows, only some number in it different
    ("(256 nodes reserved for other jobs)", then 288), waits until the job's own refresh moment
    has passed since this process last wrote its reason: the moments of the jobs are spread
    evenly over ``refresh_s`` seconds (by id), so a cycle writes about queued x interval /
    refresh_s such reasons, not the whole queue, while preemptions are in flight. Written at once:
    any other change (other words, a reason the job did not show, none), a job of ``forced``
    (its reservation changes: the reason that names its nodes goes with it), and a job whose
    reason this process has not written yet. Records the write time of each one returned."""
    reasons, written = shown.reasons, shown.written_at
    alike: dict[tuple[str, str], bool] = {}  # (shown, new) -> same words (a few distinct pairs a cycle)
    out: dict[int, str | None] = {}
    for i, r in pending.items():
        old = reasons.get(i)
        at = written.get(i)
        if at is not None and old is not None and r is not None and i not in forced:
            key = (old, r)
            same = alike.get(key)
            if same is None:
                same = alike[key] = _DIGITS.sub("#", old) == _DIGITS.sub("#", r)
            if same:
                phase = (i * _GOLDEN) % 1.0 * refresh_s
                if (now_s + phase) // refresh_s == (at + phase) // refresh_s:
                    continue  # its refresh moment has not come since its last write
        out[i] = r
        written[i] = now_s
    return out


def apply_decisions(
    session: Session,
    decisions: sched.Decisions,
    *,
    settings: Settings,
    now: datetime,
    current: Shown | None = None,
) -> None:
    """``current``: what the snapshot's queued jobs show (``Shown``); with it, only the jobs
    whose reason or reservation changes are loaded and locked (issue 12: a cycle wrote, and
    first loaded, every queued job every time)."""
    pending = decisions.pending_reasons
    if current is not None:
        reasons, reserved_now = current.reasons, current.reserved
        # the domain gives every queued job its reason every cycle: a pass over plain strings
        # (read from objects of a reason and a reservation each, it took twice as long)
        pending = {i: r for i, r in pending.items() if i not in reasons or reasons[i] != r}
        reservations = {
            i for i, nodes in decisions.reservations.items()
            if i not in reasons or reserved_now.get(i, ()) != tuple(nodes)
        }
        # a job that held a reservation and holds none after this cycle must be written too
        dropped = {i for i in reserved_now if i not in decisions.reservations}
        refresh_s = settings.scheduler.pending_reason_refresh_s
        if refresh_s > 0 and pending:
            pending = _throttled(pending, current, reservations | dropped, now.timestamp(), refresh_s)
    else:
        reservations, dropped = set(decisions.reservations), set()
    # the jobs a state changes for (starts, suspensions, demotions) are loaded and locked as ORM
    # objects: their transitions record events; a queued job whose reason or reservation is all
    # that changes is written by one UPDATE executed for all of them (issue 12: loading each
    # such job as an ORM object, with its events, was ~0.2 ms a job; a cycle where every one of
    # 10,000 queued jobs got a new reason took seconds)
    ids = {s.job_id for s in decisions.starts} | {s.job_id for s in decisions.suspends} | {d.job_id for d in decisions.demotions}
    queued_only = sorted((reservations | dropped | set(pending)) - ids)
    jobs = {j.id: j for j in session.scalars(select(Job).where(Job.id.in_(sorted(ids))).with_for_update())} if ids else {}
    # only the nodes this cycle hands GPUs on: their GPU numbering and address
    placed = sorted({alloc.node for s in decisions.starts for alloc in s.allocations})
    nodes = {
        n.name: n
        for n in session.execute(
            select(Node.name, Node.address, Node.gpus, Node.gpu_indices).where(Node.name.in_(placed))
        )
    } if placed else {}
    indices = {name: gpu_indices(n) for name, n in nodes.items()}

    for demote in decisions.demotions:
        job = jobs.get(demote.job_id)
        if job is None or JobState(job.state).terminal:
            continue
        job.priority = demote.to.value
        record_event(session, job, demote.reason, now=now)

    started: list[JobAllocation] = []
    ports = _used_master_ports(session, sorted({s.allocations[0].node for s in decisions.starts}))
    for start in decisions.starts:
        job = jobs.get(start.job_id)
        if job is None or job.state != JobState.QUEUED.value or job.user_suspended:
            continue  # changed since the snapshot (cancelled, held): skip, next cycle re-plans
        transition(session, job, JobState.STARTING, reason=f"placed: {start.reason}", now=now)
        for rank, alloc in enumerate(start.allocations):
            allocation = new_allocation(session, attempt=job.attempt, node=alloc.node, node_rank=rank,
                                        gpus=[indices[alloc.node][pos] for pos in alloc.gpus])
            job.allocations.append(allocation)
            started.append(allocation)
        head = start.allocations[0].node
        job.master_addr = nodes[head].address if head in nodes else "127.0.0.1"
        job.master_port = _pick_master_port(ports[head], base=settings.agent.master_port_base)
        job.placement_reason = start.reason
        publish_after_commit(session, *(notify.node_topic(a.node) for a in start.allocations))

    if started:
        session.flush()  # the allocations' ids
        hold_gpus(session, started)  # one INSERT for every GPU this cycle hands out
        session.flush()

    for suspend in decisions.suspends:
        job = jobs.get(suspend.job_id)
        if job is None or job.state not in (JobState.RUNNING.value, JobState.STARTING.value):
            continue
        job.suspend_for_job_id = suspend.for_job_id
        transition(session, job, JobState.SUSPENDING, reason=suspend.reason, now=now)

    # ``decisions.reservations`` is the complete set after this cycle: a queued job of the
    # snapshot that is absent from it holds no reservation any more (every such job is in
    # ``jobs``: it started, or it has a pending reason)
    for job in jobs.values():
        if job.state != JobState.QUEUED.value:
            continue
        reserved = list(decisions.reservations.get(job.id, ()))
        if list(job.reserved_nodes or []) != reserved:
            job.reserved_nodes = reserved

    for job_id, reason in pending.items():
        job = jobs.get(job_id)
        if job is not None and job.state == JobState.QUEUED.value and not job.user_suspended and job.pending_reason != reason:
            job.pending_reason = reason

    if queued_only:
        # as for the ORM objects above: only a job still queued, its reason only if not held
        session.flush()
        _write_queued(session, [(i, list(decisions.reservations.get(i, ())), pending.get(i)) for i in queued_only])
