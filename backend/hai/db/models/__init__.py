"""SQLAlchemy 2 typed models. One module; import from here."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint, event, text,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from hai.db.base import Base, UTCDateTime, utcnow
from hai.protocol.node_state import NodeState


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    group: Mapped[str] = mapped_column(String(64))
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiToken(Base):
    """A bearer credential. Only a hash is stored; the secret is shown once."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), default="user")  # user | agent
    user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), nullable=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # issue 13: a token past this instant is refused (None: never expires)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    user: Mapped[User | None] = relationship(lazy="joined")


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    zone: Mapped[str] = mapped_column(String(64), default="default")
    leaf: Mapped[str] = mapped_column(String(64), default="default")
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    # a NodeState; written only by services.node_state.set_node_state (and create_node)
    state: Mapped[str] = mapped_column(String(16), default=NodeState.READY.value)
    address: Mapped[str] = mapped_column(String(256), default="127.0.0.1")
    fake_gpus: Mapped[bool] = mapped_column(Boolean, default=False)
    gpu_inventory: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    # the agent's GPU numbering: NULL for 0..gpus-1, else its sorted NVML indices (what every
    # scheduling cycle reads, instead of decoding every node's inventory; migration 0013)
    gpu_indices: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    gpu_metrics: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    # issue 11: the latest heartbeat's GPU figures folded at heartbeat time (metrics_store.set_latest_gpus),
    # so the cluster summary and tree read two columns instead of scanning every node's JSON
    gpu_util_pct: Mapped[float | None] = mapped_column(Float, nullable=True)  # mean over the GPUs reporting one
    gpus_busy: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # at or above busy_util_pct
    nics: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    agent_version: Mapped[str] = mapped_column(String(32), default="")
    protocol_version: Mapped[int] = mapped_column(Integer, default=1)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    state_reason: Mapped[str] = mapped_column(String(512), default="")
    # zone/leaf came from a topology file (`--topology`): they win over the agent's labels
    labels_from_topology: Mapped[bool] = mapped_column(Boolean, default=False)
    # issue 10: node health
    state_changed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    state_detail: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # e.g. the failed checks
    # the validation run that must pass before a returning (lost) node takes work again
    return_validation_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    heartbeats_since_quick: Mapped[int] = mapped_column(Integer, default=0)

    events: Mapped[list["NodeEvent"]] = relationship(
        back_populates="node", order_by="NodeEvent.id", cascade="all, delete-orphan", lazy="select"
    )


class NodeEvent(Base):
    """One change of a node's state: when, from, to, who or what, why."""

    __tablename__ = "node_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str] = mapped_column(String(128), default="")  # admin:<name> | validator | reaper | agent
    reason: Mapped[str] = mapped_column(Text, default="")
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    node: Mapped[Node] = relationship(back_populates="events")


