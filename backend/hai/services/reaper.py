"""The reaper: nodes whose agent has been silent past agent.lost_after_s become ``lost``; their
GPUs are given up and the jobs that ran there go back to the queue from their last checkpoint
(a restart, not a suspension and not the job's failure). A lost node takes work again only
after its agent is back and a validation passes (services/node_health.on_register).

It runs in two places: the scheduler leader's loop (every cycle) and Celery beat (every 10 s,
so that nodes are reaped while no scheduler runs). Two reapers may therefore run at once, and
one may be stale (a process paused with SIGSTOP, or a transaction that began before a heartbeat
arrived). What keeps that safe (issue 13):

- Each node is reaped in a transaction of its own whose writes are conditional: it locks the
  node row with ``FOR NO KEY UPDATE ... WHERE state != 'lost' AND last_heartbeat_at < cutoff``
  (PostgreSQL re-evaluates that condition on the newest committed row after any wait, so a node
  that has heartbeated since, or that another reaper has just marked lost, is skipped), then the
  jobs of its active allocations (in id order), and reads the allocations again under those
  locks: only an allocation still active is released, and its job requeued only while that
  attempt is still the job's current, active one — never twice. Node, then jobs: the order a
  heartbeat, a registration and a drain take too, so none of them deadlocks with a reap.
- A heartbeat takes the node's row first (services/agents.heartbeat): one that arrives while a
  reap holds it waits, then reads the node lost and answers ``reregister`` instead of the
  assignments the reap took away; one that got the row first commits its heartbeat, and the
  reap then skips the node.
- In the scheduler's loop the transaction is fenced by the leader's lease (services/leader.fence)
  like the cycle's own: a leader paused past its lease cannot reap after it resumes.
- On PostgreSQL the transaction sets ``idle_in_transaction_session_timeout``: a reaper paused
  inside it (holding a node's row) is ended by the server, its writes undone, and the node's
  heartbeats go through.
- SQLite serialises writers (BEGIN IMMEDIATE): each reap sees the latest committed state.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from hai.db.base import utcnow
from hai.db.models import Node
from hai.domain.jobs import ACTIVE_STATES, JobState
from hai.domain.nodes import NodeState
from hai.services import notify
from hai.services.assignments import active_allocations
from hai.services.jobs import publish_after_commit, requeue_as_restart
from hai.services.leader import Lease, fence
from hai.services.node_state import set_node_state
from hai.services.reports import lock_jobs, release
from hai.settings import Settings

# the longest a reaper's transaction may sit idle (paused) before PostgreSQL ends it: its
# statements follow one another at once, and a node's heartbeats wait while it holds the row
IDLE_TIMEOUT_S = 3.0


def _guard(session: Session, lease: Lease | None, idle_timeout_s: float) -> None:
    """First in each reap transaction: the leader's fence (when a lease is given), and on
    PostgreSQL the idle-in-transaction limit."""
    if lease is not None:
        fence(session, lease)  # raises Fenced: a superseded leader reaps nothing
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT set_config('idle_in_transaction_session_timeout', :ms, true)"),
                        {"ms": str(max(1000, int(idle_timeout_s * 1000)))})


def silent_nodes(session: Session, cutoff: datetime) -> list[str]:
    """Names of the nodes silent since before ``cutoff`` and not lost yet (no lock: each is
    checked again under its lock by ``reap_node``)."""
    return list(session.scalars(
        select(Node.name)
        .where(Node.state != NodeState.LOST.value, Node.last_heartbeat_at.is_not(None), Node.last_heartbeat_at < cutoff)
        .order_by(Node.name)
    ))


def reap_node(session: Session, name: str, *, cutoff: datetime, now: datetime, lease: Lease | None = None,
              idle_timeout_s: float = IDLE_TIMEOUT_S, commit: bool = True) -> bool:
    """Mark ``name`` lost if it is still silent since before ``cutoff`` and not lost yet, give
    up its GPUs and requeue its jobs; in one transaction, committed unless ``commit=False``
    (tests hold it open). True when this call marked it lost."""
    _guard(session, lease, idle_timeout_s)
    node = session.scalar(
        select(Node)
        .where(Node.name == name, Node.state != NodeState.LOST.value, Node.last_heartbeat_at.is_not(None),
               Node.last_heartbeat_at < cutoff)
        .with_for_update(key_share=True)  # FOR NO KEY UPDATE: rows that reference it still insert
        .execution_options(populate_existing=True)
    )
    if node is None:  # it heartbeated since, or another reaper got there first
        session.rollback()
        return False
    # the node first, then its jobs: the order of a heartbeat, a registration, a drain
    job_ids = sorted({a.job_id for a in active_allocations(session, name, fresh=True)})
    if job_ids:
        lock_jobs(session, job_ids)
    allocs = active_allocations(session, name, fresh=True)
    late = sorted({a.job_id for a in allocs} - set(job_ids))
    if late:  # placed here meanwhile (the scheduler does not lock nodes): their jobs too
        lock_jobs(session, late)
        allocs = active_allocations(session, name, fresh=True)
    assert node.last_heartbeat_at is not None
    # remember an admin's drain or a fault: the node returns to it, not to ready
    was = {"was": node.state, "was_reason": node.state_reason} if node.state != NodeState.READY.value else {}
    set_node_state(session, node, NodeState.LOST, actor="reaper",
                   reason=f"no heartbeat since {node.last_heartbeat_at.isoformat()}",
                   detail={"silent_since": node.last_heartbeat_at.isoformat(), **was}, now=now)
    node.return_validation_id = None
    for alloc in allocs:
        if not alloc.active:
            continue
        release(alloc, now)
        job = alloc.job
        if alloc.attempt == job.attempt and JobState(job.state) in ACTIVE_STATES:
            requeue_as_restart(session, job, reason=f"node {node.name} was lost; requeued", now=now,
                               pending_reason=f"requeued after node {node.name} was lost")
    publish_after_commit(session, notify.SCHEDULER)
    if commit:
        session.commit()
    return True


def _returning_silent(session: Session, cutoff: datetime):  # noqa: ANN202
    return (Node.state == NodeState.LOST.value, Node.return_validation_id.is_not(None), Node.last_heartbeat_at < cutoff)


def _forget_return_validations(session: Session, cutoff: datetime, lease: Lease | None, idle_timeout_s: float) -> None:
    """A lost node whose agent came back and then went silent again before its validation ended:
    it must register again (conditional, like reap_node)."""
    _guard(session, lease, idle_timeout_s)
    for node in session.scalars(select(Node).where(*_returning_silent(session, cutoff)).with_for_update(key_share=True)):
        node.return_validation_id = None
    session.commit()


def mark_lost_nodes(*, session: Session, settings: Settings, now: datetime | None = None,
                    lease: Lease | None = None) -> list[str]:
    """Reap every node silent past ``agent.lost_after_s``; returns the names this call marked
    lost. ``lease``: the scheduler leader's (each transaction is fenced by it)."""
    now = now or utcnow()
    cutoff = now - timedelta(seconds=settings.agent.lost_after_s)
    names = silent_nodes(session, cutoff)
    returning = session.scalar(select(Node.name).where(*_returning_silent(session, cutoff)).limit(1))
    session.rollback()  # the scan's snapshot is not the reap's
    lost = [name for name in names if reap_node(session, name, cutoff=cutoff, now=now, lease=lease)]
    if returning is not None:
        _forget_return_validations(session, cutoff, lease, IDLE_TIMEOUT_S)
    return lost
