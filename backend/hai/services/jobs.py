"""Jobs: submission, queries, user actions and the one place that changes a job's state."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Boolean, Integer, Row, and_, bindparam, case, func, insert, literal, null, or_, select, text, true
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from hai.db.base import utcnow
from hai.db.direct import DirectStatement
from hai.db.models import IdempotencyKey, Job, JobAllocation, JobEvent, NodeSize
from hai.db.session import LoopStatements
from hai.domain.jobs import IllegalTransition, JobState, check_transition
from hai.protocol import DesiredAction
from hai.schemas.jobs import JobCreate
from hai.services import notify, queued_counts
from hai.services.auth import Principal
from hai.services.errors import Conflict, Forbidden, Invalid, NotFound, TooMany

# session.info key: the scheduler leader's epoch, set by services.leader.fence in a fenced
# transaction; the events (and allocations) that transaction writes carry it
SCHEDULER_EPOCH = "scheduler_epoch"


publish_after_commit = notify.publish_after_commit  # re-exported: services import it from here


# -- the state machine ---------------------------------------------------------------------
def transition(session: Session, job: Job, target: JobState, *, reason: str, now: datetime | None = None) -> None:
    """The only writer of ``job.state``: checks legality, records an event, does the bookkeeping
    every change of that kind needs. Flushes; the caller's service commits."""
    now = now or utcnow()
    current = JobState(job.state)
    try:
        check_transition(current, target)
    except IllegalTransition as exc:
        raise Conflict(str(exc)) from exc
    job.state = target.value
    _add_event(session, job, JobEvent(at=now, from_state=current.value, to_state=target.value, reason=reason,
                                      epoch=session.info.get(SCHEDULER_EPOCH)))
    if current.active and not target.active and job.attempt_started_at is not None:
        job.run_s += max(0.0, (now - job.attempt_started_at).total_seconds())
    if target == JobState.STARTING:
        job.attempt += 1
        job.attempt_started_at = now
        job.started_at = job.started_at or now
        job.pending_reason = None
        job.reserved_nodes = []
        job.desired_action = DesiredAction.RUN
    elif target == JobState.QUEUED:
        job.queued_at = now
        job.desired_action = DesiredAction.RUN
        job.suspend_for_job_id = None
        job.suspend_requested_at = None
        job.master_addr = None
        job.master_port = None
    elif target == JobState.SUSPENDING:
        job.desired_action = DesiredAction.SUSPEND
        job.suspend_requested_at = now
    elif target.terminal:
        job.finished_at = now
        job.pending_reason = None
        job.reserved_nodes = []
        job.desired_action = DesiredAction.STOP
    session.flush()
    publish_after_commit(session, notify.SCHEDULER, notify.job_topic(job.id), *_node_topics(job))


def requeue_as_restart(session: Session, job: Job, *, reason: str, pending_reason: str, now: datetime) -> None:
    """The attempt ended for the infrastructure's sake (a node lost or faulty, ranks that fenced
    themselves): back to the queue as a restart, not the job's failure nor a suspension."""
    job.restarts += 1
    job.move_cause = None
    transition(session, job, JobState.QUEUED, reason=reason, now=now)
    job.pending_reason = pending_reason


def _node_topics(job: Job) -> list[str]:
    return [notify.node_topic(a.node_name) for a in job.allocations if a.active]


def record_event(session: Session, job: Job, reason: str, *, now: datetime | None = None) -> None:
    """An event that is not a state change (a demotion, a placement note)."""
    _add_event(session, job, JobEvent(at=now or utcnow(), from_state=job.state, to_state=job.state, reason=reason,
                                      epoch=session.info.get(SCHEDULER_EPOCH)))


def _add_event(session: Session, job: Job, event: JobEvent) -> None:
    """Append to the job's history without reading it: a job loaded without its events (a
    heartbeat's, a cycle's) gets the event queued on its unloaded collection and inserted at the
    next flush, instead of a SELECT of every earlier event first (issue 14's profile)."""
    if "events" in job.__dict__:
        job.events.append(event)
    else:
        event.job = job  # the backref queues it on the unloaded collection; no load
        session.add(event)


