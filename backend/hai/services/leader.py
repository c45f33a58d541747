"""One scheduler decides at a time, and leadership is fenced, not only locked.

The ``scheduler_leases`` row holds the current leader (``holder``), its ``epoch`` and when its
lease ends (``expires_at``, on the database's clock). A new leader takes the row over only once
the lease has run out or its holder is known to be gone, and bumps the epoch. Every transaction
that writes scheduling decisions first calls ``fence``: it locks the row (``SELECT ... FOR
UPDATE`` on PostgreSQL; on SQLite every transaction holds the write lock from ``BEGIN
IMMEDIATE``), checks that its epoch is still current and the lease unexpired, renews the lease,
and only then reads the snapshot and writes. A leader that was paused (SIGSTOP) past its lease
or lost its lock connection while another took over therefore cannot commit a single decision
afterwards: its fenced transaction fails (``Fenced``) and rolls back. The rows such a
transaction writes carry its epoch (``job_events.epoch``, ``job_allocations.epoch``).

A leader paused *inside* a fenced transaction holds the row lock; on PostgreSQL the transaction
sets ``idle_in_transaction_session_timeout`` to the lease, so the server ends that session (and
its uncommitted decisions) and the successor's takeover goes through.

Knowing at once that a leader is gone (instead of waiting out its lease): on PostgreSQL the
leader of epoch E holds the session advisory lock (``lock_id``, E) on a connection of its own;
the database releases it when the process dies or that connection drops, so a contender that
can take (``lock_id``, E) knows E's leader is gone. On SQLite (one machine) the holder's
process id is checked.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Callable, Iterator

from sqlalchemy import Connection, select, text, update
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from hai.db.base import utcnow
from hai.db.models import SchedulerLease
from hai.services.context import Platform
from hai.services.jobs import SCHEDULER_EPOCH

log = logging.getLogger(__name__)

LEASE_NAME = "scheduler"


class NotLeader(Exception):
    pass


class Fenced(NotLeader):
    """This scheduler's epoch is no longer current (or its lease ran out): it must not decide."""


@dataclass
class Lease:
    """What a leader knows of its term."""

    name: str
    holder: str
    epoch: int
    lease_s: float
    alive: Callable[[], bool] = lambda: True  # is the liveness lock (PostgreSQL) still held?


def _is_pg(session_or_conn: Session | Connection) -> bool:
    return session_or_conn.get_bind().dialect.name == "postgresql" if isinstance(session_or_conn, Session) \
        else session_or_conn.dialect.name == "postgresql"


def db_now(session: Session) -> datetime:
    """The database's clock on PostgreSQL (one clock for every replica), else this machine's."""
    if _is_pg(session):
        return session.execute(text("SELECT clock_timestamp()")).scalar_one()
    return utcnow()


def fence(session: Session, lease: Lease) -> None:
    """Call first in a transaction that writes scheduling decisions: lock the lease row, raise
    ``Fenced`` unless ``lease`` is still the current, unexpired term, and renew it. The lock is
    held until the transaction ends, so no new leader can take over while it writes. One
    statement: a conditional UPDATE checks, locks and renews at once."""
    if _is_pg(session):
        ms = max(1000, int(lease.lease_s * 1000))
        renewed = session.execute(text(
            "UPDATE scheduler_leases SET expires_at = clock_timestamp() + make_interval(secs => :s) "
            "WHERE name = :n AND epoch = :e AND holder = :h AND expires_at > clock_timestamp() "
            # a leader paused inside this transaction: the server ends it after the lease
            "RETURNING set_config('idle_in_transaction_session_timeout', :ms, true)"
        ), {"s": lease.lease_s, "n": lease.name, "e": lease.epoch, "h": lease.holder, "ms": str(ms)}).all()
    else:  # SQLite: this transaction holds the database's write lock since BEGIN IMMEDIATE
        now = utcnow()
        renewed = session.execute(
            update(SchedulerLease)
            .where(SchedulerLease.name == lease.name, SchedulerLease.epoch == lease.epoch,
                   SchedulerLease.holder == lease.holder, SchedulerLease.expires_at > now)
            .values(expires_at=now + timedelta(seconds=lease.lease_s))
            .returning(SchedulerLease.epoch)
        ).all()
    if not renewed:
        row = session.execute(
            select(SchedulerLease.epoch, SchedulerLease.holder, SchedulerLease.expires_at)
            .where(SchedulerLease.name == lease.name)
        ).one_or_none()
        if row is None or row.epoch != lease.epoch or row.holder != lease.holder:
            current = f"epoch {row.epoch} of {row.holder}" if row is not None else "no lease"
            raise Fenced(f"epoch {lease.epoch} superseded ({current})")
        raise Fenced(f"the lease of epoch {lease.epoch} ran out at {row.expires_at.isoformat()}")
    session.info[SCHEDULER_EPOCH] = lease.epoch


def renew(session: Session, lease: Lease) -> None:
    """Call last in a fenced transaction, before its commit: extend the lease from now. The
    transaction holds the lease row since ``fence``, so no successor can have taken over since;
    a cycle that ran longer than the lease (the first one placing 1,000 jobs on a loaded machine,
    issue 14's benchmark) no longer finds its own lease run out at the next cycle and fences itself
    off. A session the server ended meanwhile (a leader paused inside it) fails here and commits
    nothing."""
    if _is_pg(session):
        stmt = text("UPDATE scheduler_leases SET expires_at = clock_timestamp() + make_interval(secs => :s) "
                    "WHERE name = :n AND epoch = :e AND holder = :h")
        n = session.execute(stmt, {"s": lease.lease_s, "n": lease.name, "e": lease.epoch, "h": lease.holder}).rowcount
    else:
        n = session.execute(
            update(SchedulerLease)
            .where(SchedulerLease.name == lease.name, SchedulerLease.epoch == lease.epoch,
                   SchedulerLease.holder == lease.holder)
            .values(expires_at=utcnow() + timedelta(seconds=lease.lease_s))
        ).rowcount
    if n != 1:
        raise Fenced(f"epoch {lease.epoch} superseded while its transaction ran")


