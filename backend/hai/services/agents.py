"""The server side of the agent protocol: the handshake, heartbeats (apply the agent's report,
answer with the node's assignments). The reaper that marks silent nodes lost
is services/reaper.py; node health (validator runs, moving jobs off a node) is
services/node_health.py, called from the hooks marked "issue 10".

What a report means for a job lives in ``services.reports`` (rules: ``hai.domain.outcomes``);
what a node should run in ``services.assignments``. A heartbeat builds the node's assignment
list once (one query of its active allocations, which the report is applied to; the list is
built from those still active): it is both what the agent's digest is checked against
(an agent holding exactly that list and not reporting a ``stop`` attempt has nothing of it
running: its GPUs are released) and the reply.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import threading
import time
from dataclasses import dataclass
from datetime import timezone

from pydantic import TypeAdapter
from sqlalchemy import and_, bindparam, insert, select, text, update
from sqlalchemy.orm import Session, defer

from hai.db.base import utcnow
from hai.db.models import Job, JobAllocation, Node, ValidationCheck, ValidationRun
from hai.domain.jobs import JobState
from hai.domain.nodes import NodeState
from hai.protocol import (SUPPORTED_VERSIONS, AgentHello, Assignment, AttemptStatus, DesiredAction, GpuInfo, GpuMetrics,
                          Heartbeat, ServerReply, ValidationReport, ValidationRequest)
from hai.services import metrics_store, node_health, notify, reports
from hai.services.assignments import (active_allocations, active_allocations_of, assigned, assignments_for, digest,
                                      expected_ranks)
from hai.services.errors import UnsupportedProtocol
from hai.services.jobs import publish_after_commit
from hai.services.node_state import create_node
from hai.settings import Settings

log = logging.getLogger(__name__)


def check_version(version: int) -> None:
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedProtocol(
            f"agent protocol version {version} is not supported; the server speaks {sorted(SUPPORTED_VERSIONS)}",
            SUPPORTED_VERSIONS)


def register(*, session: Session, hello: AgentHello, settings: Settings) -> ServerReply:
    check_version(hello.protocol_version)
    now = utcnow()
    node = session.scalar(select(Node).where(Node.name == hello.node).with_for_update())
    if node is None:  # issue 10: the node's first state goes through node_state
        node = create_node(session, name=hello.node, state=NodeState.READY, actor="agent",
                           reason="agent registered", now=now)
        # issue 12: nodes that register together (a cluster's bring-up) start their quick rounds
        # out of step, not all in the same second every quick_every_heartbeats
        node.heartbeats_since_quick = -node_health.quick_phase(node.name, settings)
    if not node.labels_from_topology:
        if hello.zone:
            node.zone = hello.zone
        if hello.leaf:
            node.leaf = hello.leaf
    node.zone = node.zone or "default"
    node.leaf = node.leaf or "default"
    node.gpus = len(hello.gpus)
    node.address = hello.address
    node.fake_gpus = hello.fake_gpus
    node.gpu_inventory = [g.model_dump() for g in hello.gpus]
    numbering = sorted(g.index for g in hello.gpus)
    node.gpu_indices = None if numbering == list(range(len(numbering))) else numbering
    node.nics = [n.model_dump() for n in hello.nics]
    node.agent_version = hello.agent_version
    node.protocol_version = hello.protocol_version
    node.last_heartbeat_at = now
    node_health.on_register(session, node, settings=settings, now=now)  # issue 10: lost -> validate first
    session.flush()
    allocs = active_allocations(session, node.name)
    reports.apply_reports(session, allocs, hello.attempts, now=now)
    node_health.settle(session, node, now=now)  # issue 10
    reply = _reply(session, node, [a for _, a in assigned(allocs, settings)], settings)
    publish_after_commit(session, notify.SCHEDULER)
    session.commit()
    return reply


_HEARTBEAT_NODE = (defer(Node.gpu_inventory), defer(Node.gpu_metrics), defer(Node.nics))


def heartbeat(*, session: Session, hb: Heartbeat, settings: Settings, seen: dict | None = None) -> ServerReply:
    """``seen``: filled with the node's state after the heartbeat (for ``ReplyCache.store``)."""
    check_version(hb.protocol_version)
    now = utcnow()
    # issue 12: a heartbeat that changes nothing but liveness (or only delivers passed validation
    # runs), in Core
    reply = _quiet_heartbeat(session, hb, settings=settings, now=now, seen=seen)
    if reply is not None:
        return reply
    # the node's JSON documents (inventory, metrics, NICs) load only if something reads them:
    # a heartbeat overwrites the metrics and reads the inventory only for a validation run
    # the node's row first, held to the commit (FOR NO KEY UPDATE: allocations' foreign keys
    # still pass): a reaper that holds it is waited for and its verdict read (issue 13), and one
    # that comes later sees this heartbeat (services/reaper.py)
    row = session.execute(
        select(Node, node_health.has_pending_run()).where(Node.name == hb.node).options(*_HEARTBEAT_NODE)
        .with_for_update(key_share=True, of=Node)
    ).first()
    if row is None:
        return ServerReply(node=hb.node, assignments_digest="", reregister=True)
    node, maybe_pending = row
    if node_health.must_reregister(node):  # issue 10
        # the server gave this node's work away; the agent must hand in its inventory again
        session.commit()
        return ServerReply(node=hb.node, assignments_digest="", reregister=True)
    metrics_store.record_heartbeat(session=session, node=node.name, gpus=hb.gpus, now=now, settings=settings)
    allocs = active_allocations(session, node.name)
    reply = _heartbeat(session, hb, node, bool(maybe_pending), allocs, settings=settings, now=now)
    if seen is not None:
        seen["state"] = node.state
        seen["heartbeats_since_quick"] = node.heartbeats_since_quick or 0
    session.commit()
    return reply


