"""Each user's queued jobs, read from ``queued_counts`` (issue 12): the sum of the user's rows,
which the database's triggers append to whenever a job enters or leaves the queued state, or a
queued job is held or released (hai.db.models.QueuedCount). ``queued_of`` is what the
submission's queued-jobs limit reads, ``ready`` what a scheduling cycle counts;
``Folding`` folds the rows into one per user from the scheduler's loop, so that sum stays a few
rows whatever the queue's depth."""

from __future__ import annotations

from sqlalchemy import Integer, bindparam, delete, func, insert, or_, select, text
from sqlalchemy.orm import Session

from hai.db.models import QueuedCount

_counts = QueuedCount.__table__


def queued_of():  # noqa: ANN201
    """The user's (bind parameter ``user_id``) queued jobs, as a scalar subquery: an index-only
    sum over ix_queued_counts_user_id_delta of one folded row and the changes since the fold."""
    return (select(func.coalesce(func.sum(_counts.c.delta), 0))
            .where(_counts.c.user_id == bindparam("user_id", type_=Integer)).scalar_subquery())


def ready():  # noqa: ANN201
    """Every user's queued jobs that are not held (what a scheduling cycle considers), as a
    scalar subquery: the sum over the whole table, a few rows a user once folded."""
    return select(func.coalesce(func.sum(_counts.c.delta - _counts.c.held), 0)).scalar_subquery()


# PostgreSQL: one statement, so the rows it sums are exactly the rows it deletes (a row a
# concurrent transaction commits meanwhile is neither: it stays, to be summed by the next fold);
# a second folder running at once skips the rows the first deleted
_FOLD_POSTGRESQL = text(
    "WITH gone AS (DELETE FROM queued_counts RETURNING user_id, delta, held) "
    "INSERT INTO queued_counts (user_id, delta, held) SELECT user_id, sum(delta), sum(held) FROM gone "
    "GROUP BY user_id HAVING sum(delta) <> 0 OR sum(held) <> 0"
)


def fold(session: Session) -> None:
    """Fold every user's rows into one (none for a user with nothing queued), in the session's
    transaction, and commit. SQLite: under the one write lock, the rows up to the highest id are
    summed, then deleted."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(_FOLD_POSTGRESQL)
    else:
        top = session.scalar(select(func.max(_counts.c.id)))
        if top is not None:
            upto = _counts.c.id <= top
            session.execute(insert(_counts).from_select(
                ["user_id", "delta", "held"],
                select(_counts.c.user_id, func.sum(_counts.c.delta), func.sum(_counts.c.held)).where(upto)
                .group_by(_counts.c.user_id)
                .having(or_(func.sum(_counts.c.delta) != 0, func.sum(_counts.c.held) != 0))))
            session.execute(delete(_counts).where(upto))
    session.commit()


class Folding:
    """When to fold: after ``every`` rows have been appended since the last fold (the highest
    id tells, one index probe), and once when the scheduler starts; on PostgreSQL each fold is
    followed by a ``vacuum``."""

    def __init__(self, every: int = 256) -> None:
        self.every = every
        self.mark: int | None = None  # the highest id right after the last fold

    def maybe(self, sessions, read_sessions=None) -> bool:  # noqa: ANN001
        """Fold when it is time; ``read_sessions`` (SQLite: deferred reads) looks, so a cycle
        that does not fold takes no write lock."""
        with (read_sessions or sessions)() as reading:
            top = reading.scalar(select(func.max(_counts.c.id)))
        if top is None or (self.mark is not None and top - self.mark < self.every):
            return False
        with sessions() as session:
            fold(session)
            self.mark = session.scalar(select(func.max(_counts.c.id))) or top
            session.rollback()  # ends the read (SQLite: releases the database for writers)
            bind = session.get_bind()
        if bind.dialect.name == "postgresql":
            vacuum(bind)
        return True


def vacuum(engine) -> None:  # noqa: ANN001
    """PostgreSQL: VACUUM queued_counts, on a connection of its own in autocommit (a VACUUM runs
    in no transaction). Every fold deletes the rows it sums: until a vacuum, their index entries
    stay, and a submission's sum of its user's rows (a bitmap scan, which never marks an entry
    dead) walks them all: 8,081 entries for 3 live rows, 0.22 ms of a 0.63 ms submission, after
    8,000 submissions (EXPLAIN ANALYZE; autovacuum comes at most once a minute, and a minute at
    800 submissions a second leaves ~50,000). A vacuum of the few pages takes ~1 ms, after every
    fold (every 256 changes). Without truncating the table's empty end pages: that takes the
    table's exclusive lock, which every submission's trigger would wait for."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM (TRUNCATE false) queued_counts")
