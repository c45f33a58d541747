"""queued_counts.held: the queued jobs held by their owner, kept by the same triggers (issue 12)

Every scheduling cycle counted the queued jobs that are not held, twice (the quiet-cycle check
and the queue cache's check on PostgreSQL): a visit of every queued row for ``user_suspended``,
9.5 ms of PostgreSQL at 10,000 queued, per cycle. The triggers of 0018 now also append the held
part of each change (``held``: +1 / -1 when a held job enters or leaves the queue, and a pair
of rows when a queued job is held or released), so the queue's jobs not held are
``sum(delta) - sum(held)`` over a table of a few rows. The held jobs queued at the upgrade are
counted into one row per user.

Revision ID: 0019
Revises: 0018
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# as hai.db.models.queued_count_ddl at this revision (copied: a migration does not change when
# the models do)
_POSTGRESQL = (
    """CREATE OR REPLACE FUNCTION hai_queued_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP <> 'INSERT' AND OLD.state = 'queued' THEN
    INSERT INTO queued_counts (user_id, delta, held) VALUES (OLD.user_id, -1, -OLD.user_suspended::int);
  END IF;
  IF TG_OP <> 'DELETE' AND NEW.state = 'queued' THEN
    INSERT INTO queued_counts (user_id, delta, held) VALUES (NEW.user_id, 1, NEW.user_suspended::int);
  END IF;
  RETURN NULL;
END $$""",
    "DROP TRIGGER IF EXISTS jobs_queued_update ON jobs",
    "CREATE TRIGGER jobs_queued_update AFTER UPDATE OF state, user_id, user_suspended ON jobs FOR EACH ROW "
    "WHEN ((OLD.state = 'queued' OR NEW.state = 'queued') AND (OLD.state, OLD.user_id, OLD.user_suspended) "
    "IS DISTINCT FROM (NEW.state, NEW.user_id, NEW.user_suspended)) EXECUTE FUNCTION hai_queued_count()",
)
_SQLITE = (
    "DROP TRIGGER IF EXISTS jobs_queued_insert",
    "DROP TRIGGER IF EXISTS jobs_queued_update",
    "DROP TRIGGER IF EXISTS jobs_queued_delete",
    "CREATE TRIGGER jobs_queued_insert AFTER INSERT ON jobs WHEN NEW.state = 'queued' "
    "BEGIN INSERT INTO queued_counts (user_id, delta, held) VALUES (NEW.user_id, 1, NEW.user_suspended); END",
    "CREATE TRIGGER jobs_queued_update AFTER UPDATE OF state, user_id, user_suspended ON jobs "
    "WHEN (OLD.state = 'queued' OR NEW.state = 'queued') AND (OLD.state IS NOT NEW.state "
    "OR OLD.user_id IS NOT NEW.user_id OR OLD.user_suspended IS NOT NEW.user_suspended) "
    "BEGIN INSERT INTO queued_counts (user_id, delta, held) SELECT OLD.user_id, -1, -OLD.user_suspended "
    "WHERE OLD.state = 'queued'; "
    "INSERT INTO queued_counts (user_id, delta, held) SELECT NEW.user_id, 1, NEW.user_suspended "
    "WHERE NEW.state = 'queued'; END",
    "CREATE TRIGGER jobs_queued_delete AFTER DELETE ON jobs WHEN OLD.state = 'queued' "
    "BEGIN INSERT INTO queued_counts (user_id, delta, held) VALUES (OLD.user_id, -1, -OLD.user_suspended); END",
)

# 0018's
_POSTGRESQL_0018 = (
    """CREATE OR REPLACE FUNCTION hai_queued_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP <> 'INSERT' AND OLD.state = 'queued' THEN
    INSERT INTO queued_counts (user_id, delta) VALUES (OLD.user_id, -1);
  END IF;
  IF TG_OP <> 'DELETE' AND NEW.state = 'queued' THEN
    INSERT INTO queued_counts (user_id, delta) VALUES (NEW.user_id, 1);
  END IF;
  RETURN NULL;
END $$""",
    "DROP TRIGGER IF EXISTS jobs_queued_update ON jobs",
    "CREATE TRIGGER jobs_queued_update AFTER UPDATE OF state, user_id ON jobs FOR EACH ROW "
    "WHEN ((OLD.state = 'queued' OR NEW.state = 'queued') "
    "AND (OLD.state, OLD.user_id) IS DISTINCT FROM (NEW.state, NEW.user_id)) EXECUTE FUNCTION hai_queued_count()",
)
_SQLITE_0018 = (
    "DROP TRIGGER IF EXISTS jobs_queued_insert",
    "DROP TRIGGER IF EXISTS jobs_queued_update",
    "DROP TRIGGER IF EXISTS jobs_queued_delete",
    "CREATE TRIGGER IF NOT EXISTS jobs_queued_insert AFTER INSERT ON jobs WHEN NEW.state = 'queued' "
    "BEGIN INSERT INTO queued_counts (user_id, delta) VALUES (NEW.user_id, 1); END",
    "CREATE TRIGGER IF NOT EXISTS jobs_queued_update AFTER UPDATE OF state, user_id ON jobs "
    "WHEN (OLD.state = 'queued' OR NEW.state = 'queued') AND (OLD.state IS NOT NEW.state OR OLD.user_id IS NOT NEW.user_id) "
    "BEGIN INSERT INTO queued_counts (user_id, delta) SELECT OLD.user_id, -1 WHERE OLD.state = 'queued'; "
    "INSERT INTO queued_counts (user_id, delta) SELECT NEW.user_id, 1 WHERE NEW.state = 'queued'; END",
    "CREATE TRIGGER IF NOT EXISTS jobs_queued_delete AFTER DELETE ON jobs WHEN OLD.state = 'queued' "
    "BEGIN INSERT INTO queued_counts (user_id, delta) VALUES (OLD.user_id, -1); END",
)

revision: str = '0019'
down_revision: Union[str, None] = '0018'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column('queued_counts', sa.Column('held', sa.Integer(), server_default='0', nullable=False))
    op.execute("INSERT INTO queued_counts (user_id, delta, held) "
               "SELECT user_id, 0, count(*) FROM jobs WHERE state = 'queued' AND user_suspended GROUP BY user_id")
    for ddl in _POSTGRESQL if op.get_bind().dialect.name == 'postgresql' else _SQLITE:
        op.execute(ddl)


def downgrade() -> None:
    for ddl in _POSTGRESQL_0018 if op.get_bind().dialect.name == 'postgresql' else _SQLITE_0018:
        op.execute(ddl)
    op.execute("DELETE FROM queued_counts WHERE delta = 0")  # the rows of holds and releases only
    op.drop_column('queued_counts', 'held')