# -- submission and queries ----------------------------------------------------------------
def _check_fit(session: Session, spec: JobCreate, count: int, largest: int, whole: int) -> None:
    """Invalid (-> 422, nothing written) when no placement could ever satisfy the job."""
    if spec.nodes > count:
        raise Invalid("nodes", f"the cluster has {count} node(s); the job asks for {spec.nodes}")
    if spec.gpus_per_node > largest:
        raise Invalid("gpus_per_node", f"the largest node has {largest} GPUs; the job asks for {spec.gpus_per_node}")
    if spec.nodes > 1 and whole < spec.nodes:
        sizes = ", ".join(sorted(str(g) for g in session.scalars(select(NodeSize.gpus).where(NodeSize.nodes > 0))))
        raise Invalid(
            "gpus_per_node",
            f"a job of more than one node takes whole nodes: the cluster has {whole} node(s) of "
            f"{spec.gpus_per_node} GPUs (node sizes: {sizes})",
        )


_jobs, _sizes = Job.__table__, NodeSize.__table__


def _cluster_fit():  # noqa: ANN202
    """The cluster-fit figures (nodes, the largest node, nodes of exactly the job's GPUs) from
    node_sizes, a row per GPU count kept by the database's triggers on ``nodes`` (issue 12: an
    aggregate of every node's row: at 1,250 nodes 0.15 ms of PostgreSQL's execution in every
    submission, 0.7 ms of SQLite's)."""
    return (
        func.coalesce(func.sum(_sizes.c.nodes), 0),
        func.coalesce(func.max(case((_sizes.c.nodes > 0, _sizes.c.gpus))), 0),
        func.coalesce(func.sum(case((_sizes.c.gpus == bindparam("gpus_per_node"), _sizes.c.nodes), else_=0)), 0),
    )


def _admission(count_queued: bool):  # noqa: ANN202
    """The cluster-fit aggregate (nodes, the largest node, nodes of exactly the job's GPUs) and,
    when ``count_queued``, the user's queued jobs (the sum of their queued_counts rows, kept by
    the database's triggers: a few rows, not a count of the queue). Built once with bind
    parameters: the compiled statement and its cache key are reused (issue 12)."""
    n_nodes, largest, whole = _cluster_fit()
    columns = [n_nodes.label("n_nodes"), largest.label("largest"), whole.label("whole")]
    if count_queued:
        columns.append(queued_counts.queued_of().label("queued"))
    return select(*columns)


_ADMISSION = {False: _admission(False), True: _admission(True)}
# SQLite's single submission runs its statements on the driver's cursor (hai.db.direct)
_ADMISSION_DIRECT = {k: DirectStatement(stmt, {}) for k, stmt in _ADMISSION.items()}


def check_fits_cluster(session: Session, spec: JobCreate) -> None:
    """Refuse a job no placement could ever satisfy (Invalid -> 422, nothing written). One
    aggregate row, not every node's GPU count (issue 12: at 1,250 nodes that was a query of
    1,250 rows in every submission)."""
    admission_counts(session, spec, user_id=0, count_queued=False)


def admission_counts(session: Session, spec: JobCreate, *, user_id: int, count_queued: bool) -> int | None:
    """One round trip for everything a submission checks before it writes: the cluster fit
    (raises Invalid) and, when ``count_queued``, the user's queued jobs (returned, for the queue
    limit). Issue 12: these were two queries."""
    params = {"gpus_per_node": spec.gpus_per_node, "user_id": user_id}
    row = _ADMISSION_DIRECT[count_queued].one(session.connection(), params)
    _check_fit(session, spec, row[0], row[1], row[2])
    return int(row[3] or 0) if count_queued else None


SUBMITTED = "submitted"  # the reason of a job's first event
_INSERT_EVENT = insert(JobEvent.__table__)
_INSERT_KEY = insert(IdempotencyKey.__table__)
_events, _keys = JobEvent.__table__, IdempotencyKey.__table__


WAITING = "waiting for the scheduler"  # a new job's pending reason

# the columns a submission writes (the rest take their defaults)
_JOB_PARAMS = ("name", "user_id", "user_name", "group", "command", "env", "tags", "job_type", "nodes", "gpus_per_node",
               "priority", "submitted_priority", "allow_cross_zone", "max_runtime_s", "suspend_grace_s",
               "log_watchdog_s", "state", "created_at", "queued_at", "pending_reason")


# the other columns with a Python-side default: the one statement passes them as parameters
# (an INSERT ... SELECT inside a CTE does not fill them in itself)
_DEFAULTED = [c for c in _jobs.c if c.name not in _JOB_PARAMS and c.default is not None]