def heartbeats(*, session: Session, hbs: list[Heartbeat], settings: Settings) -> list[ServerReply]:
    """The heartbeats of several nodes (one each) in one transaction, replies in their order:
    each node's is what ``heartbeat`` alone would do and answer, one node after the other. For
    a process that speaks for many nodes (the Kubernetes backend's virtual agents, issue 14):
    one read of the nodes, one of their active allocations, one statement locking every job
    whose report changes (in id order, as ``lock_jobs`` does: batches running side by side
    wait for each other instead of deadlocking) and one commit, instead of each per node."""
    if len({hb.node for hb in hbs}) != len(hbs):
        raise ValueError("a batch of heartbeats has one per node")
    for hb in hbs:
        check_version(hb.protocol_version)
    if not hbs:
        return []
    now = utcnow()
    names = [hb.node for hb in hbs]
    rows = {
        node.name: (node, bool(pending))
        for node, pending in session.execute(
            # the nodes' rows first, in name order, as a single heartbeat takes its node's (issue 13:
            # a reaper holding one is waited for; batches side by side queue in the same order)
            select(Node, node_health.has_pending_run()).where(Node.name.in_(sorted(names))).options(*_HEARTBEAT_NODE)
            .order_by(Node.name).with_for_update(key_share=True, of=Node)
        )
    }
    allocs = active_allocations_of(session, [n for n in names if n in rows])
    # the jobs whose report changes, as apply_reports finds them, locked at once
    changed = set()
    for hb in hbs:
        by_key = {(a.job_id, a.attempt): a for a in allocs.get(hb.node, ())}
        for st in hb.attempts:
            a = by_key.get((st.job_id, st.attempt))
            if a is not None and a.status != st.model_dump(mode="json"):
                changed.add(a.job_id)
    if changed:
        reports.lock_jobs(session, sorted(changed))
    replies = []
    for hb in hbs:
        row = rows.get(hb.node)
        if row is None or node_health.must_reregister(row[0]):  # issue 10, as in heartbeat
            replies.append(ServerReply(node=hb.node, assignments_digest="", reregister=True))
            continue
        node, maybe_pending = row
        metrics_store.record_heartbeat(session=session, node=node.name, gpus=hb.gpus, now=now, settings=settings)
        replies.append(_heartbeat(session, hb, node, maybe_pending, allocs[node.name], settings=settings, now=now))
    session.commit()
    return replies


def _heartbeat(session: Session, hb: Heartbeat, node: Node, maybe_pending: bool, allocs: list, *,
               settings: Settings, now) -> ServerReply:  # noqa: ANN001
    """One node's heartbeat after its row and its active allocations are read: the report
    applied, the assignments checked and built, liveness. Flushes; the caller commits."""
    reported = reports.apply_reports(session, allocs, hb.attempts, now=now)
    held = assigned(allocs, settings)
    if hb.assignments_digest is not None and hb.assignments_digest == digest([a for _, a in held]):
        held, changed = reports.release_unreported_stops(session, held, reported, now=now)
        if changed:  # rare: a job moved on; its other allocations' actions may read differently
            held = assigned(allocs, settings)
    # issue 10: validation reports; a failed critical check moves this node's jobs (their actions change)
    pending: list = []
    if node_health.on_heartbeat(session, node, hb.validations, settings=settings, now=now, pending=pending,
                                 maybe_pending=maybe_pending, counts_rounds=node_health.server_rounds(hb.protocol_version)):
        held = assigned(allocs, settings)
    # liveness and the latest GPU figures last: one UPDATE of the node row with the quick-round count
    node.last_heartbeat_at = now
    if hb.gpus:
        metrics_store.set_latest_gpus(node, hb.gpus, settings)
    return _reply(session, node, [a for _, a in held], settings, pending=pending, protocol_version=hb.protocol_version)