class ValidationRun(Base):
    """One validator run on one node (kept forever, newest first in the API)."""

    __tablename__ = "validation_runs"
    __table_args__ = (
        Index("ix_validation_runs_node_id", "node_name", "id"),
        # issue 12 (protocol version 2): an agent's own periodic round is stored once per node and
        # start, however often a heartbeat carrying it is sent again (migration 0017)
        Index("ux_validation_runs_own_round", "node_name", "started_at", unique=True,
              postgresql_where=text("requested_by = 'agent'"), sqlite_where=text("requested_by = 'agent'")),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    node_name: Mapped[str] = mapped_column(String(128))
    level: Mapped[str] = mapped_column(String(8), default="full")  # quick | full
    # manual | undrain | schedule | periodic | return | job_failed | xid
    trigger: Mapped[str] = mapped_column(String(16), default="manual")
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending | passed | failed | expired
    requested_by: Mapped[str] = mapped_column(String(128), default="")
    requested_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    summary: Mapped[str] = mapped_column(Text, default="")

    checks: Mapped[list["ValidationCheck"]] = relationship(
        back_populates="run", order_by="ValidationCheck.position", cascade="all, delete-orphan", lazy="selectin"
    )


class ValidationCheck(Base):
    __tablename__ = "validation_checks"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("validation_runs.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer, default=0)
    name: Mapped[str] = mapped_column(String(64))
    level: Mapped[str] = mapped_column(String(8))
    critical: Mapped[bool] = mapped_column(Boolean, default=False)
    status: Mapped[str] = mapped_column(String(8))  # passed | failed | skipped
    value: Mapped[float | None] = mapped_column(Float, nullable=True)
    threshold: Mapped[float | None] = mapped_column(Float, nullable=True)
    unit: Mapped[str] = mapped_column(String(32), default="")
    detail: Mapped[str] = mapped_column(Text, default="")
    duration_s: Mapped[float] = mapped_column(Float, default=0.0)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)

    run: Mapped[ValidationRun] = relationship(back_populates="checks")


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_state_priority", "state", "priority"),
        # issue 12: the job list's filters, newest first, and the per-user queue limit's count
        Index("ix_jobs_state_id", "state", "id"),
        Index("ix_jobs_user_name_id", "user_name", "id"),
        Index("ix_jobs_user_name_state_id", "user_name", "state", "id"),
        Index("ix_jobs_user_id_state", "user_id", "state"),
        Index("ix_jobs_change_seq", "change_seq"),
        # PostgreSQL: a fifth of each page kept for its rows' new versions, so that a cycle's
        # rewrite of pending reasons and reservations stays in the page and touches no index
        # (HOT updates; migration 0021)
        {"postgresql_with": {"fillfactor": 80}},
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    user_name: Mapped[str] = mapped_column(String(64))
    group: Mapped[str] = mapped_column(String(64))
    command: Mapped[list[str]] = mapped_column(JSON)
    env: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    job_type: Mapped[str] = mapped_column(String(16), default="command")
    nodes: Mapped[int] = mapped_column(Integer, default=1)
    gpus_per_node: Mapped[int] = mapped_column(Integer, default=8)
    priority: Mapped[str] = mapped_column(String(16), default="NORMAL")  # effective
    submitted_priority: Mapped[str] = mapped_column(String(16), default="NORMAL")
    allow_cross_zone: Mapped[bool] = mapped_column(Boolean, default=False)
    max_runtime_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    suspend_grace_s: Mapped[float] = mapped_column(Float, default=60.0)
    log_watchdog_s: Mapped[float | None] = mapped_column(Float, nullable=True)

    # lifecycle; written only by services.jobs.transition
    state: Mapped[str] = mapped_column(String(16), default="queued")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    queued_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    attempt_started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    failure_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)  # 0 until first start
    suspensions: Mapped[int] = mapped_column(Integer, default=0)
    restarts: Mapped[int] = mapped_column(Integer, default=0)  # non-suspension restarts (node lost)

    # scheduler outputs
    pending_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    placement_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    reserved_nodes: Mapped[list[str]] = mapped_column(JSON, default=list)
    master_addr: Mapped[str | None] = mapped_column(String(256), nullable=True)
    master_port: Mapped[int | None] = mapped_column(Integer, nullable=True)

    # suspension / stop protocol
    # a protocol.DesiredAction value (run | suspend | stop); written by services.jobs.transition
    desired_action: Mapped[str] = mapped_column(String(16), default="run")
    suspend_for_job_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    suspend_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    user_suspended: Mapped[bool] = mapped_column(Boolean, default=False)  # held by its owner
    # issue 10: the suspension moves the job off a node (drain | unhealthy), not the scheduler's
    move_cause: Mapped[str | None] = mapped_column(String(16), nullable=True)

    # reported by the job through the SDK
    last_checkpoint: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    lost_gpu_s: Mapped[float] = mapped_column(Float, default=0.0)
    run_s: Mapped[float] = mapped_column(Float, default=0.0)  # sum over finished attempts

    # the change marker (issue 12): on SQLite the database itself sets it, by the triggers of
    # JOB_CHANGE_TRIGGERS, to the next value of ``job_change_counter.seq`` whenever the row is
    # inserted or updated, whoever writes it; the scheduler reads only the queued jobs changed
    # since its last cycle (services/scheduling.QueueCache). Never written by the application;
    # NULL on PostgreSQL, whose scheduler uses each row's xmin instead (QueueCache).
    change_seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    events: Mapped[list["JobEvent"]] = relationship(
        back_populates="job", order_by="JobEvent.id", cascade="all, delete-orphan", lazy="selectin"
    )
    # every attempt's allocations; ``active`` ones hold GPUs now
    allocations: Mapped[list["JobAllocation"]] = relationship(
        back_populates="job", order_by="(JobAllocation.attempt, JobAllocation.node_rank)", lazy="selectin",
        cascade="all, delete-orphan",
    )