def _defaulted_values() -> dict:
    """The ``_DEFAULTED`` columns' Python-side defaults, as statements that write them name them."""
    return {c.name: c.default.arg if c.default.is_scalar else c.default.arg(None) for c in _DEFAULTED}


def _job_values(spec: JobCreate, user: Principal, now: datetime) -> dict:
    return dict(
        name=spec.name, user_id=user.user_id, user_name=user.name, group=user.group,
        command=list(spec.command), env=dict(spec.env), tags=list(spec.tags), job_type=spec.job_type.value,
        nodes=spec.nodes, gpus_per_node=spec.gpus_per_node, priority=spec.priority.value,
        submitted_priority=spec.priority.value, allow_cross_zone=spec.allow_cross_zone,
        max_runtime_s=spec.max_runtime_s, suspend_grace_s=spec.suspend_grace_s,
        log_watchdog_s=spec.log_watchdog_s, state=JobState.QUEUED.value, created_at=now, queued_at=now,
        pending_reason=WAITING,
    )


@dataclass(frozen=True)
class KeySeen:
    """The Idempotency-Key was used before, for this job with this request hash: nothing written."""

    job_id: int
    request_hash: str


def check_submitter(user: Principal) -> None:
    """Forbidden unless ``user`` is a user with an id: an agent's token submits no job."""
    if user.kind != "user" or user.user_id is None:
        raise Forbidden("only users can submit jobs")


def _one_statement(with_key: bool):  # noqa: ANN202
    """PostgreSQL: the whole submission as one statement (issue 12, fourth pass): the admission
    aggregate and (with a key) the key's earlier use; the job's INSERT only where both pass; its
    event and its key as data-modifying CTEs; then the figures with the new row (no row: refused,
    and the caller says why from the figures, or answers with the key's job). One statement is
    one transaction: it runs in autocommit, one round trip instead of five or six (BEGIN, the
    key, admission, job, event, COMMIT), and nothing half-written."""
    n_nodes, largest, whole = _cluster_fit()
    adm = select(n_nodes.label("n_nodes"), largest.label("largest"), whole.label("whole"),
                 queued_counts.queued_of().label("queued"))
    figures = [c.name for c in adm.selected_columns]
    if with_key:
        seen = (select(_keys.c.job_id, _keys.c.request_hash)
                .where(_keys.c.user_id == bindparam("user_id"), _keys.c.key == bindparam("key")).subquery())
        adm = adm.add_columns(select(seen.c.job_id).scalar_subquery().label("seen_job_id"),
                              select(seen.c.request_hash).scalar_subquery().label("seen_hash"))
        figures += ["seen_job_id", "seen_hash"]
    adm = adm.cte("adm")
    admitted = [
        bindparam("nodes", type_=Integer) <= adm.c.n_nodes,
        bindparam("gpus_per_node", type_=Integer) <= adm.c.largest,
        or_(~bindparam("multi_node", type_=Boolean), adm.c.whole >= bindparam("nodes", type_=Integer)),
        or_(bindparam("limit", type_=Integer) == 0, adm.c.queued < bindparam("limit", type_=Integer)),
    ]
    if with_key:
        admitted.append(adm.c.seen_job_id.is_(None))
    columns = list(_JOB_PARAMS) + [c.name for c in _DEFAULTED]
    job = insert(_jobs).from_select(
        columns, include_defaults=False,
        select=select(*[bindparam(c, type_=_jobs.c[c].type) for c in columns]).select_from(adm).where(and_(*admitted)),
    ).returning(*_jobs.c).cte("j")
    event = insert(_events).from_select(
        ["job_id", "at", "from_state", "to_state", "reason", "epoch"],
        select(job.c.id, job.c.created_at, null(), literal(JobState.QUEUED.value), literal(SUBMITTED), null()),
    ).cte("e")
    stmt = select(*[adm.c[f] for f in figures], *job.c).select_from(adm.outerjoin(job, true())).add_cte(event)
    if with_key:
        key = insert(_keys).from_select(
            ["user_id", "key", "request_hash", "job_id", "created_at"],
            select(job.c.user_id, bindparam("key"), bindparam("request_hash"), job.c.id, job.c.created_at),
        ).cte("k")
        stmt = stmt.add_cte(key)
    return stmt


def _queue_full(queued: int, limit: int) -> TooMany:
    return TooMany(
        f"you have {queued} queued job(s), the most a user may have (HAI_LIMITS__MAX_QUEUED_JOBS_PER_USER="
        f"{limit}); wait for some to start or cancel some"
    )