# -- a full heartbeat that changes nothing but liveness, without the ORM (issue 12) ---------------
# Most heartbeats that miss the reply cache change nothing: the entry ran out, the node's first
# heartbeat at this API process, the first after its assignments changed (the agent still echoes
# the old digest). The ORM pass cost 6-12 ms of CPU for that (the node and allocations loaded
# as objects, the node's UPDATE through the unit of work's flush: 40% of it); this one reads the
# node, whether it has a pending validation run, and its active allocations with their jobs in one
# statement, checks that the ORM pass would change nothing but liveness, and writes liveness with
# one UPDATE (and, when the node's quick round falls due, the run's INSERT: the round's request
# costs no ORM pass either). Validation runs that passed, delivered by a ready or drained node,
# are stored here too (an UPDATE of the run, an INSERT of its checks): on a ready node a passed run
# changes nothing else, and the periodic quick rounds' results were the fan-in's dearest ORM
# passes (two full passes a round, every ``quick_every_heartbeats``: 0.56 of 1.33 ms of server
# CPU per heartbeat at 600 agents). Anything else (a report that changed, a stop to release, a
# failed run or a hardware Xid, a pending run not delivered yet, a node neither ready nor
# drained) goes the ORM way, in the same transaction (the node's row stays locked), as before.
_QUIET_STATES = (NodeState.READY.value, NodeState.DRAINED.value)


class _Row:
    """An allocation or a job as ``assignments.assignment_of`` and ``reports.node_report`` read it."""

    def __init__(self, **kw) -> None:  # noqa: ANN003
        self.__dict__.update(kw)


# every attribute of a job and an allocation that assignments.launch_spec / action_for and
# reports.node_report read (one they start reading fails here at once, in every heartbeat test)
_JOB_COLUMNS = ("id", "name", "user_name", "command", "env", "job_type", "nodes", "gpus_per_node", "master_addr",
                "master_port", "last_checkpoint", "progress", "suspend_grace_s", "log_watchdog_s", "max_runtime_s",
                "state", "desired_action", "attempt")
_ALLOC_COLUMNS = ("job_id", "attempt", "node_name", "node_rank", "gpus", "status")


@functools.cache
def _quiet_statement():  # noqa: ANN202 - built once, compiled once (SQLAlchemy's statement cache)
    n, a, j = Node.__table__, JobAllocation.__table__, Job.__table__
    return (
        select(n.c.state.label("n_state"), n.c.heartbeats_since_quick.label("n_quick"),
               n.c.agent_version.label("n_agent_version"), node_health.has_pending_run().label("n_pending"),
               *(a.c[c].label("a_" + c) for c in _ALLOC_COLUMNS), *(j.c[c].label("j_" + c) for c in _JOB_COLUMNS))
        .select_from(n.outerjoin(a.join(j, j.c.id == a.c.job_id), and_(a.c.node_name == n.c.name, a.c.active)))
        .where(n.c.name == bindparam("node"))
        .order_by(a.c.job_id, a.c.attempt)
        .with_for_update(key_share=True, of=n)  # as the ORM pass locks it (issue 13: the reaper)
    )


