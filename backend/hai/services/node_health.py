"""Node health (issue 10): admin drain and undrain, validator runs and what their results mean,
and moving jobs off a node at their checkpoint.

- Drain: the node leaves scheduling; its jobs are asked to suspend at their checkpoint boundary
  (the existing handshake) with ``job.move_cause`` set, so the suspension requeues them without
  counting a suspension (their place in line, the first-submission FIFO key, is kept). The node
  becomes ``drained`` once no allocation holds GPUs there.
- Validator runs are rows; the agent learns of pending ones in each heartbeat reply and answers
  in a later heartbeat. A failed critical check makes the node ``unhealthy`` at once and moves
  its jobs; jobs that failed there within ``validation.fault_window_s`` are requeued as restarts.
- Undrain runs the full suite first and refuses (409, the failed checks named) unless ``force``.
  In Kubernetes mode (virtual agents run no validators) it checks the Kubernetes Node instead:
  Ready -> the node is back and uncordoned; NotReady or missing -> 409.
- A lost node whose agent comes back takes work again only after a passing validation.

Every node state change goes through services.node_state.set_node_state.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta

from sqlalchemy import insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from hai.db.base import utcnow
from hai.db.models import Job, JobAllocation, Node, ValidationCheck, ValidationRun
from hai.domain.jobs import JobState
from hai.domain.nodes import HOLDING_STATES, NodeState, failed_critical, failure_reason
from hai.protocol import AGENT_ROUNDS_VERSION, GpuInfo, ValidationReport, ValidationRequest, round_phase
from hai.services import notify
from hai.services.assignments import active_allocations
from hai.services.auth import Principal
from hai.services.context import Platform
from hai.services.errors import ChecksFailed, Conflict, NotFound
from hai.services.jobs import publish_after_commit, requeue_as_restart, transition
from hai.services.node_state import set_node_state
from hai.settings import Settings, get_settings

log = logging.getLogger(__name__)

MOVE_DRAIN = "drain"
MOVE_UNHEALTHY = "unhealthy"
PENDING = "pending"
FINISHED = ("passed", "failed", "expired")


# The Kubernetes backend's virtual agents (AgentHello.agent_version) run no validators: on those
# nodes the kubelet and the device plugin watch the hardware (a Node NotReady becomes unhealthy),
# so no rounds are requested there, a lost node returns without a validation run, and an undrain
# without force checks that the Kubernetes Node is Ready instead of waiting for a run.
VIRTUAL_AGENT_VERSION = "kubernetes"


def runs_validators(node: Node) -> bool:
    return node.agent_version != VIRTUAL_AGENT_VERSION


_NEW_RUNS = "hai.validation_runs_requested"  # session.info: nodes given a run in this transaction


def has_pending_run():  # noqa: ANN201
    """A column expression for ``select(Node, has_pending_run())``: whether the node has a run
    waiting for its agent (the heartbeat reads it with the node and skips the runs' query)."""
    return (select(ValidationRun.id).where(ValidationRun.node_name == Node.name, ValidationRun.status == PENDING)
            .exists().label("has_pending_run"))


def validation_topic(run_id: int) -> str:
    return f"validation:{run_id}"


# -- queries -------------------------------------------------------------------------------
def get_node(session: Session, name: str, *, for_update: bool = False) -> Node:
    stmt = select(Node).where(Node.name == name)
    if for_update:
        stmt = stmt.with_for_update()
    node = session.scalar(stmt)
    if node is None:
        raise NotFound(f"node {name} not found")
    return node


def list_validations(*, session: Session, name: str, limit: int = 50) -> list[ValidationRun]:
    get_node(session, name)
    return list(session.scalars(
        select(ValidationRun).where(ValidationRun.node_name == name).order_by(ValidationRun.id.desc()).limit(limit)
    ))


def latest_validation(session: Session, name: str) -> ValidationRun | None:
    return session.scalar(
        select(ValidationRun).where(ValidationRun.node_name == name, ValidationRun.status.in_(FINISHED))
        .order_by(ValidationRun.id.desc()).limit(1)
    )


def get_validation(*, session: Session, run_id: int) -> ValidationRun:
    run = session.get(ValidationRun, run_id)
    if run is None:
        raise NotFound(f"validation run {run_id} not found")
    return run


def _pending_run(session: Session, node: Node) -> ValidationRun | None:
    return session.scalar(
        select(ValidationRun).where(ValidationRun.node_name == node.name, ValidationRun.status == PENDING)
        .order_by(ValidationRun.id).limit(1)
    )


def _connected(node: Node, settings: Settings, now: datetime) -> bool:
    return node.last_heartbeat_at is not None and node.last_heartbeat_at >= now - timedelta(
        seconds=settings.agent.lost_after_s)


# -- runs ----------------------------------------------------------------------------------
def request_validation(session: Session, node: Node, *, level: str, trigger: str, requested_by: str,
                       now: datetime | None = None, wake: bool = True) -> ValidationRun:
    """A new run for the node's agent (helper: flushes). The agent sees it in its next reply;
    ``wake`` answers its long poll at once (periodic rounds wait for the poll's end)."""
    run = ValidationRun(node_name=node.name, level=level, trigger=trigger, status=PENDING,
                        requested_by=requested_by, requested_at=now or utcnow(), summary="", checks=[])
    session.add(run)
    session.flush()
    session.info.setdefault(_NEW_RUNS, set()).add(node.name)
    if wake:
        publish_after_commit(session, notify.node_topic(node.name))
    return run


def validate_node(*, session: Session, name: str, user: Principal, level: str = "full") -> ValidationRun:
    node = get_node(session, name)
    run = request_validation(session, node, level=level, trigger="manual", requested_by=f"admin:{user.name}")
    session.commit()
    return run


def pending_runs(session: Session, node: Node) -> list[ValidationRun]:
    return list(session.scalars(
        select(ValidationRun).where(ValidationRun.node_name == node.name, ValidationRun.status == PENDING)
        .order_by(ValidationRun.id)
    ))


def pending_requests(session: Session, node: Node, *, now: datetime | None = None,
                     runs: list[ValidationRun] | None = None) -> list[ValidationRequest]:
    """The runs the node's agent should run (every reply lists them until they are answered);
    ``runs``: the node's pending runs, when the caller has just read them."""
    now = now or utcnow()
    if runs is None:
        runs = pending_runs(session, node)
    if not runs:
        return []
    inventory = [GpuInfo.model_validate(g) for g in (node.gpu_inventory or [])]
    for run in runs:
        if run.delivered_at is None:
            run.delivered_at = now
    return [ValidationRequest(run_id=r.id, level=r.level, expected_gpus=inventory) for r in runs]  # type: ignore[arg-type]


def report_rows(report: ValidationReport) -> tuple[dict, list[dict], list[dict]]:
    """What storing a finished run writes: the run's columns (status, summary, start and finish),
    its check rows (``validation_checks`` without ``run_id``) and the checks as the protocol
    gives them. Shared by the ORM pass (``_store_report``) and the heartbeat's Core pass
    (``agents._quiet_heartbeat``), which must write the same."""
    checks = [c.model_dump(mode="json") for c in report.checks]
    rows = [
        # issue 13: a name or unit longer than its column (64, 32) is cut, never a failed heartbeat
        # (PostgreSQL refuses the insert, the agent re-sends the report: its node goes lost)
        dict(position=i, name=c["name"][:64], level=c["level"], critical=c["critical"], status=c["status"],
             value=c.get("value"), threshold=c.get("threshold"), unit=(c.get("unit") or "")[:32],
             detail=c.get("detail") or "", duration_s=c.get("duration_s") or 0.0, data=c.get("data") or {})
        for i, c in enumerate(checks)
    ]
    failed = failed_critical(checks)
    counts = {s: sum(1 for c in checks if c["status"] == s) for s in ("passed", "failed", "skipped")}
    run = {
        "status": "failed" if failed else "passed",
        "summary": (failure_reason(failed) if failed else
                    f"{counts['passed']} passed, {counts['failed']} failed (not critical), {counts['skipped']} skipped"),
        "started_at": _at(report.started_at),
        "finished_at": _at(report.finished_at),
    }
    return run, rows, checks


def _at(epoch_s: float) -> datetime:
    """A report's time (seconds since the epoch, the agent's clock) as the database keeps it."""
    return datetime.fromtimestamp(epoch_s, tz=utcnow().tzinfo)


def _store_report(run: ValidationRun, report: ValidationReport) -> list[dict]:
    values, rows, checks = report_rows(report)
    run.checks = [ValidationCheck(**r) for r in rows]
    for k, v in values.items():
        setattr(run, k, v)
    return checks


def _failed_body(checks: list[dict]) -> list[dict]:
    return [{"name": f.name, "value": f.value, "threshold": f.threshold, "unit": f.unit, "detail": f.detail}
            for f in failed_critical(checks)]


# -- the agent's own periodic quick rounds (issue 12, protocol version 2) ----------------------
# With protocol version 1 the server counts each node's heartbeats and asks for its quick round in
# a reply; the agent answers in a later heartbeat: two full heartbeat passes a round, every
# ``quick_every_heartbeats`` (at 1,250 nodes and 30 heartbeats, ~83 a second: half of the fan-in's
# full passes). From version 2 the reply gives the agent the period and the agent runs its rounds
# itself; a round that passed is stored as a run (trigger ``periodic``, requested by ``agent``)
# behind a cached answer (``agents.ReplyCache``, with the liveness it writes in batches) or in the
# heartbeat's Core pass; one that failed goes the ORM way and acts as a requested round does.
OWN_ROUND_BY = "agent"  # ValidationRun.requested_by of an agent's own round
# the states in which a node runs periodic quick rounds (the server counts them, version 1, or
# the reply gives the agent their period, version 2)
ROUND_STATES = (NodeState.READY.value, NodeState.DRAINING.value, NodeState.DRAINED.value)


def server_rounds(protocol_version: int) -> bool:
    """Whether the server counts the node's heartbeats and asks for its periodic quick rounds
    (agents of protocol version 1); from version 2 the agent runs them."""
    return protocol_version < AGENT_ROUNDS_VERSION


def own_rounds_every(protocol_version: int, state: str, agent_version: str | None, settings: Settings) -> int:
    """What a reply gives as ``quick_every_heartbeats``: the period of the agent's own rounds on
    a node where the server would count them (ready, draining, drained; a real agent of version 2),
    else 0."""
    if server_rounds(protocol_version) or agent_version == VIRTUAL_AGENT_VERSION or state not in ROUND_STATES:
        return 0
    return settings.validation.quick_every_heartbeats


def quiet_own_round(report: ValidationReport) -> bool:
    """An own round that changes nothing but the node's run history: no critical check failed and
    no hardware Xid was seen (either acts on the node: ``absorb_reports``)."""
    return report.run_id is None and not any(
        (c.critical and c.status == "failed") or (c.name == "gpu_xid" and c.data.get("hardware"))
        for c in report.checks)


def _own_run(node_name: str, values: dict) -> dict:
    return dict(node_name=node_name, level="quick", trigger="periodic", requested_by=OWN_ROUND_BY,
                requested_at=values["started_at"], delivered_at=values["started_at"], **values)


def store_own_rounds(session: Session, rounds: list[tuple[str, ValidationReport]]) -> int:
    """Store passed own rounds (node name, report) in Core: one multi-row INSERT of the runs that
    skips a round already stored (the unique index over node and start of migration 0017: a
    report sent again), one of their checks. Returns the runs written; the caller commits."""
    if not rounds:
        return 0
    vr, vc = ValidationRun.__table__, ValidationCheck.__table__
    runs, checks = [], {}
    for node_name, report in rounds:
        values, rows, _ = report_rows(report)
        runs.append(_own_run(node_name, values))
        checks[(node_name, values["started_at"])] = rows
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(vr).values(runs).on_conflict_do_nothing().returning(vr.c.id, vr.c.node_name, vr.c.started_at)
    written = session.execute(stmt).all()
    rows = [dict(r, run_id=w.id) for w in written for r in checks[(w.node_name, w.started_at)]]
    if rows:
        session.execute(insert(vc), rows)
    return len(written)


def _absorbed_run(session: Session, node: Node, report: ValidationReport) -> ValidationRun | None:
    """The run a report answers: the node's pending run of its id, or for an own round (no id) a
    new periodic run, unless that round is stored already (None: nothing to absorb)."""
    if report.run_id is not None:
        run = session.get(ValidationRun, report.run_id)
        return run if run is not None and run.node_name == node.name and run.status == PENDING else None
    if not runs_validators(node):
        return None
    started = _at(report.started_at)
    if session.scalar(select(ValidationRun.id).where(
            ValidationRun.node_name == node.name, ValidationRun.requested_by == OWN_ROUND_BY,
            ValidationRun.started_at == started)) is not None:
        return None
    run = ValidationRun(**_own_run(node.name, {"started_at": started}), status=PENDING, summary="", checks=[])
    session.add(run)
    return run


def absorb_reports(session: Session, node: Node, reports: list[ValidationReport], *, settings: Settings,
                   now: datetime) -> None:
    """Store the agent's finished runs (replay-safe: a run is absorbed once) and act on them."""
    for report in reports:
        run = _absorbed_run(session, node, report)
        if run is None:
            continue
        checks = _store_report(run, report)
        session.flush()
        publish_after_commit(session, validation_topic(run.id))
        state = NodeState(node.state)
        if run.status == "failed":
            failed = _failed_body(checks)
            reason = failure_reason(failed_critical(checks))
            detail = {"run_id": run.id, "failed_checks": failed}
            if state in (NodeState.READY, NodeState.DRAINING, NodeState.DRAINED) or (
                state == NodeState.LOST and node.return_validation_id == run.id
            ):
                set_node_state(session, node, NodeState.UNHEALTHY, actor="validator",
                               reason=f"validation run {run.id} ({run.level}): {reason}", detail=detail, now=now)
                node.return_validation_id = None
                move_jobs_off(session, node, cause=MOVE_UNHEALTHY, reason=f"node {node.name} is unhealthy", now=now)
                requeue_recent_failures(session, node, window_s=settings.validation.fault_window_s, now=now)
        elif state == NodeState.LOST and node.return_validation_id == run.id:
            node.return_validation_id = None
            _return(session, node, run, now)
        if run.level == "quick" and hardware_xid(checks) and _pending_run(session, node) is None:
            request_validation(session, node, level="full", trigger="xid", requested_by="validator", now=now)


def _return(session: Session, node: Node, run: ValidationRun | None, now: datetime) -> None:
    """A lost node passed its return validation (``run`` None: a virtual agent, which runs none):
    back to ready, or to the drain or fault it was in when it went silent (only an undrain brings
    those back)."""
    before = node.state_detail or {}
    was = before.get("was")
    passed = (f"the agent is back and validation run {run.id} passed" if run is not None else
              "the Kubernetes backend reports the node again (Kubernetes watches its health: no validation run)")
    if was == NodeState.UNHEALTHY.value:
        set_node_state(session, node, NodeState.UNHEALTHY, actor="validator", now=now,
                       reason=f"{passed}; still unhealthy: {before.get('was_reason', '')}", detail=before)
    elif was in (NodeState.DRAINING.value, NodeState.DRAINED.value):
        set_node_state(session, node, NodeState.DRAINED, actor="validator", now=now,
                       reason=before.get("was_reason") or f"{passed}; still drained")
    else:
        set_node_state(session, node, NodeState.READY, actor="validator", reason=passed, now=now)


def hardware_xid(checks: list[dict]) -> bool:
    return any(c["name"] == "gpu_xid" and (c.get("data") or {}).get("hardware") for c in checks)


def expire_runs(*, session: Session, settings: Settings, now: datetime | None = None) -> int:
    """Runs no agent answered within validation.run_expire_s are marked expired."""
    now = now or utcnow()
    cutoff = now - timedelta(seconds=settings.validation.run_expire_s)
    runs = list(session.scalars(
        select(ValidationRun).where(ValidationRun.status == PENDING, ValidationRun.requested_at < cutoff)
    ))
    for run in runs:
        run.status = "expired"
        run.finished_at = now
        run.summary = f"the agent did not answer within {settings.validation.run_expire_s:g}s"
        publish_after_commit(session, validation_topic(run.id))
    session.commit()
    return len(runs)


def schedule_full_round(*, session: Session, settings: Settings, now: datetime | None = None) -> list[int]:
    """The scheduled full suite (Celery beat, validation.full_every_s): one run per connected
    node that is in service or drained and has none pending."""
    now = now or utcnow()
    ids = []
    for node in session.scalars(select(Node).order_by(Node.name)):
        if NodeState(node.state) in (NodeState.LOST, NodeState.UNHEALTHY) or not _connected(node, settings, now) \
                or not runs_validators(node):
            continue
        if _pending_run(session, node) is None:
            ids.append(request_validation(session, node, level="full", trigger="schedule",
                                          requested_by="schedule", now=now).id)
    session.commit()
    return ids


# -- agent protocol hooks (called by services/agents.py) ----------------------------------
def must_reregister(node: Node) -> bool:
    """A lost node's agent must hand in its inventory again (unless it already has and its
    return validation is pending)."""
    return node.state == NodeState.LOST.value and node.return_validation_id is None


def on_register(session: Session, node: Node, *, settings: Settings, now: datetime) -> None:
    if node.state != NodeState.LOST.value or node.return_validation_id is not None:
        return
    if not (node.state_detail or {}).get("silent_since"):  # listed by a topology file, first agent
        set_node_state(session, node, NodeState.READY, actor="agent", reason="agent registered", now=now)
        return
    if not runs_validators(node):
        _return(session, node, None, now)
        return
    run = request_validation(session, node, level=settings.validation.return_level, trigger="return",
                             requested_by="agent", now=now)
    node.return_validation_id = run.id
    node.state_reason = f"the agent is back; validation run {run.id} must pass before it takes work"


def quick_phase(name: str, settings: Settings) -> int:
    """Heartbeats by which a new node's first quick round comes later than ``quick_every_heartbeats``
    (0 to every - 1, from its name: stable across API processes). Nodes registering in the same
    second would otherwise run their rounds in the same second ever after: at 100 fan-in agents
    that burst of full passes was the heartbeats' whole p99 (1.1-1.7 s; 38 ms with rounds off)."""
    return round_phase(name, settings.validation.quick_every_heartbeats)


def on_heartbeat(session: Session, node: Node, reports: list[ValidationReport], *, settings: Settings,
                 now: datetime, pending: list[ValidationRun] | None = None, maybe_pending: bool = True,
                 counts_rounds: bool = True) -> bool:
    """After the agent's report is reconciled: absorb validator results, start the periodic
    quick round, keep moving jobs off a node out of service, settle draining -> drained.
    True when a job on the node may have changed (the node's assignments must be rebuilt).
    ``pending``: a list this fills with the node's pending runs afterwards (one query for the
    round and the reply); ``maybe_pending`` False: the node had none when the heartbeat read it
    (``has_pending_run``), so without reports or a run requested since, there is none to read;
    ``counts_rounds`` False: the node's agent runs its own periodic rounds (``server_rounds``)."""
    moved: list[int] = []
    if reports:
        absorb_reports(session, node, reports, settings=settings, now=now)
    if maybe_pending or reports or node.name in session.info.get(_NEW_RUNS, ()):
        runs = pending_runs(session, node)
    else:
        runs = []
    state = NodeState(node.state)
    every = settings.validation.quick_every_heartbeats
    # a heartbeat that delivers results does not count: rounds follow the agent's own rhythm
    # (from protocol version 2 the agent runs them itself: ``server_rounds``)
    if every and counts_rounds and not reports and state in ROUND_STATES and runs_validators(node):
        if not runs:  # count only while no run is waiting
            node.heartbeats_since_quick = (node.heartbeats_since_quick or 0) + 1
        if node.heartbeats_since_quick >= every:
            node.heartbeats_since_quick = 0
            runs.append(request_validation(session, node, level="quick", trigger="periodic",
                                           requested_by="validator", now=now, wake=False))
    if state in (NodeState.DRAINING, NodeState.UNHEALTHY):
        # a job placed from a snapshot older than the drain: move it too
        moved = move_jobs_off(session, node, cause=MOVE_DRAIN if state == NodeState.DRAINING else MOVE_UNHEALTHY,
                              reason=node.state_reason, now=now)
    settle(session, node, now=now)
    if pending is not None:
        pending[:] = runs
    return bool(reports) or bool(moved)


def settle(session: Session, node: Node, *, now: datetime) -> None:
    if node.state == NodeState.DRAINING.value and not active_allocations(session, node.name):
        set_node_state(session, node, NodeState.DRAINED, actor="platform",
                       reason=node.state_reason or "drained", detail=node.state_detail, now=now)


# -- moving jobs ---------------------------------------------------------------------------
def move_jobs_off(session: Session, node: Node, *, cause: str, reason: str, now: datetime) -> list[int]:
    """Ask every job running on the node to suspend at its checkpoint; the suspension requeues
    it (absorb_move) so it resumes elsewhere."""
    moved = []
    for alloc in active_allocations(session, node.name):
        job = alloc.job
        if alloc.attempt != job.attempt or job.state not in (JobState.STARTING.value, JobState.RUNNING.value):
            continue
        job.move_cause = cause
        job.suspend_for_job_id = None
        transition(session, job, JobState.SUSPENDING, reason=f"moving off node {node.name}: {reason}", now=now)
        moved.append(job.id)
    return moved


def _nodes_of(job: Job) -> list[str]:
    return [a.node_name for a in job.allocations if a.attempt == job.attempt]


def absorb_move(session: Session, job: Job, *, ready: bool, forced_reason: str | None, now: datetime) -> bool:
    """Hook of services/agents._suspended: a suspension that moved the job off a node requeues it
    without counting a suspension (not the job's nor its owner's doing). False: not a move."""
    if job.move_cause is None:
        return False
    where = ", ".join(_nodes_of(job))
    ckpt = job.last_checkpoint or {}
    if ready:
        reason = f"moved off node {where} ({job.move_cause}) at its checkpoint"
        if ckpt.get("step") is not None:
            reason += f" (step {ckpt['step']})"
    else:
        reason = f"moved off node {where} ({job.move_cause}); stopped without a checkpoint ({forced_reason})"
    job.move_cause = None
    transition(session, job, JobState.QUEUED, reason=reason, now=now)
    job.pending_reason = ("suspended by its owner; resume it to queue it again" if job.user_suspended
                          else f"moved off node {where}; waiting to resume elsewhere")
    return True


def _faulty_node(session: Session, names: list[str], *, window_s: float, now: datetime) -> Node | None:
    """A node of ``names`` that is unhealthy, or whose validation failed within the window."""
    nodes = list(session.scalars(select(Node).where(Node.name.in_(names)).order_by(Node.name)))
    for node in nodes:
        if node.state == NodeState.UNHEALTHY.value:
            return node
    recent = session.scalar(
        select(ValidationRun.node_name).where(
            ValidationRun.node_name.in_(names), ValidationRun.status == "failed",
            ValidationRun.finished_at >= now - timedelta(seconds=window_s),
        ).limit(1)
    )
    return next((n for n in nodes if n.name == recent), None)


def on_job_failing(session: Session, job: Job, *, reason: str, settings: Settings, now: datetime) -> bool:
    """Hook of services/agents._fail, before a job is failed. Ranks killed by a node's fault end
    the attempt, and the job is requeued from its last checkpoint as a restart, never the user's
    failure (True: requeued, do not fail it). Otherwise the nodes where a rank died get a quick
    round at once: a hardware Xid found there makes the node unhealthy, requeues this job
    (requeue_recent_failures) and asks for the full suite."""
    node = _faulty_node(session, _nodes_of(job), window_s=settings.validation.fault_window_s, now=now)
    if node is not None:
        _requeue_restart(session, job, node, reason, now)
        return True
    died = sorted({a.node_name for a in job.allocations if a.attempt == job.attempt and a.status
                   and any(r.get("state") == "exited" and r.get("exit_code") not in (0, None)
                           for r in a.status.get("ranks", []))})
    for n in session.scalars(select(Node).where(Node.name.in_(died)).order_by(Node.name)):
        if n.state != NodeState.LOST.value and runs_validators(n) and _pending_run(session, n) is None:
            request_validation(session, n, level="quick", trigger="rank_died", requested_by="validator", now=now)
    return False


def _requeue_restart(session: Session, job: Job, node: Node, reason: str, now: datetime) -> None:
    job.exit_code = None
    job.failure_reason = None
    requeue_as_restart(session, job, now=now,
                       reason=f"{reason}; node {node.name} is faulty ({node.state_reason}): requeued from its last "
                              "checkpoint as a restart, not the job's failure",
                       pending_reason=f"requeued after node {node.name} was found faulty")
    job.finished_at = None


def requeue_recent_failures(session: Session, node: Node, *, window_s: float, now: datetime) -> list[int]:
    """Jobs that failed on this node within the window before it was found faulty: requeued."""
    jobs = list(session.scalars(
        select(Job).where(
            Job.state == JobState.FAILED.value, Job.finished_at >= now - timedelta(seconds=window_s),
            Job.id.in_(select(JobAllocation.job_id).where(JobAllocation.node_name == node.name)),
        ).order_by(Job.id)
    ))
    out = []
    for job in jobs:
        if node.name in _nodes_of(job):
            _requeue_restart(session, job, node, f"failed: {job.failure_reason}", now)
            out.append(job.id)
    return out


# -- admin actions -------------------------------------------------------------------------
def drain_node(*, session: Session, name: str, reason: str, user: Principal, now: datetime | None = None) -> Node:
    now = now or utcnow()
    node = get_node(session, name, for_update=True)
    state = NodeState(node.state)
    if state != NodeState.READY:
        raise Conflict(f"node {name} is {state.value} ({node.state_reason}); only a ready node can be drained")
    actor = f"admin:{user.name}"
    text = f"drained by {user.name}: {reason}"
    if active_allocations(session, node.name):
        set_node_state(session, node, NodeState.DRAINING, actor=actor, reason=text, now=now)
        move_jobs_off(session, node, cause=MOVE_DRAIN, reason=text, now=now)
    else:
        set_node_state(session, node, NodeState.DRAINED, actor=actor, reason=text, now=now)
    session.commit()
    _mirror_cordon(name, text)
    return node


def _mirror_cordon(name: str, reason: str | None, settings: Settings | None = None) -> None:
    """HAI_EXECUTOR=kubernetes: a drain cordons the Kubernetes Node too (reason None: uncordon).
    Called after the platform's change is committed (the platform's state is the truth)."""
    if (settings or get_settings()).executor != "kubernetes":
        return
    from hai.integrations.kubernetes import backend as k8s  # the only place that talks to Kubernetes

    if reason is None:
        k8s.uncordon(name)
    else:
        k8s.cordon(name, reason)


def _kubernetes_node_health(name: str) -> tuple[bool, str]:
    from hai.integrations.kubernetes import backend as k8s  # the only place that talks to Kubernetes

    return k8s.node_health(name)


def undrain_node(*, platform: Platform, name: str, force: bool, user: Principal) -> str:
    """Bring a drained, draining or unhealthy node back. Without ``force`` the full suite runs on
    the node first (this call waits for it, up to validation.undrain_timeout_s) and a critical
    failure refuses with ChecksFailed. Returns the node's name."""
    settings = platform.settings
    actor = f"admin:{user.name}"
    with platform.sessions() as session:
        node = get_node(session, name, for_update=True)
        state = NodeState(node.state)
        if state not in HOLDING_STATES:
            raise Conflict(f"node {name} is {state.value}; only a draining, drained or unhealthy node can be undrained")
        if force:
            set_node_state(session, node, NodeState.READY, actor=actor,
                           reason=f"undrained by {user.name} (forced: validation skipped)", detail={"forced": True})
            session.commit()
            _mirror_cordon(name, None, settings)
            return name
        if not runs_validators(node) and settings.executor == "kubernetes":
            # Kubernetes mode: no validators run there; the Node's own health decides
            healthy, why = _kubernetes_node_health(name)
            if not healthy:
                raise Conflict(f"node {name} stays out of service: {why}; use force to undrain anyway")
            set_node_state(session, node, NodeState.READY, actor=actor, detail={"kubernetes": why},
                           reason=f"undrained by {user.name}: Kubernetes mode, no validation run ({why})")
            session.commit()
            _mirror_cordon(name, None, settings)
            return name
        if not _connected(node, settings, utcnow()):
            raise Conflict(f"node {name}'s agent is not connected, so it cannot be validated; use force to skip")
        run = request_validation(session, node, level="full", trigger="undrain", requested_by=actor)
        run_id = run.id
        topic = validation_topic(run_id)
        since = platform.notifier.version(topic)
        session.commit()
    deadline = time.monotonic() + settings.validation.undrain_timeout_s
    while True:
        with platform.sessions() as session:
            run = get_validation(session=session, run_id=run_id)
            status = run.status
            if status in FINISHED:
                checks = [{"name": c.name, "critical": c.critical, "status": c.status, "value": c.value,
                           "threshold": c.threshold, "unit": c.unit, "detail": c.detail} for c in run.checks]
                break
        left = deadline - time.monotonic()
        if left <= 0:
            raise Conflict(f"validation run {run_id} on node {name} did not finish within "
                           f"{settings.validation.undrain_timeout_s:g}s; the node stays out of service")
        platform.notifier.wait(topic, since, min(1.0, left))
        since = platform.notifier.version(topic)
    if status != "passed":
        failed = _failed_body(checks)
        raise ChecksFailed(f"node {name} stays out of service: validation run {run_id} {status}"
                           + (f" ({failure_reason(failed_critical(checks))})" if failed else ""), failed)
    with platform.sessions() as session:
        node = get_node(session, name, for_update=True)
        if NodeState(node.state) in HOLDING_STATES:
            set_node_state(session, node, NodeState.READY, actor=actor,
                           reason=f"undrained by {user.name}: validation run {run_id} passed",
                           detail={"run_id": run_id})
        session.commit()
    _mirror_cordon(name, None, settings)
    return name