def submit_admitted(
    *, session: Session, spec: JobCreate, user: Principal, limit: int, idempotency: tuple[str, str] | None = None,
    commit: bool = True,
) -> Row | KeySeen:
    """A submission with its checks, committed; returns the job's row. With ``idempotency`` (key,
    request hash) a key this user sent before gives KeySeen (nothing written; whatever the checks
    would say now). Refused with nothing written: Invalid (-> 422) when no placement could ever
    fit the job, TooMany (-> 429) when the user has ``limit`` queued jobs already (0: no limit).
    PostgreSQL: one statement, one round trip (``_one_statement``, run on the driver's cursor:
    hai.db.direct); SQLite: the key's look-up,
    ``admission_counts``, ``submit_job``, each statement run on the driver's cursor too. A key committed by a concurrent request in between
    raises IntegrityError (the caller rolls back and looks the key up).

    ``commit=False`` (a group of submissions in one transaction, ``submissions.submit_group``):
    the caller's transaction, begun, is neither committed nor rolled back here; a refusal writes
    nothing of this job and leaves the transaction as it was."""
    check_submitter(user)
    if session.get_bind().dialect.name != "postgresql":
        if idempotency is not None:
            seen = _SEEN_KEY_DIRECT.first(session.connection(), {"user_id": user.user_id, "key": idempotency[0]})
            if seen is not None:
                return KeySeen(job_id=seen.job_id, request_hash=seen.request_hash)
        queued = admission_counts(session, spec, user_id=user.user_id, count_queued=bool(limit))
        if limit and queued is not None and queued >= limit:
            raise _queue_full(queued, limit)
        return submit_job(session=session, spec=spec, user=user, idempotency=idempotency, checked=True, commit=commit)
    # a session that has not begun (the usual case: the credential came from the cache) runs the
    # statement in autocommit, without a BEGIN and a COMMIT round trip; one that has (the token's
    # look-up and its last-used write) commits them together
    options = {} if session.in_transaction() else {"isolation_level": "AUTOCOMMIT"}
    conn = session.connection(execution_options=options)
    row = _DIRECT[idempotency is not None].one(conn, _one_statement_params(spec, user, limit, idempotency))
    if row.id is None:  # nothing was written
        if commit:
            session.rollback()
        if idempotency is not None and row.seen_job_id is not None:
            return KeySeen(job_id=row.seen_job_id, request_hash=row.seen_hash)
        _check_fit(session, spec, row.n_nodes, row.largest, row.whole)
        raise _queue_full(int(row.queued), limit)
    publish_after_commit(session, notify.SCHEDULER)
    if commit:
        session.commit()
    return row


def _one_statement_params(spec: JobCreate, user: Principal, limit: int, idempotency: tuple[str, str] | None) -> dict:
    params = _job_values(spec, user, utcnow())
    params.update(_defaulted_values())
    params.update(multi_node=spec.nodes > 1, limit=limit)
    if idempotency is not None:
        params["key"], params["request_hash"] = idempotency
    return params


async def submit_admitted_on(
    statements: LoopStatements, *, spec: JobCreate, user: Principal, limit: int,
    idempotency: tuple[str, str] | None = None,
) -> Row | None:
    """PostgreSQL, on the event loop: ``submit_admitted``'s one statement run on ``statements``'
    connection (autocommit: it commits itself), no Session. The job's row when it was written;
    None when it was not (refused, or the key seen before): nothing was written, and the caller
    answers as ``submit_admitted`` would (api/jobs.SubmissionGroups: through it). A key committed
    by a concurrent request in between raises IntegrityError, as there. The scheduler's wake-up is
    the caller's to publish."""
    check_submitter(user)
    row = await statements.first(_DIRECT[idempotency is not None], _one_statement_params(spec, user, limit, idempotency))
    return row if row is not None and row.id is not None else None