def _quiet_heartbeat(session: Session, hb: Heartbeat, *, settings: Settings, now, seen: dict | None) -> ServerReply | None:  # noqa: ANN001
    """The heartbeat in Core when it changes nothing but the node's liveness (last heartbeat, latest
    GPU figures, the quick-round count) and the passed validation runs it delivers, else None (the
    caller goes on the ORM way; the node's row is locked either way). Nothing is written before
    every reason to return None has been ruled out."""
    delivered: dict[int, tuple] = {}  # run id -> (run columns, check rows): the first report of each run
    own = []  # the agent's own periodic rounds that passed (protocol version 2)
    for report in hb.validations:
        if report.run_id is None:
            if not node_health.quiet_own_round(report):
                return None  # a failed round acts on the node: node_health.absorb_reports
            own.append((hb.node, report))
            continue
        values, rows_, checks = node_health.report_rows(report)
        if values["status"] != "passed" or node_health.hardware_xid(checks):
            return None  # the node's state changes, or a full run is asked for: node_health.absorb_reports
        delivered.setdefault(report.run_id, (values, rows_))
    rows = session.execute(_quiet_statement(), {"node": hb.node}).all()
    if not rows:
        return None  # unknown node: the ORM pass answers (reregister)
    first = rows[0]
    state = first.n_state
    if state not in _QUIET_STATES:
        return None
    allocs = []
    jobs: dict[int, _Row] = {}
    for r in rows:
        if r.a_job_id is None:
            continue
        job = jobs.get(r.j_id)
        if job is None:
            job = jobs[r.j_id] = _Row(**{c: getattr(r, "j_" + c) for c in _JOB_COLUMNS})
        allocs.append(_Row(job=job, active=True, **{c: getattr(r, "a_" + c) for c in _ALLOC_COLUMNS}))
    # what reports.apply_reports would do: nothing, when each reported attempt it holds is reported
    # as last time, for a running job's current attempt that is not over, with nothing to absorb
    active = {(a.job_id, a.attempt): a for a in allocs}
    for st in hb.attempts:
        a = active.get((st.job_id, st.attempt))
        if a is None:
            continue  # not the node's: the agent stops what it is not assigned
        job = a.job
        if job.state != JobState.RUNNING.value or a.attempt != job.attempt or st.model_dump(mode="json") != a.status:
            return None
        if reports.node_report(a, st).done_with(expected_ranks(job)):
            return None
        if st.checkpoint is not None:  # reports._absorb would take in a newer checkpoint
            cur = job.last_checkpoint or {}
            if cur.get("at") is None or st.checkpoint.at > cur["at"]:
                return None
        if st.progress is not None:  # ... or newer progress
            cur = job.progress or {}
            if cur.get("at") is None or (st.progress.at >= cur["at"] and st.progress.model_dump(mode="json") != cur):
                return None
    assignments = [a for _, a in assigned(allocs, settings)]
    reply_digest = digest(assignments)
    reported = {(st.job_id, st.attempt) for st in hb.attempts}
    if hb.assignments_digest == reply_digest and any(
            a.action == DesiredAction.STOP and (a.job_id, a.attempt) not in reported for a in assignments):
        return None  # an unreported stop to release (reports.release_unreported_stops)
    # runs the agent was asked for and is still running (a full validation takes minutes): listed
    # in every reply until answered (node_health.pending_requests); one not delivered yet is
    # marked delivered by the ORM pass
    vr = ValidationRun.__table__
    runs: list[tuple[int, str]] = []
    absorbed: list[int] = []  # the node's pending runs whose results this heartbeat delivers
    if first.n_pending:
        for r in session.execute(select(vr.c.id, vr.c.level, vr.c.delivered_at)
                                 .where(vr.c.node_name == hb.node, vr.c.status == node_health.PENDING).order_by(vr.c.id)):
            if r.id in delivered:
                absorbed.append(r.id)
                continue
            if r.delivered_at is None:
                return None
            runs.append((r.id, r.level))
    # node_health.on_heartbeat without reports: the quick-round count (not while a run waits), and
    # the round when it falls due (request_validation, delivered in this reply: pending_requests)
    quick = first.n_quick or 0
    every = settings.validation.quick_every_heartbeats
    # (a heartbeat that delivers results does not count: rounds follow the agent's own rhythm)
    if every and not hb.validations and first.n_agent_version != node_health.VIRTUAL_AGENT_VERSION \
            and node_health.server_rounds(hb.protocol_version):
        if not runs:
            quick += 1
        if quick >= every:
            if runs:
                return None  # a round due while a run waits: the ORM pass's rule
            quick = 0
            run_id = session.execute(insert(vr).values(
                node_name=hb.node, level="quick", trigger="periodic", status=node_health.PENDING,
                requested_by="validator", requested_at=now, delivered_at=now, summary="",
            ).returning(vr.c.id)).scalar_one()
            runs.append((run_id, "quick"))
    # node_health.absorb_reports for runs that passed on a ready or drained node: stored, nothing else
    # (a report of a run that is not this node's pending one is ignored there too)
    vc = ValidationCheck.__table__
    for run_id in absorbed:
        run_values, check_rows = delivered[run_id]
        session.execute(update(vr).where(vr.c.id == run_id).values(**run_values))
        if check_rows:
            session.execute(insert(vc), [dict(r, run_id=run_id) for r in check_rows])
        publish_after_commit(session, node_health.validation_topic(run_id))
    node_health.store_own_rounds(session, own)
    metrics_store.record_heartbeat(session=session, node=hb.node, gpus=hb.gpus, now=now, settings=settings)
    values: dict = {"last_heartbeat_at": now, "heartbeats_since_quick": quick}
    if hb.gpus:
        values.update(metrics_store.latest_gpu_columns(hb.gpus, settings))
    n = Node.__table__
    stmt = update(n).where(n.c.name == hb.node).values(**values)
    validations = []
    if not runs:
        session.execute(stmt)
    else:  # a run carries the node's registered inventory (the GPU check compares against it)
        inventory = session.execute(stmt.returning(n.c.gpu_inventory)).scalar_one()
        expected = [GpuInfo.model_validate(g) for g in inventory or []]
        validations = [ValidationRequest(run_id=i, level=level, expected_gpus=expected) for i, level in runs]
    reply = _server_reply(hb.node, assignments, settings, validations, reply_digest,
                          quick_every=node_health.own_rounds_every(hb.protocol_version, state, first.n_agent_version,
                                                                   settings))
    if seen is not None:
        seen["state"] = state
        seen["heartbeats_since_quick"] = quick
    session.commit()
    return reply


