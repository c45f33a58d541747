"""Applying an agent's report: store each attempt's status on its allocation, take in the
job's checkpoints and progress, release the GPUs of nodes where the attempt is over, and carry
out what the reports mean for each job (``hai.domain.outcomes``) through ``jobs.transition``.

Reconciling a report is idempotent: the agent sends the full state of every attempt it holds.
GPUs stay held (allocation ``active``) until the agent says the ranks on that node are gone.
Helpers here only flush; the calling service commits.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, lazyload, object_session, selectinload
from sqlalchemy.orm.attributes import set_committed_value

from hai.db.models import GpuHold, Job, JobAllocation
from hai.domain import outcomes
from hai.domain.jobs import JobState
from hai.domain.outcomes import AttemptReports, NodeReport, Outcome, RankReport, Verdict
from hai.protocol import Assignment, AttemptStatus, DesiredAction
from hai.services import node_health
from hai.services.assignments import expected_ranks
from hai.services.jobs import record_event, requeue_as_restart, transition
from hai.settings import get_settings


def node_report(alloc: JobAllocation, status: AttemptStatus) -> NodeReport:
    return NodeReport(
        node=alloc.node_name,
        node_rank=alloc.node_rank,
        ranks=tuple(RankReport(rank=r.rank, running=r.state == "running", exit_code=r.exit_code) for r in status.ranks),
        launch_error=status.launch_error,
        suspend_ready=status.suspend_ready,
        stopped_reason=status.stopped_reason,
        stop_cause=status.stop_cause,
        finished=status.finished,
    )


def attempt_reports(job: Job) -> AttemptReports:
    """The facts of the job's current attempt: one NodeReport per node that has reported."""
    allocs = [a for a in job.allocations if a.attempt == job.attempt]
    return AttemptReports(
        state=JobState(job.state),
        expected_ranks=expected_ranks(job),
        nodes=len(allocs),
        reports=tuple(node_report(a, AttemptStatus.model_validate(a.status)) for a in allocs if a.status),
    )


_LOCKED = "reports.locked_jobs"  # session.info: (transaction, ids of the jobs it has locked)


def lock_jobs(session: Session, job_ids: list[int]) -> dict[int, Job]:
    """Lock these jobs' rows (in id order: no deadlock between two such transactions) and
    reload them and their allocations as committed now (PostgreSQL; SQLite serialises writers).
    Returns those it locked now, by id. The reloaded allocations get their job set: a lazy ``alloc.job`` after
    this reload would carry ``populate_existing`` and read the job, its events and its
    allocations once more (issue 14's profile). Events are not loaded (``jobs._add_event``).

    Jobs this transaction has locked already (a batch of heartbeats locks every job its reports
    change first, in one statement) are neither locked nor reloaded again: nobody else can have
    changed them since, and the reload would be one more query per node of the batch."""
    session.flush()
    txn, locked = session.info.get(_LOCKED, (None, set()))
    if txn is not session.get_transaction():
        locked = set()
    job_ids = [i for i in job_ids if i not in locked]
    if not job_ids:
        return {}
    session.info[_LOCKED] = (session.get_transaction(), locked | set(job_ids))
    jobs = {j.id: j for j in session.scalars(
        select(Job).where(Job.id.in_(sorted(job_ids))).order_by(Job.id).with_for_update()
        .options(selectinload(Job.allocations), lazyload(Job.events)).execution_options(populate_existing=True)
    )}
    for job in jobs.values():  # the reloaded allocations point at their job without another load
        for alloc in job.allocations:
            set_committed_value(alloc, "job", job)
    return jobs


def release(alloc: JobAllocation, now: datetime) -> None:
    """The allocation's GPUs are free again: inactive, and its ``gpu_holds`` rows deleted in
    the same transaction (the unique index over held GPUs admits them to another job): one
    DELETE, without loading the rows first."""
    alloc.active = False
    alloc.released_at = now
    session = object_session(alloc)
    if session is None or alloc.id is None or "holds" in alloc.__dict__:
        alloc.holds.clear()  # loaded (or not yet flushed): the unit of work deletes them
        return
    stmt = delete(GpuHold).where(GpuHold.allocation_id == alloc.id)
    if any(isinstance(o, GpuHold) for o in session.new):  # holds not inserted yet: flush them first
        session.execute(stmt)
        return
    with session.no_autoflush:  # no pending change bears on these rows (issue 14's profile: a flush each)
        session.execute(stmt)