async def submit_admitted_group_on(
    statements: LoopStatements, submissions: list[tuple[JobCreate, Principal, tuple[str, str] | None]], *, limit: int,
) -> list[Row | None]:
    """PostgreSQL, on the event loop: ``submit_admitted_on`` for each (spec, user, idempotency) of
    ``submissions`` in order, all in one transaction (pipelined: one round trip for the group,
    ``LoopStatements.firsts_in_transaction``), each statement seeing the jobs and keys of those
    before it. For each, the job's row when it was written, None when it was not (refused or the
    key seen before: the caller answers it as ``submit_admitted_on``'s caller does). Every user
    is one who may submit (``check_submitter``: the caller answers the others). A failure (a key
    committed by a concurrent request in between: IntegrityError) writes none of them."""
    rows = await statements.firsts_in_transaction(
        [(_DIRECT[idem is not None], _one_statement_params(spec, user, limit, idem)) for spec, user, idem in submissions])
    return [row if row is not None and row.id is not None else None for row in rows]


def submit_job(
    *, session: Session, spec: JobCreate, user: Principal, idempotency: tuple[str, str] | None = None,
    checked: bool = False, commit: bool = True,
) -> Row:
    """Write a queued job, its 'submitted' event and, with ``idempotency`` (key, request hash),
    its key, all in one transaction, and commit (issue 13: a crash between the commit and the
    response loses nothing). ``checked``: the caller already ran ``admission_counts``.

    Core statements, not the ORM's unit of work (issue 12: the flush was a fifth of a
    submission's CPU), run on the driver's cursor (hai.db.direct: SQLAlchemy's execution of the
    INSERT, its event and the admission's SELECT was 0.17 ms of a SQLite submission's 0.58 ms of
    CPU): returns the job's row (every column, as an attribute). ``commit=False``:
    the caller commits (a group of submissions, ``submit_admitted``)."""
    check_submitter(user)
    if not checked:
        check_fits_cluster(session, spec)
    now = utcnow()
    conn = session.connection()
    # on the driver's cursor (hai.db.direct); the columns' Python-side defaults passed as values
    row = _INSERT_JOB_DIRECT.one(conn, _job_values(spec, user, now) | _defaulted_values())
    _INSERT_EVENT_DIRECT.run(conn, dict(job_id=row.id, at=now, from_state=None, to_state=JobState.QUEUED.value,
                                        reason=SUBMITTED, epoch=None))
    if idempotency is not None:
        key, request_hash = idempotency
        _INSERT_KEY_DIRECT.run(conn, dict(user_id=user.user_id, key=key, request_hash=request_hash, job_id=row.id,
                                          created_at=now))
    publish_after_commit(session, notify.SCHEDULER)
    if commit:
        session.commit()
    return row


_ONE_STATEMENT = {False: _one_statement(False), True: _one_statement(True)}
# run on the driver's cursor (hai.db.direct: SQLAlchemy's per-execute work was as much as
# psycopg's own), the job's columns converted as their types convert them
_DIRECT = {k: DirectStatement(stmt, {c.name: c.type for c in _jobs.c}) for k, stmt in _ONE_STATEMENT.items()}
SEEN_KEY = select(_keys.c.job_id, _keys.c.request_hash).where(
    _keys.c.user_id == bindparam("user_id"), _keys.c.key == bindparam("key"))
_SEEN_KEY_DIRECT = DirectStatement(SEEN_KEY, {})


def _insert_direct(table, columns: list[str], returning: bool) -> DirectStatement:  # noqa: ANN001
    """``table``'s INSERT of exactly ``columns`` (each a bind parameter of its column's type: a
    statement run on the driver's cursor fills in no Python-side default itself)."""
    stmt = insert(table).values({c: bindparam(c, type_=table.c[c].type) for c in columns})
    if returning:
        stmt = stmt.returning(*table.c)
    return DirectStatement(stmt, {c.name: c.type for c in table.c})


_INSERT_JOB_DIRECT = _insert_direct(_jobs, list(_JOB_PARAMS) + [c.name for c in _DEFAULTED], returning=True)
_INSERT_EVENT_DIRECT = _insert_direct(_events, ["job_id", "at", "from_state", "to_state", "reason", "epoch"],
                                      returning=False)
_INSERT_KEY_DIRECT = _insert_direct(_keys, ["user_id", "key", "request_hash", "job_id", "created_at"],
                                    returning=False)


# -- several jobs in one request (issue 12) ------------------------------------------------
_INSERT_JOBS = insert(_jobs).returning(*_jobs.c, sort_by_parameter_order=True)
_SEEN_KEYS = select(_keys.c.key, _keys.c.job_id, _keys.c.request_hash).where(
    _keys.c.user_id == bindparam("user_id"), _keys.c.key.in_(bindparam("keys", expanding=True)))