def current_reply(*, session: Session, node_name: str, settings: Settings) -> ServerReply:
    node = session.scalar(select(Node).where(Node.name == node_name))
    if node is None or node_health.must_reregister(node):  # issue 10
        return ServerReply(node=node_name, assignments_digest="", reregister=True)
    reply = _reply(session, node, assignments_for(session, node.name, settings), settings)
    session.commit()
    return reply


def _reply(session: Session, node: Node, assignments: list[Assignment], settings: Settings,
           pending: list | None = None, protocol_version: int | None = None) -> ServerReply:
    """``protocol_version``: the message's (default: the one the node registered with)."""
    version = protocol_version if protocol_version is not None else (node.protocol_version or 1)
    return _server_reply(node.name, assignments, settings,
                         node_health.pending_requests(session, node, runs=pending),  # issue 10
                         quick_every=node_health.own_rounds_every(version, node.state, node.agent_version, settings))


def _server_reply(node: str, assignments: list[Assignment], settings: Settings,
                  validations: list[ValidationRequest], assignments_digest: str | None = None,
                  quick_every: int = 0) -> ServerReply:
    return ServerReply(
        node=node,
        assignments=assignments,
        assignments_digest=digest(assignments) if assignments_digest is None else assignments_digest,
        heartbeat_interval_s=settings.agent.heartbeat_interval_s,
        lost_after_s=settings.agent.lost_after_s,  # issue 13: the agent fences itself before this
        validations=validations,
        quick_every_heartbeats=quick_every,  # issue 12: the agent's own rounds (protocol version 2)
    )




# -- steady heartbeats answered from a cache (issue 12: 1,250 agents at 1 Hz) -------------------


@dataclass(slots=True)
class _Steady:
    reply: ServerReply
    body: bytes  # the reply as JSON, sent as it is
    attempts: list[AttemptStatus]
    state: str
    version: int  # the node topic's version read before the reply was built
    epoch: int
    until: float
    # answers left before the node's quick round is due (a full pass starts it); None: not counted
    # (the agent runs its own rounds, protocol version 2, or the node has none)
    quick_left: int | None
    protocol_version: int  # the heartbeat's that made the entry: another version takes a full pass


@dataclass(slots=True)
class _Beat:
    """A steady heartbeat's liveness, waiting for the next batched write."""

    at: object  # datetime
    state: str
    gpus: list  # GpuMetrics
    quick: int  # heartbeats to add to the node's quick-round count


def _refusal(c: _Steady | None, hb: Heartbeat, *, version: int, epoch: int) -> str | None:
    """Why the entry ``c`` cannot answer ``hb`` (``ReplyCache.miss``'s reasons), or None if it can."""
    if c is None:
        return "none"
    if c.version != version:
        return "notified"
    if c.epoch != epoch:
        return "epoch"
    if c.until <= time.monotonic():
        return "expired"
    if c.quick_left is not None and c.quick_left <= 0:
        return "quick_due"
    if hb.assignments_digest != c.reply.assignments_digest or hb.attempts != c.attempts \
            or hb.protocol_version != c.protocol_version:
        return "report"
    # the agent's own rounds that passed are written behind the answer (protocol version 2); a
    # requested run's result or a failed round takes a full pass
    if hb.validations and not all(node_health.quiet_own_round(r) for r in hb.validations):
        return "report"
    return None