class JobEvent(Base):
    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    # the scheduler leader's epoch when a fenced scheduling transaction wrote it (else None)
    epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)

    job: Mapped[Job] = relationship(back_populates="events")


class JobAllocation(Base):
    """GPUs of one node held by one attempt of a job. ``active`` until the attempt releases them."""

    __tablename__ = "job_allocations"
    __table_args__ = (
        UniqueConstraint("job_id", "attempt", "node_rank", name="uq_job_allocations_rank"),
        Index("ix_job_allocations_node_active", "node_name", "active"),
        # issue 12: the node list's aggregate of the active allocations, index-only (migration
        # 0014); a query uses it when it says ``WHERE active`` (``.where(JobAllocation.active)``)
        Index("ix_job_allocations_active", "node_name", postgresql_where=text("active"),
              postgresql_include=["job_id", "gpus"], sqlite_where=text("active = 1")),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    node_name: Mapped[str] = mapped_column(String(128))
    node_rank: Mapped[int] = mapped_column(Integer)
    gpus: Mapped[list[int]] = mapped_column(JSON)
    active: Mapped[bool] = mapped_column(Boolean, default=True)
    # the agent's last report for this attempt on this node (AttemptStatus)
    status: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    released_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # the epoch of the scheduler leader that decided it (services/leader.py)
    epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)

    job: Mapped[Job] = relationship(back_populates="allocations")
    # one row per GPU held while ``active``; deleted with the release (services/reports.release)
    holds: Mapped[list["GpuHold"]] = relationship(
        back_populates="allocation", cascade="all, delete-orphan", passive_deletes=True, lazy="select",
    )