@functools.cache
def _batch_pg():  # noqa: ANN202
    """PostgreSQL: a batch's jobs and their events as one statement with one parameter, the jobs
    as a JSON document (``json_to_recordset``, the types declared from the table). A multi-row
    INSERT with a placeholder per value (SQLAlchemy's insertmanyvalues) was 2/3 of a 100-job
    batch's CPU: psycopg parses a statement of more than 50 parameters anew each time (its
    query cache stops there), ~20 ms per 100 jobs. The ids are drawn in the batch's order (the
    rows sorted by position before ``nextval``), so the jobs read back by id are in that order."""
    columns = list(_JOB_PARAMS) + [c.name for c in _DEFAULTED]
    dialect = postgresql.dialect()
    declared = ", ".join(f'"{c}" {_jobs.c[c].type.compile(dialect=dialect)}' for c in columns)
    names = ", ".join(f'"{c}"' for c in columns)
    return text(f"""
WITH r AS (
  SELECT * FROM json_to_recordset(CAST(:doc AS json)) AS r(pos int, {declared}) ORDER BY pos
), j AS (
  INSERT INTO jobs (id, {names})
  SELECT nextval(pg_get_serial_sequence('jobs', 'id')), {names} FROM r
  RETURNING *
), e AS (
  INSERT INTO job_events (job_id, at, from_state, to_state, reason)
  SELECT id, created_at, NULL, '{JobState.QUEUED.value}', '{SUBMITTED}' FROM j
)
SELECT * FROM j ORDER BY id"""), columns


def _batch_doc(specs: list[JobCreate], user: Principal, now: datetime, columns: list[str]) -> str:
    defaults = _defaulted_values()
    rows = []
    for pos, spec in enumerate(specs):
        values = _job_values(spec, user, now) | defaults
        rows.append({c: _json_value(values[c]) for c in columns} | {"pos": pos})
    return json.dumps(rows, allow_nan=False)


def _json_value(value: object) -> object:
    """A job column's value as the JSON document carries it: times as ISO 8601, with their zone
    (JobCreate refuses numbers that are not finite, which JSON could not carry)."""
    return value.isoformat() if isinstance(value, datetime) else value


def batch_keys(key: str, n: int) -> list[str]:
    """The idempotency rows of a batch of ``n`` jobs sent with ``key``: the first job's is the key
    itself, each other's the key, a space and the job's position. A key a client sends never holds
    a space (the header's pattern), so these never clash with a single submission's key; a single
    submission that reuses a batch's key finds the first row and its other body (422)."""
    return [key] + [f"{key} {i}" for i in range(1, n)]


def seen_batch(session: Session, *, user_id: int, keys: list[str]) -> list[KeySeen]:
    """The jobs a batch sent before with these keys (``batch_keys``) created, in the batch's order;
    empty if the key is new."""
    seen = {r.key: r for r in session.execute(_SEEN_KEYS, {"user_id": user_id, "keys": keys})}
    return [KeySeen(job_id=seen[k].job_id, request_hash=seen[k].request_hash) for k in keys if k in seen]