class ReplyCache:
    """Per API process: the last reply of each node whose heartbeat changed nothing. The next
    heartbeat with the same report, echoing that reply's digest, is answered with it without the
    database: its liveness, latest GPU figures and quick-round count are kept in memory and
    written for every such node at once every ``flush_s`` (``flush``: one UPDATE statement,
    executemany in node-name order, then the metric buckets that are due), its GPU figures
    buffered as before. Nothing can have changed the node's assignments meanwhile: every change
    publishes the node's topic (``jobs.transition``, starts, node state changes, validation
    requests), which moves its version; the notifier's epoch moves when notifications may have
    been lost; and an entry lives ``ttl_s`` at most.

    Why ``ttl_s`` can be long (60 s by default since the fan-in's fourth pass; it was 10 s, and the
    entries that ran out were half of the fan-in's full passes): an entry is stale only if a
    change's notification did not reach this process, and each way that happens now moves the
    epoch or is put right: a Redis error on the listener moves it; a subscription that died
    without one (a half-open connection, a Redis restart between reads) is found by the
    notifier's own ticks not coming back (``RedisNotifier.STALE_S``, 5 s) and moves it; a publish
    that failed is sent again (``RedisNotifier.RETRY_S``) instead of dropped. Left to ``ttl_s``:
    a publisher that died between its commit and its publish, or one cut off from Redis longer
    than ``ttl_s`` while this process is not; there a change reaches the agent up to ``ttl_s``
    late, as a missed wake-up would (no state is lost: the database holds the change). Only replies whose assignments all say
    ``run`` and that ask for no validation are kept (a ``stop`` must be released by a full pass,
    a validation answered), and no more answers than leave the quick round un-due.

    Why a node answered this way is never found silent by the reaper: every answer is written
    within ``flush_s`` (while the database takes writes), and the entry it came from was made by
    a full heartbeat that wrote the node's liveness itself: the node's last heartbeat in the
    database is never older than its last answer plus ``flush_s``, however long the entry lives
    (``ttl_s`` may exceed ``lost_after_s``). A batched write only
    touches a node still in the state its entry was made in (a reaper's or an admin's change
    wins, and its notification drops the entry)."""

    def __init__(self, ttl_s: float, *, sessions=None, engine=None, settings: Settings | None = None,  # noqa: ANN001
                 flush_s: float = 1.0) -> None:
        self.ttl_s = ttl_s
        self.flush_s = flush_s
        self._sessions = sessions
        self._engine = engine
        self._settings = settings
        self._entries: dict[str, _Steady] = {}
        self._beats: dict[str, _Beat] = {}
        # the agents' own quick rounds that passed, answered from the cache: (node, start) -> report
        self._rounds: dict[tuple[str, float], ValidationReport] = {}
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hits = 0
        self.flushed = 0  # node rows written by ``flush``
        self.full_passes: dict[str, int] = {}  # why heartbeats were not answered from the cache (``miss``)

    def lookup(self, hb: Heartbeat, *, version: int, epoch: int) -> _Steady | None:
        with self._lock:
            c = self._entries.get(hb.node)
        return c if _refusal(c, hb, version=version, epoch=epoch) is None else None

    def miss(self, hb: Heartbeat, *, version: int, epoch: int) -> str:
        """Why ``lookup`` found no answer for this heartbeat (counted in ``full_passes``; the route
        calls it for each heartbeat it sends through the service): ``none`` (no entry: the node's
        first heartbeat here, or its last reply was not steady), ``notified`` (the node's topic
        moved), ``epoch``, ``expired``, ``quick_due``, ``report`` (validations delivered, another
        digest or another report), ``answered`` (``answer`` refused it: the round fell due)."""
        with self._lock:
            c = self._entries.get(hb.node)
        why = _refusal(c, hb, version=version, epoch=epoch) or "answered"
        with self._lock:
            self.full_passes[why] = self.full_passes.get(why, 0) + 1
        return why

    def store(self, hb: Heartbeat, reply: ServerReply, *, seen: dict | None, version: int, epoch: int) -> None:
        state = (seen or {}).get("state")
        # a heartbeat that delivered validation results may leave a steady reply (the next one,
        # without them, is answered from it): absorbing a passed run changes nothing the reply
        # says, and a failed one changes the node's state, which publishes its topic
        steady = (self.ttl_s > 0 and state is not None and not reply.reregister and not reply.validations
                  and hb.assignments_digest == reply.assignments_digest
                  and state in (NodeState.READY.value, NodeState.DRAINED.value)
                  and all(a.action == DesiredAction.RUN for a in reply.assignments))
        quick_left = None
        every = self._settings.validation.quick_every_heartbeats if self._settings is not None else 0
        if steady and every and state in node_health.ROUND_STATES and node_health.server_rounds(hb.protocol_version):
            quick_left = every - 1 - int(seen.get("heartbeats_since_quick") or 0)
        entry = _Steady(reply, reply.model_dump_json().encode(), list(hb.attempts), state, version, epoch,
                        time.monotonic() + self.lifetime(), quick_left, hb.protocol_version) if steady else None
        with self._lock:
            if entry is not None:
                self._entries[hb.node] = entry
            else:
                self._entries.pop(hb.node, None)

    def lifetime(self) -> float:
        """An entry's life: ``ttl_s`` at most, drawn from its last quarter. Entries made in the same
        second (every node registering at a server's start, a probe invalidating many) would
        otherwise all expire together and come back as a burst of full passes every ``ttl_s``,
        queueing behind each other (the fan-in's p99); a draw per entry spreads them out within a
        few lifetimes, at ~14% more full passes than a fixed ``ttl_s``."""
        return self.ttl_s * (0.75 + 0.25 * random.random())  # noqa: S311 - spreading, not secrecy

    def answer(self, hb: Heartbeat, steady: _Steady) -> bool:
        """A steady heartbeat answered with ``steady``: its liveness noted for the next batched
        write and its GPU figures buffered. False if the entry ran out meanwhile (quick round due)."""
        check_version(hb.protocol_version)
        now = utcnow()
        with self._lock:
            if steady.quick_left is not None:
                if steady.quick_left <= 0:
                    return False
                steady.quick_left -= 1
            prev = self._beats.get(hb.node)
            quick = (prev.quick if prev is not None and prev.state == steady.state else 0) + \
                (1 if steady.quick_left is not None else 0)
            self._beats[hb.node] = _Beat(now, steady.state, hb.gpus or (prev.gpus if prev else []), quick)
            for report in hb.validations:  # own rounds that passed (``_refusal``), kept once per start
                self._rounds[(hb.node, report.started_at)] = report
            self.hits += 1
            if self._thread is None and self._sessions is not None and self.flush_s > 0:
                self._thread = threading.Thread(target=self._run, name="hai-liveness", daemon=True)
                self._thread.start()
        if self._settings is not None and self._engine is not None:
            metrics_store.buffer_heartbeat(engine=self._engine, node=hb.node, gpus=hb.gpus, now=now,
                                           settings=self._settings)
        return True

    def pending(self) -> int:
        with self._lock:
            return len(self._beats)

    def flush(self) -> int:
        """Write the noted liveness of every node (one statement, node-name order), the agents'
        own passed rounds (``node_health.store_own_rounds``) and the metric buckets that are due,
        and commit; returns the node rows written. What cannot be written (the database is down)
        is kept for the next try, unless a newer heartbeat replaced it."""
        with self._flush_lock:
            with self._lock:
                beats, self._beats = self._beats, {}
                rounds, self._rounds = self._rounds, {}
            if self._sessions is None or self._settings is None:
                return 0
            try:
                with self._sessions() as session:
                    written = write_liveness(session=session, beats=beats, settings=self._settings)
                    node_health.store_own_rounds(session, [(node, r) for (node, _), r in sorted(rounds.items())])
                    metrics_store.write_due(session=session, settings=self._settings)
                    session.commit()
            except Exception:
                with self._lock:
                    for name, b in beats.items():
                        self._beats.setdefault(name, b)
                    for key, r in rounds.items():
                        self._rounds.setdefault(key, r)
                raise
            self.flushed += written
            return written

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            try:
                self.flush()
            except Exception as e:  # noqa: BLE001 - logged; the next round retries
                log.warning("writing the liveness of steady heartbeats failed (retrying): %s", str(e)[:300])

    def close(self) -> None:
        """Stop the writer and write what is noted (the API process is stopping)."""
        # one line in the server's log (uvicorn's, which every worker has): what the cache did
        logging.getLogger("uvicorn.error").info(
            "heartbeat reply cache: %s", json.dumps({"answered": self.hits, "full_passes": self.full_passes}))
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            self.flush()
        except Exception:  # noqa: BLE001
            log.exception("writing the liveness of steady heartbeats at shutdown failed")