def apply_reports(
    session: Session, allocs: list[JobAllocation], attempts: list[AttemptStatus], *, now: datetime
) -> set[tuple[int, int]]:
    """Take in a node's report (every attempt it holds) against the node's active allocations
    ``allocs`` and judge the jobs it concerns. Returns the reported (job, attempt) keys."""
    active = {(a.job_id, a.attempt): a for a in allocs}
    # issue 13: the nodes of a multi-node job report in concurrent transactions (several API
    # servers, or threads); each judging the job from the others' last committed reports, none
    # saw every rank exited and the job stayed running for ever (and "starting -> running" was
    # written twice). A report that changes something locks its job first, then re-reads the
    # job and its allocations: the second transaction waits for the first and sees its report.
    changed = sorted({a.job_id for s in attempts if (a := active.get((s.job_id, s.attempt))) is not None
                      and a.status != s.model_dump(mode="json")})
    if changed:
        lock_jobs(session, changed)
    touched: dict[int, Job] = {}
    reported = set()
    for status in attempts:
        key = (status.job_id, status.attempt)
        reported.add(key)
        alloc = active.get(key)
        if alloc is None or not alloc.active:
            continue  # not ours any more: the agent stops what it is not assigned
        new = status.model_dump(mode="json")
        unchanged = new == alloc.status
        before = set((alloc.status or {}).get("storage_errors") or [])
        alloc.status = new
        job = alloc.job
        for msg in status.storage_errors:  # issue 13: a full disk, told by the SDK, as a job event
            if msg not in before:
                record_event(session, job, f"storage full on node {alloc.node_name}: {msg}", now=now)
        _absorb(job, status)
        if node_report(alloc, status).done_with(expected_ranks(job)):
            release(alloc, now)
        elif unchanged and job.state == JobState.RUNNING.value and alloc.attempt == job.attempt:
            # the same report as last time for a running job: it was judged then, and what other
            # nodes report is judged when they report it (the common steady-state heartbeat)
            continue
        touched[job.id] = job
    for job in touched.values():
        evaluate_job(session, job, now=now)
    session.flush()
    return reported


def release_unreported_stops(
    session: Session,
    assigned: list[tuple[JobAllocation, Assignment]],
    reported: set[tuple[int, int]],
    *,
    now: datetime,
) -> tuple[list[tuple[JobAllocation, Assignment]], bool]:
    """The agent holds exactly these assignments (its digest matches) and does not report
    their ``stop`` attempts: nothing of them runs on the node any more, so their GPUs are
    released. Returns the assignments left, and whether a job's state changed meanwhile (its
    other assignments may then read differently)."""
    gone = [alloc for alloc, a in assigned if a.action == DesiredAction.STOP and (a.job_id, a.attempt) not in reported]
    if not gone:
        return assigned, False
    lock_jobs(session, sorted({alloc.job_id for alloc in gone}))  # issue 13: as in apply_reports
    gone = [alloc for alloc in gone if alloc.active]
    for alloc in gone:
        release(alloc, now)
    jobs = {alloc.job_id: alloc.job for alloc in gone}
    changed = [evaluate_job(session, jobs[j], now=now) for j in sorted(jobs)]
    session.flush()
    left = [(alloc, a) for alloc, a in assigned if alloc.active]
    return left, any(o is not None for o in changed)


def _absorb(job: Job, status: AttemptStatus) -> None:
    if status.checkpoint is not None:
        cur = job.last_checkpoint or {}
        if cur.get("at") is None or status.checkpoint.at > cur["at"]:
            job.last_checkpoint = status.checkpoint.model_dump(mode="json")
    if status.progress is not None and status.attempt == job.attempt:
        cur = job.progress or {}
        if cur.get("at") is None or status.progress.at >= cur["at"]:
            job.progress = status.progress.model_dump(mode="json")


def evaluate_job(session: Session, job: Job, *, now: datetime) -> Outcome | None:
    """Derive the job's state from its current attempt's per-node reports; returns the outcome
    carried out (None: nothing changes yet)."""
    state = JobState(job.state)
    if state.terminal or state == JobState.QUEUED:
        return None
    outcome = outcomes.judge(attempt_reports(job))
    if outcome is None:
        return None
    if outcome.verdict == Verdict.FAILED:
        # issue 10: ranks killed by a faulty node end the attempt as a restart, not the job's failure
        if node_health.on_job_failing(session, job, reason=outcome.reason, settings=get_settings(), now=now):
            return outcome
        job.exit_code = outcome.exit_code
        job.failure_reason = outcome.reason
        transition(session, job, JobState.FAILED, reason=outcome.reason, now=now)
    elif outcome.verdict == Verdict.SUCCEEDED:
        job.exit_code = 0
        transition(session, job, JobState.SUCCEEDED, reason=outcome.reason, now=now)
    elif outcome.verdict == Verdict.SUSPENDED:
        _suspended(session, job, outcome, now=now)
    elif outcome.verdict == Verdict.REQUEUED:  # as the reaper requeues a lost node's jobs
        requeue_as_restart(session, job, reason=outcome.reason, now=now,
                           pending_reason="requeued: " + outcome.reason.removesuffix("; requeued"))
    else:
        transition(session, job, outcome.target, reason=outcome.reason, now=now)
    return outcome


def _suspended(session: Session, job: Job, outcome: Outcome, *, now: datetime) -> None:
    # issue 10: a move off a drained/unhealthy node requeues without counting a suspension
    if node_health.absorb_move(session, job, ready=outcome.at_checkpoint, forced_reason=outcome.forced_reason,
                               now=now):
        return
    ckpt = job.last_checkpoint or {}
    attempt_start = job.attempt_started_at.timestamp() if job.attempt_started_at else now.timestamp()
    reason, lost = outcomes.suspension_reason(
        outcome, checkpoint_step=ckpt.get("step"), safe_at=max(ckpt.get("at") or 0.0, attempt_start),
        now=now.timestamp(), gpus=job.nodes * job.gpus_per_node,
    )
    job.lost_gpu_s += lost
    job.suspensions += 1
    transition(session, job, JobState.QUEUED, reason=reason, now=now)
    if job.user_suspended:
        job.pending_reason = "suspended by its owner; resume it to queue it again"
    else:
        job.pending_reason = "suspended; waiting to resume"
