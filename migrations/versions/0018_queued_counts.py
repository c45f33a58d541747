"""queued_counts: each user's queued jobs kept by triggers (issue 12, submissions)

The submission's queued-jobs limit counted the user's queued jobs with ``count(*)`` on every
submission: linear in the user's own queue (0.86 ms of PostgreSQL's CPU a submission at 8,000
queued, 2 ms at 10,000, the default limit). Row triggers on ``jobs`` now append +1 / -1 rows
when a job enters or leaves the queued state, the count is the sum of the user's rows, and the
scheduler folds them into one row per user now and then (hai.services.queued_counts). The
jobs queued at the upgrade are counted into one row per user.

Revision ID: 0018
Revises: 0017
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
    INSERT INTO queued_counts (user_id, delta) VALUES (OLD.user_id, -1);
  END IF;
  IF TG_OP <> 'DELETE' AND NEW.state = 'queued' THEN
    INSERT INTO queued_counts (user_id, delta) VALUES (NEW.user_id, 1);
  END IF;
  RETURN NULL;
END $$""",
    "CREATE TRIGGER jobs_queued_insert AFTER INSERT ON jobs FOR EACH ROW WHEN (NEW.state = 'queued') "
    "EXECUTE FUNCTION hai_queued_count()",
    "CREATE TRIGGER jobs_queued_update AFTER UPDATE OF state, user_id ON jobs FOR EACH ROW "
    "WHEN ((OLD.state = 'queued' OR NEW.state = 'queued') "
    "AND (OLD.state, OLD.user_id) IS DISTINCT FROM (NEW.state, NEW.user_id)) EXECUTE FUNCTION hai_queued_count()",
    "CREATE TRIGGER jobs_queued_delete AFTER DELETE ON jobs FOR EACH ROW WHEN (OLD.state = 'queued') "
    "EXECUTE FUNCTION hai_queued_count()",
)
_SQLITE = (
    "CREATE TRIGGER IF NOT EXISTS jobs_queued_insert AFTER INSERT ON jobs WHEN NEW.state = 'queued' "
    "BEGIN INSERT INTO queued_counts (user_id, delta) VALUES (NEW.user_id, 1); END",
    "CREATE TRIGGER IF NOT EXISTS jobs_queued_update AFTER UPDATE OF state, user_id ON jobs "
    "WHEN (OLD.state = 'queued' OR NEW.state = 'queued') AND (OLD.state IS NOT NEW.state OR OLD.user_id IS NOT NEW.user_id) "
    "BEGIN INSERT INTO queued_counts (user_id, delta) SELECT OLD.user_id, -1 WHERE OLD.state = 'queued'; "
    "INSERT INTO queued_counts (user_id, delta) SELECT NEW.user_id, 1 WHERE NEW.state = 'queued'; END",
    "CREATE TRIGGER IF NOT EXISTS jobs_queued_delete AFTER DELETE ON jobs WHEN OLD.state = 'queued' "
    "BEGIN INSERT INTO queued_counts (user_id, delta) VALUES (OLD.user_id, -1); END",
)

revision: str = '0018'
down_revision: Union[str, None] = '0017'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        'queued_counts',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('user_id', sa.Integer(), nullable=False),
        sa.Column('delta', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_queued_counts')),
    )
    op.create_index('ix_queued_counts_user_id_delta', 'queued_counts', ['user_id', 'delta'], unique=False)
    op.execute("INSERT INTO queued_counts (user_id, delta) "
               "SELECT user_id, count(*) FROM jobs WHERE state = 'queued' GROUP BY user_id")
    for ddl in _POSTGRESQL if op.get_bind().dialect.name == 'postgresql' else _SQLITE:
        op.execute(ddl)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        for event in ('insert', 'update', 'delete'):
            op.execute(f'DROP TRIGGER IF EXISTS jobs_queued_{event} ON jobs')
        op.execute('DROP FUNCTION IF EXISTS hai_queued_count()')
    else:
        for event in ('insert', 'update', 'delete'):
            op.execute(f'DROP TRIGGER IF EXISTS jobs_queued_{event}')
    op.drop_index('ix_queued_counts_user_id_delta', table_name='queued_counts')
    op.drop_table('queued_counts')