def write_liveness(*, session: Session, beats: dict[str, _Beat], settings: Settings) -> int:
    """One UPDATE statement for the noted heartbeats: last heartbeat time, the latest GPU figures,
    the quick-round count, each only where the node is still in the state its answer was given in,
    the rows taken in node-name order (as a heartbeat batch takes them). Flushes; the caller
    commits. Returns the rows written.

    PostgreSQL: the batch as one JSON document in one statement (``json_to_recordset``), the GPU
    figures serialised by pydantic in one call per node; SQLite: executemany. The executemany cost
    53 us of the API's CPU per node on PostgreSQL (625 nodes: 33 ms a second per worker at 1,250
    agents; psycopg dumping every row's parameters, ``model_dump`` and ``json.dumps`` of eight GPUs)."""
    if not beats:
        return 0
    if session.get_bind().dialect.name == "postgresql":
        return _write_liveness_pg(session, beats, settings)
    return _write_liveness_each(session, beats, settings)


def _write_liveness_each(session: Session, beats: dict[str, _Beat], settings: Settings) -> int:
    """``write_liveness`` as an executemany (SQLite, and the reference the PostgreSQL statement is
    tested against)."""
    t = Node.__table__
    rows = []
    for name in sorted(beats):
        b = beats[name]
        cols = metrics_store.latest_gpu_columns(b.gpus, settings) if b.gpus else None
        rows.append({"b_name": name, "b_state": b.state, "b_at": b.at, "b_quick": b.quick,
                     "b_metrics": cols["gpu_metrics"] if cols else None,
                     "b_util": cols["gpu_util_pct"] if cols else None,
                     "b_busy": cols["gpus_busy"] if cols else None})
    with_gpus = [r for r in rows if r["b_metrics"] is not None]
    without = [r for r in rows if r["b_metrics"] is None]
    base = {"last_heartbeat_at": bindparam("b_at", type_=t.c.last_heartbeat_at.type),
            "heartbeats_since_quick": t.c.heartbeats_since_quick + bindparam("b_quick")}
    where = (t.c.name == bindparam("b_name"), t.c.state == bindparam("b_state"))
    written = 0
    if with_gpus:
        stmt = update(t).where(*where).values(
            **base, gpu_metrics=bindparam("b_metrics", type_=t.c.gpu_metrics.type),
            gpu_util_pct=bindparam("b_util", type_=t.c.gpu_util_pct.type),
            gpus_busy=bindparam("b_busy", type_=t.c.gpus_busy.type))
        written += session.execute(stmt, with_gpus).rowcount or 0
    if without:
        written += session.execute(update(t).where(*where).values(**base), without).rowcount or 0
    return written