class GpuHold(Base):
    """One GPU held by one active allocation. The unique constraint over (node, GPU) makes
    double allocation impossible in the database itself, whatever the code above it does: a row
    exists only while the GPU is held, and is written and deleted in the same transaction as the
    allocation and its release."""

    __tablename__ = "gpu_holds"
    __table_args__ = (UniqueConstraint("node_name", "gpu", name="uq_gpu_holds_node_gpu"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    allocation_id: Mapped[int] = mapped_column(ForeignKey("job_allocations.id", ondelete="CASCADE"), index=True)
    node_name: Mapped[str] = mapped_column(String(128))
    gpu: Mapped[int] = mapped_column(Integer)  # the agent's GPU index

    allocation: Mapped[JobAllocation] = relationship(back_populates="holds")


class JobChangeCounter(Base):
    """One row (id 1): the last change marker handed out to a job row (``Job.change_seq``).
    SQLite only (its one writer at a time makes the markers increase in commit order)."""

    __tablename__ = "job_change_counter"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, default=0)


# SQLite: every insert and update of a job row takes the next marker (the counter's row is
# written under the database's one write lock, so a reader that saw marker m has seen every
# change with a marker <= m). An update that sets change_seq itself (the triggers' own) does not
# fire again. Created by migration 0015 and, for Base.metadata.create_all, by the listener below.
# A batch migration that copies the jobs table on SQLite drops these: re-create them after it
# (tests/integration/test_migrations.py checks they exist at head).
JOB_CHANGE_TRIGGERS = (
    """CREATE TRIGGER IF NOT EXISTS jobs_change_seq_insert AFTER INSERT ON jobs
BEGIN
  UPDATE job_change_counter SET seq = seq + 1 WHERE id = 1;
  UPDATE jobs SET change_seq = (SELECT seq FROM job_change_counter WHERE id = 1) WHERE id = NEW.id;
END""",
    """CREATE TRIGGER IF NOT EXISTS jobs_change_seq_update AFTER UPDATE ON jobs WHEN NEW.change_seq IS OLD.change_seq
BEGIN
  UPDATE job_change_counter SET seq = seq + 1 WHERE id = 1;
  UPDATE jobs SET change_seq = (SELECT seq FROM job_change_counter WHERE id = 1) WHERE id = NEW.id;
END""",
)
JOB_CHANGE_COUNTER_ROW = "INSERT OR IGNORE INTO job_change_counter (id, seq) VALUES (1, 0)"


class NodeListRevision(Base):
    """One row (id 1): a number the database raises in every transaction that changes what the
    node list shows other than the heartbeats' figures (issue 12): a node added, removed or
    relabelled, its state or reason, an allocation taken, moved or released. ``GET /api/v1/nodes``
    serves a document built at the same revision (services/nodes.NodeListCache), so a change
    committed anywhere (any API replica, the scheduler, an agent's pass, raw SQL) is in the next
    list read after the commit. The heartbeats' own figures (``last_heartbeat_at``,
    ``gpu_util_pct``, ``gpus_busy``) do not raise it: 1,250 agents change them every second."""

    __tablename__ = "node_list_revision"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rev: Mapped[int] = mapped_column(BigInteger, default=0)


# What raises node_list_revision.rev: the node list's columns of `nodes` (not the heartbeat's
# figures) and every column of an allocation that the list's free GPUs and running jobs read.
NODE_LIST_NODE_COLUMNS = ("name", "zone", "leaf", "gpus", "state", "state_reason", "address", "fake_gpus")
NODE_LIST_ALLOCATION_COLUMNS = ("node_name", "job_id", "gpus", "active")
NODE_LIST_REVISION_ROW = "INSERT INTO node_list_revision (id, rev) VALUES (1, 0) ON CONFLICT DO NOTHING"


def _changed(columns: tuple[str, ...], dialect: str, json_columns: tuple[str, ...] = ()) -> str:
    if dialect == "postgresql":  # json has no equality operator: compared as text
        old, new = (", ".join(f"{row}.{c}::text" if c in json_columns else f"{row}.{c}" for c in columns)
                    for row in ("OLD", "NEW"))
        return f"({old}) IS DISTINCT FROM ({new})"
    return " OR ".join(f"OLD.{c} IS NOT NEW.{c}" for c in columns)


def node_list_revision_ddl(dialect: str) -> list[str]:
    """The triggers that raise node_list_revision.rev (created by migration 0016 and, for
    create_all, by the listener below). PostgreSQL: deferred constraint triggers, so the row is
    raised at commit, once per transaction (a transaction-local flag), after every other lock the
    transaction takes (no lock-order cycle with node or job rows; two committing writers queue on
    the one row for the length of a commit). SQLite: plain triggers (one writer at a time)."""
    tables = (("nodes", NODE_LIST_NODE_COLUMNS, ()), ("job_allocations", NODE_LIST_ALLOCATION_COLUMNS, ("gpus",)))
    if dialect == "postgresql":
        ddl = ["""CREATE OR REPLACE FUNCTION hai_node_list_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF coalesce(current_setting('hai.node_list_changed', true), '') <> 'y' THEN
    UPDATE node_list_revision SET rev = rev + 1 WHERE id = 1;
    PERFORM set_config('hai.node_list_changed', 'y', true);
  END IF;
  RETURN NULL;
END $$"""]
        for table, cols, json_cols in tables:  # no CREATE OR REPLACE for constraint triggers: create_all may run twice
            ddl.append(f"DROP TRIGGER IF EXISTS {table}_list_rows ON {table}")
            ddl.append(f"DROP TRIGGER IF EXISTS {table}_list_update ON {table}")
            ddl.append(f"CREATE CONSTRAINT TRIGGER {table}_list_rows AFTER INSERT OR DELETE ON {table} "
                       "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION hai_node_list_changed()")
            ddl.append(f"CREATE CONSTRAINT TRIGGER {table}_list_update AFTER UPDATE OF {', '.join(cols)} ON {table} "
                       f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN ({_changed(cols, dialect, json_cols)}) "
                       "EXECUTE FUNCTION hai_node_list_changed()")
        return ddl
    bump = "BEGIN UPDATE node_list_revision SET rev = rev + 1 WHERE id = 1; END"
    ddl = []
    for table, cols, _json in tables:
        ddl.append(f"CREATE TRIGGER IF NOT EXISTS {table}_list_insert AFTER INSERT ON {table} {bump}")
        ddl.append(f"CREATE TRIGGER IF NOT EXISTS {table}_list_delete AFTER DELETE ON {table} {bump}")
        ddl.append(f"CREATE TRIGGER IF NOT EXISTS {table}_list_update AFTER UPDATE OF {', '.join(cols)} ON {table} "
                   f"WHEN {_changed(cols, dialect)} {bump}")
    return ddl


class QueuedCount(Base):
    """Each user's queued jobs, kept by the database (issue 12): the user's count is the sum of
    ``delta`` over their rows, and of those held by their owner (``user_suspended``) the sum of
    ``held``. Triggers on ``jobs`` append (+1, +1 if held) when a row of the user becomes queued
    (inserted queued, requeued, resumed) and (-1, -1 if it was held) when one stops being queued
    (started, cancelled, deleted), and the two rows of both when a queued job is held or released,
    whoever writes it (a submission, the scheduler, an agent's pass, raw SQL). Appends only: no
    row is updated by a writer, so concurrent writers take no lock of it (a per-user row updated
    in place would be a hot row, and two transactions that touch two users in opposite orders
    would deadlock on it). The scheduler folds the rows into one per user now and then
    (services/queued_counts.py), so a sum reads a handful of rows. The submission's queued-jobs
    limit read ``count(*)`` of the user's queued jobs instead: at 8,000 of them that was 0.86 ms
    of PostgreSQL's CPU a submission (2 ms at 10,000), growing with the user's own queue; and
    every scheduling cycle counted the whole queue's jobs not held, twice (9.5 ms at 10,000)."""

    __tablename__ = "queued_counts"
    __table_args__ = (Index("ix_queued_counts_user_id_delta", "user_id", "delta"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    user_id: Mapped[int] = mapped_column(Integer)
    delta: Mapped[int] = mapped_column(Integer)
    held: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


# the state whose rows queued_counts counts (JobState.QUEUED; the models do not import the domain)
_QUEUED = "'queued'"


def queued_count_ddl(dialect: str) -> list[str]:
    """The triggers that keep queued_counts (created by migrations 0018 and 0019 and, for
    create_all, by the listener below). Row triggers with a WHEN clause: an update that does not
    move a row into or out of the queued state, or hold or release a queued one (a pending
    reason, a heartbeat's progress), runs no trigger code. A batch migration that copies the jobs
    table on SQLite drops them: re-create them after it."""
    if dialect == "postgresql":
        return [
            f"""CREATE OR REPLACE FUNCTION hai_queued_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP <> 'INSERT' AND OLD.state = {_QUEUED} THEN
    INSERT INTO queued_counts (user_id, delta, held) VALUES (OLD.user_id, -1, -OLD.user_suspended::int);
  END IF;
  IF TG_OP <> 'DELETE' AND NEW.state = {_QUEUED} THEN
    INSERT INTO queued_counts (user_id, delta, held) VALUES (NEW.user_id, 1, NEW.user_suspended::int);
  END IF;
  RETURN NULL;
END $$""",
            "DROP TRIGGER IF EXISTS jobs_queued_insert ON jobs",
            "DROP TRIGGER IF EXISTS jobs_queued_update ON jobs",
            "DROP TRIGGER IF EXISTS jobs_queued_delete ON jobs",
            f"CREATE TRIGGER jobs_queued_insert AFTER INSERT ON jobs FOR EACH ROW WHEN (NEW.state = {_QUEUED}) "
            "EXECUTE FUNCTION hai_queued_count()",
            f"CREATE TRIGGER jobs_queued_update AFTER UPDATE OF state, user_id, user_suspended ON jobs FOR EACH ROW "
            f"WHEN ((OLD.state = {_QUEUED} OR NEW.state = {_QUEUED}) AND (OLD.state, OLD.user_id, OLD.user_suspended) "
            "IS DISTINCT FROM (NEW.state, NEW.user_id, NEW.user_suspended)) EXECUTE FUNCTION hai_queued_count()",
            f"CREATE TRIGGER jobs_queued_delete AFTER DELETE ON jobs FOR EACH ROW WHEN (OLD.state = {_QUEUED}) "
            "EXECUTE FUNCTION hai_queued_count()",
        ]
    return [
        "DROP TRIGGER IF EXISTS jobs_queued_insert",
        "DROP TRIGGER IF EXISTS jobs_queued_update",
        "DROP TRIGGER IF EXISTS jobs_queued_delete",
        f"CREATE TRIGGER jobs_queued_insert AFTER INSERT ON jobs WHEN NEW.state = {_QUEUED} "
        "BEGIN INSERT INTO queued_counts (user_id, delta, held) VALUES (NEW.user_id, 1, NEW.user_suspended); END",
        f"CREATE TRIGGER jobs_queued_update AFTER UPDATE OF state, user_id, user_suspended ON jobs "
        f"WHEN (OLD.state = {_QUEUED} OR NEW.state = {_QUEUED}) AND (OLD.state IS NOT NEW.state "
        "OR OLD.user_id IS NOT NEW.user_id OR OLD.user_suspended IS NOT NEW.user_suspended) "
        f"BEGIN INSERT INTO queued_counts (user_id, delta, held) SELECT OLD.user_id, -1, -OLD.user_suspended "
        f"WHERE OLD.state = {_QUEUED}; "
        "INSERT INTO queued_counts (user_id, delta, held) SELECT NEW.user_id, 1, NEW.user_suspended "
        f"WHERE NEW.state = {_QUEUED}; END",
        f"CREATE TRIGGER jobs_queued_delete AFTER DELETE ON jobs WHEN OLD.state = {_QUEUED} "
        "BEGIN INSERT INTO queued_counts (user_id, delta, held) VALUES (OLD.user_id, -1, -OLD.user_suspended); END",
    ]


class NodeSize(Base):
    """How many nodes have each GPU count, kept by the database (issue 12): triggers on ``nodes``
    add one to the row of a node's GPU count when it is inserted, take one away when it is
    deleted, and move it when its ``gpus`` changes, whoever writes (a registration, the
    Kubernetes sync, raw SQL). A submission's admission check (the cluster has enough nodes, a
    node large enough, enough whole nodes of the job's size) reads these few rows instead of
    aggregating every node: at 1,250 nodes that aggregate was a scan of all of them, heartbeat
    figures included, in every submission (PostgreSQL: the submission's statement 0.34 -> 0.19 ms,
    pg_stat_statements; SQLite: a submission 1.16 -> 0.48 ms). Rows are updated in place: they
    change only when nodes come, go or change size, never on a heartbeat. A row may hold 0."""

    __tablename__ = "node_sizes"

    gpus: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    nodes: Mapped[int] = mapped_column(Integer, default=0)


def node_size_ddl(dialect: str) -> list[str]:
    """The triggers that keep node_sizes (created by migration 0020 and, for create_all, by the
    listener below). The update trigger fires only when ``gpus`` changes. A batch migration that
    copies the nodes table on SQLite drops them: re-create them after it."""
    if dialect == "postgresql":
        return [
            """CREATE OR REPLACE FUNCTION hai_node_size() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP <> 'INSERT' THEN
    UPDATE node_sizes SET nodes = nodes - 1 WHERE gpus = OLD.gpus;
  END IF;
  IF TG_OP <> 'DELETE' THEN
    INSERT INTO node_sizes (gpus, nodes) VALUES (NEW.gpus, 1)
      ON CONFLICT (gpus) DO UPDATE SET nodes = node_sizes.nodes + 1;
  END IF;
  RETURN NULL;
END $$""",
            "DROP TRIGGER IF EXISTS nodes_size_insert ON nodes",
            "DROP TRIGGER IF EXISTS nodes_size_update ON nodes",
            "DROP TRIGGER IF EXISTS nodes_size_delete ON nodes",
            "CREATE TRIGGER nodes_size_insert AFTER INSERT ON nodes FOR EACH ROW EXECUTE FUNCTION hai_node_size()",
            "CREATE TRIGGER nodes_size_update AFTER UPDATE OF gpus ON nodes FOR EACH ROW "
            "WHEN (OLD.gpus IS DISTINCT FROM NEW.gpus) EXECUTE FUNCTION hai_node_size()",
            "CREATE TRIGGER nodes_size_delete AFTER DELETE ON nodes FOR EACH ROW EXECUTE FUNCTION hai_node_size()",
        ]
    add = ("INSERT OR IGNORE INTO node_sizes (gpus, nodes) VALUES (NEW.gpus, 0); "
           "UPDATE node_sizes SET nodes = nodes + 1 WHERE gpus = NEW.gpus;")
    remove = "UPDATE node_sizes SET nodes = nodes - 1 WHERE gpus = OLD.gpus;"
    return [
        "DROP TRIGGER IF EXISTS nodes_size_insert",
        "DROP TRIGGER IF EXISTS nodes_size_update",
        "DROP TRIGGER IF EXISTS nodes_size_delete",
        f"CREATE TRIGGER nodes_size_insert AFTER INSERT ON nodes BEGIN {add} END",
        f"CREATE TRIGGER nodes_size_update AFTER UPDATE OF gpus ON nodes WHEN OLD.gpus IS NOT NEW.gpus "
        f"BEGIN {remove} {add} END",
        f"CREATE TRIGGER nodes_size_delete AFTER DELETE ON nodes BEGIN {remove} END",
    ]


class SchedulerLease(Base):
    """Leadership of the scheduler, fenced (services/leader.py): each new leader bumps ``epoch``;
    every transaction that writes scheduling decisions locks this row and checks that its epoch
    is still current and the lease unexpired."""

    __tablename__ = "scheduler_leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(256), default="")
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class LogLine(Base):
    __tablename__ = "log_lines"
    __table_args__ = (
        UniqueConstraint("job_id", "attempt", "rank", "seq", name="uq_log_lines_position"),
        Index("ix_log_lines_job_id_id", "job_id", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(Integer)
    ts: Mapped[float] = mapped_column(Float)
    stream: Mapped[str] = mapped_column(String(8), default="stdout")
    line: Mapped[str] = mapped_column(Text)


class Quota(Base):
    __tablename__ = "quotas"
    __table_args__ = (UniqueConstraint("group", "priority", "user_name", name="uq_quotas_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    group: Mapped[str] = mapped_column(String(64))
    priority: Mapped[str] = mapped_column(String(16))
    user_name: Mapped[str | None] = mapped_column(String(64), nullable=True)
    gpus: Mapped[int] = mapped_column(Integer)


class UserUsage(Base):
    """Each user's decayed GPU usage, for time-sharing order (half-life from settings)."""

    __tablename__ = "user_usage"

    user_name: Mapped[str] = mapped_column(String(64), primary_key=True)
    gpu_s: Mapped[float] = mapped_column(Float, default=0.0)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


from hai.db.models.metrics import GpuSample, GpuStatus, MetricRollup  # noqa: E402

__all__ = [
    "ApiToken", "Base", "GpuHold", "GpuSample", "GpuStatus", "Job", "JobAllocation", "JobEvent", "LogLine", "MetricRollup", "Node",
    "NodeEvent", "NodeListRevision", "NodeSize", "QueuedCount", "Quota", "SchedulerLease", "User", "UserUsage", "ValidationCheck", "ValidationRun",
]


class IdempotencyKey(Base):
    """Issue 13: one ``Idempotency-Key`` a user sent with ``POST /api/v1/jobs``, written in the
    same transaction as the job it created, so a replay after any crash finds the same job."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (UniqueConstraint("user_id", "key", name="uq_idempotency_keys_user_id_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(255))
    # SHA-256 of the normalised request body: the same key with another body is refused
    request_hash: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


@event.listens_for(Base.metadata, "after_create")
def _job_change_triggers(_target, connection, **_kw) -> None:  # noqa: ANN001
    """create_all (tests, tools) gets what migration 0015 creates: the counter's row and, on
    SQLite, the triggers that maintain ``Job.change_seq``; and what migration 0016 creates: the
    node list's revision row and the triggers that raise it; and what migrations 0018 and 0019
    create: the triggers that keep queued_counts; and migration 0020's: those that keep node_sizes."""
    connection.exec_driver_sql(NODE_LIST_REVISION_ROW)
    for ddl in (node_list_revision_ddl(connection.dialect.name) + queued_count_ddl(connection.dialect.name)
                + node_size_ddl(connection.dialect.name)):
        connection.exec_driver_sql(ddl)
    if connection.dialect.name != "sqlite":
        return
    connection.exec_driver_sql(JOB_CHANGE_COUNTER_ROW)
    for ddl in JOB_CHANGE_TRIGGERS:
        connection.exec_driver_sql(ddl)