def current_lease(session: Session, name: str = LEASE_NAME) -> SchedulerLease | None:
    return session.get(SchedulerLease, name)


# -- taking and giving up leadership -------------------------------------------------------
def _holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _pid_gone(holder: str) -> bool:
    """SQLite (one machine): the holder's process no longer exists."""
    host, _, rest = holder.partition(":")
    pid_s = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_s.isdigit():
        return False
    try:
        os.kill(int(pid_s), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class _PgLiveness:
    """The leader of epoch E holds the advisory lock (key, E) on this connection."""

    def __init__(self, conn: Connection, key: int) -> None:
        self.conn, self.key = conn, key

    def _one(self, sql: str, **params: int) -> bool:
        value = bool(self.conn.execute(text(sql), params).scalar())
        self.conn.commit()
        return value

    def try_lock(self, epoch: int) -> bool:
        return self._one("SELECT pg_try_advisory_lock(:k, :e)", k=self.key, e=epoch)

    def unlock(self, epoch: int) -> None:
        self._one("SELECT pg_advisory_unlock(:k, :e)", k=self.key, e=epoch)

    def holder_gone(self, epoch: int) -> bool:
        if self.try_lock(epoch):
            self.unlock(epoch)
            return True
        return False

    def holds(self, epoch: int) -> bool:
        try:
            return self._one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND pid = pg_backend_pid() AND classid = :k AND objid = :e AND objsubid = 2",
                k=self.key, e=epoch,
            )
        except DBAPIError:
            return False


def _try_take(platform: Platform, liveness: _PgLiveness | None, holder: str) -> int | None:
    """One attempt to become the leader; the new epoch, or None while another leads."""
    settings = platform.settings.scheduler
    with platform.sessions() as s:
        try:
            if liveness is not None:
                s.execute(text("SET LOCAL lock_timeout = '2s'"))  # a paused leader's fenced
                # transaction holds the row until the server ends it; wait for it in steps
            row = s.scalars(
                select(SchedulerLease).where(SchedulerLease.name == LEASE_NAME).with_for_update()
            ).one_or_none()
            now = db_now(s)
            if row is None:
                row = SchedulerLease(name=LEASE_NAME, holder="", epoch=0, expires_at=now)
                s.add(row)
                s.flush()
        except (IntegrityError, DBAPIError) as exc:
            log.debug("leader lease busy: %s", exc)
            s.rollback()
            return None
        free = (
            not row.holder
            or row.expires_at <= now
            or (liveness.holder_gone(row.epoch) if liveness is not None else _pid_gone(row.holder))
        )
        if not free:
            s.rollback()
            return None
        epoch = row.epoch + 1
        # hold the new epoch's liveness lock before the epoch is visible to anyone
        if liveness is not None and not liveness.try_lock(epoch):
            s.rollback()
            return None
        previous = (row.epoch, row.holder)
        row.epoch, row.holder = epoch, holder
        row.expires_at = now + timedelta(seconds=settings.lease_s)
        try:
            s.commit()
        except DBAPIError:
            s.rollback()
            if liveness is not None:
                liveness.unlock(epoch)
            return None
        if previous[1]:
            log.info("scheduler: took over from epoch %d (%s)", *previous)
        return epoch


def _give_up(platform: Platform, lease: Lease) -> None:
    """End our lease now (if it is still ours) so that a successor need not wait it out."""
    try:
        with platform.sessions() as s:
            s.execute(
                update(SchedulerLease)
                .where(SchedulerLease.name == lease.name, SchedulerLease.epoch == lease.epoch,
                       SchedulerLease.holder == lease.holder)
                .values(expires_at=db_now(s))
            )
            s.commit()
    except Exception:
        log.warning("could not give up the scheduler lease of epoch %d", lease.epoch, exc_info=True)


@contextmanager
def leadership(platform: Platform, *, stop: threading.Event, poll_s: float = 1.0) -> Iterator[Lease]:
    """Block until this process leads (or ``stop`` is set: raises NotLeader), hold it inside.
    The ``Lease`` it yields goes to ``fence`` in every decision transaction."""
    engine = platform.engine
    settings = platform.settings.scheduler
    holder = _holder_id()
    pg = engine.dialect.name == "postgresql"
    with engine.connect() if pg else nullcontext() as conn:
        liveness = None
        if pg:
            assert conn is not None
            conn.execute(text("SELECT set_config('application_name', :n, false)"), {"n": f"hai-scheduler-lock {holder}"})
            conn.commit()
            liveness = _PgLiveness(conn, settings.lock_id)
        announced = False
        while True:
            epoch = _try_take(platform, liveness, holder)
            if epoch is not None:
                break
            if not announced:
                log.info("another scheduler leads; waiting for the lock")
                announced = True
            if stop.wait(poll_s):
                raise NotLeader("stopped while waiting for leadership")
        lease = Lease(name=LEASE_NAME, holder=holder, epoch=epoch, lease_s=settings.lease_s,
                      alive=(lambda: liveness.holds(epoch)) if liveness is not None else (lambda: True))
        log.info("scheduler: leading (epoch %d, %s)", epoch, holder)
        try:
            yield lease
        finally:
            _give_up(platform, lease)
            if liveness is not None:
                try:
                    liveness.unlock(epoch)
                except DBAPIError:
                    pass  # the connection is gone, and the lock with it