# the batch as one JSON document (one parameter: psycopg's text dumper of arrays escaped every
# element by regex, twice the executemany's cost), its rows locked in name order first
# (``locked``), then written; a node whose state moved since its answer is not matched (its row
# re-checked after the lock, as an UPDATE's WHERE is); a node without GPU figures in the batch
# keeps its own (``has``)
_LIVENESS_PG = text("""
WITH b AS (
  SELECT * FROM json_to_recordset(CAST(:batch AS json))
    AS b(name text, state text, at timestamptz, quick int, has boolean, metrics json, util float8, busy int)
), locked AS (
  SELECT n.id, b.* FROM nodes n JOIN b ON n.name = b.name AND n.state = b.state
  ORDER BY n.name FOR NO KEY UPDATE OF n
)
UPDATE nodes SET last_heartbeat_at = l.at, heartbeats_since_quick = nodes.heartbeats_since_quick + l.quick,
  gpu_metrics = CASE WHEN l.has THEN l.metrics ELSE nodes.gpu_metrics END,
  gpu_util_pct = CASE WHEN l.has THEN l.util ELSE nodes.gpu_util_pct END,
  gpus_busy = CASE WHEN l.has THEN l.busy ELSE nodes.gpus_busy END
FROM locked l WHERE nodes.id = l.id
""")
_GPU_LIST = TypeAdapter(list[GpuMetrics])


def _write_liveness_pg(session: Session, beats: dict[str, _Beat], settings: Settings) -> int:
    busy_at = settings.metrics.busy_util_pct
    parts = []
    for name in sorted(beats):
        b = beats[name]
        head = (f'{{"name":{json.dumps(name)},"state":{json.dumps(b.state)},'
                f'"at":"{b.at.astimezone(timezone.utc).isoformat()}","quick":{int(b.quick)}')
        if b.gpus:
            util, busy = metrics_store.latest_gpu_figures(b.gpus, busy_at)
            parts.append(f'{head},"has":true,"metrics":{_GPU_LIST.dump_json(b.gpus).decode()},'
                         f'"util":{json.dumps(util)},"busy":{int(busy)}}}')
        else:
            parts.append(f'{head},"has":false}}')
    return session.execute(_LIVENESS_PG, {"batch": "[" + ",".join(parts) + "]"}).rowcount or 0