def submit_batch(
    *, session: Session, specs: list[JobCreate], user: Principal, limit: int,
    idempotency: tuple[str, str] | None = None,
) -> list[Row] | list[KeySeen]:
    """Several jobs, all queued in one transaction, in order, or none (issue 12: a burst from CI
    or a sweep in one request, as Slurm's job arrays). The checks are a single submission's, for
    every job: Invalid (-> 422, the field named ``jobs.<i>.<field>``) when no placement could ever
    fit a job; TooMany (-> 429) when the user's queued jobs and the batch would exceed ``limit``.
    The cluster's figures are read once per distinct GPUs-per-node of the batch, the user's queued
    jobs once; the jobs and their 'submitted' events are one statement on PostgreSQL
    (``_batch_pg``), two multi-row INSERTs on SQLite, (with ``idempotency``) their keys one more,
    then one commit and one wake-up of the scheduler. With ``idempotency``
    (key, hash of the whole batch) a key sent before gives its jobs as KeySeen, in order
    (nothing written)."""
    check_submitter(user)
    keys = batch_keys(idempotency[0], len(specs)) if idempotency is not None else []
    if idempotency is not None:
        seen = seen_batch(session, user_id=user.user_id, keys=keys)
        if seen:
            return seen
    conn = session.connection()
    figures: dict[int, Row] = {}
    queued = 0
    for i, spec in enumerate(specs):
        row = figures.get(spec.gpus_per_node)
        if row is None:
            count_queued = bool(limit) and not figures  # the user's queued jobs: with the first aggregate
            row = figures[spec.gpus_per_node] = conn.execute(
                _ADMISSION[count_queued], {"gpus_per_node": spec.gpus_per_node, "user_id": user.user_id}).one()
            if count_queued:
                queued = int(row[3] or 0)
        try:
            _check_fit(session, spec, row[0], row[1], row[2])
        except Invalid as exc:
            raise Invalid(f"jobs.{i}.{exc.field}", f"job {i}: {exc.message}") from None
    if limit and queued + len(specs) > limit:
        raise TooMany(
            f"you have {queued} queued job(s) and this batch adds {len(specs)}; a user may have at most {limit} "
            f"(HAI_LIMITS__MAX_QUEUED_JOBS_PER_USER); wait for some to start, cancel some or send fewer"
        )
    now = utcnow()
    if conn.dialect.name == "postgresql":
        statement, columns = _batch_pg()
        rows = conn.execute(statement, {"doc": _batch_doc(specs, user, now, columns)}).all()
    else:
        rows = conn.execute(_INSERT_JOBS, [_job_values(spec, user, now) for spec in specs]).all()
        conn.execute(_INSERT_EVENT, [dict(job_id=r.id, at=now, from_state=None, to_state=JobState.QUEUED.value,
                                          reason=SUBMITTED, epoch=None) for r in rows])
    if idempotency is not None:
        conn.execute(_INSERT_KEY, [dict(user_id=user.user_id, key=k, request_hash=idempotency[1], job_id=r.id,
                                        created_at=now) for k, r in zip(keys, rows, strict=True)])
    publish_after_commit(session, notify.SCHEDULER)
    session.commit()
    return rows


def get_job(*, session: Session, job_id: int, user: Principal, for_update: bool = False) -> Job:
    stmt = select(Job).where(Job.id == job_id)
    if for_update:
        stmt = stmt.with_for_update()
    job = session.scalar(stmt)
    if job is None:
        raise NotFound(f"job {job_id} not found")
    if user.kind == "user" and not user.is_admin and job.user_id != user.user_id:
        raise Forbidden(f"job {job_id} belongs to another user")
    return job


# -- user actions --------------------------------------------------------------------------
def cancel_job(*, session: Session, job_id: int, user: Principal) -> Job:
    job = get_job(session=session, job_id=job_id, user=user, for_update=True)
    transition(session, job, JobState.CANCELLED, reason=f"cancelled by {user.name}")
    session.commit()
    return job


def suspend_job(*, session: Session, job_id: int, user: Principal) -> Job:
    """The owner asks to suspend: a running job checkpoints and goes back to the queue, held; a
    queued job is held. ``resume_job`` releases the hold."""
    job = get_job(session=session, job_id=job_id, user=user, for_update=True)
    state = JobState(job.state)
    if state == JobState.QUEUED:
        if job.user_suspended:
            raise Conflict(f"job {job_id} is already suspended")
        job.user_suspended = True
        job.pending_reason = f"suspended by {user.name}; resume it to queue it again"
        record_event(session, job, f"held in the queue by {user.name}")
    elif state in (JobState.STARTING, JobState.RUNNING):
        job.user_suspended = True
        transition(session, job, JobState.SUSPENDING, reason=f"suspend requested by {user.name}")
    else:
        raise Conflict(f"a job in state '{state.value}' cannot be suspended")
    publish_after_commit(session, notify.SCHEDULER, notify.job_topic(job.id))
    session.commit()
    return job


def resume_job(*, session: Session, job_id: int, user: Principal) -> Job:
    job = get_job(session=session, job_id=job_id, user=user, for_update=True)
    if not job.user_suspended:
        raise Conflict(f"job {job_id} is not suspended by its owner")
    job.user_suspended = False
    if job.state == JobState.QUEUED.value:
        job.pending_reason = "waiting for the scheduler"
    record_event(session, job, f"resumed by {user.name}")
    publish_after_commit(session, notify.SCHEDULER, notify.job_topic(job.id))
    session.commit()
    return job


def placement_of(job: Job) -> list[JobAllocation]:
    """The allocations of the job's latest attempt (where it runs, or ran)."""
    return [a for a in job.allocations if a.attempt == job.attempt]
