"""jobs.change_seq: a change marker the database maintains (issue 12, submissions on SQLite)

Every scheduling cycle read every queued job (at 10,000 queued on SQLite ~0.25 s of CPU in the
one process that also serves the API). With a marker on each job row that increases with every
write, a cycle reads only the rows changed since the last one (services/scheduling.QueueCache).
On SQLite triggers set it from ``job_change_counter`` (one writer at a time: markers increase in
commit order), so every writer of job rows maintains it, raw SQL included. On PostgreSQL the
column and the table exist (one schema) and stay unused: its scheduler reads the whole queue.

Revision ID: 0015
Revises: 0014
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa



# as hai.db.models.JOB_CHANGE_TRIGGERS at this revision (copied: a migration does not change
# when the models do)
_COUNTER_ROW = "INSERT INTO job_change_counter (id, seq) VALUES (1, 0)"
_TRIGGERS = (
    """CREATE TRIGGER jobs_change_seq_insert AFTER INSERT ON jobs
BEGIN
  UPDATE job_change_counter SET seq = seq + 1 WHERE id = 1;
  UPDATE jobs SET change_seq = (SELECT seq FROM job_change_counter WHERE id = 1) WHERE id = NEW.id;
END""",
    """CREATE TRIGGER jobs_change_seq_update AFTER UPDATE ON jobs WHEN NEW.change_seq IS OLD.change_seq
BEGIN
  UPDATE job_change_counter SET seq = seq + 1 WHERE id = 1;
  UPDATE jobs SET change_seq = (SELECT seq FROM job_change_counter WHERE id = 1) WHERE id = NEW.id;
END""",
)

revision: str = '0015'
down_revision: Union[str, None] = '0014'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        'job_change_counter',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('seq', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    # a plain ADD COLUMN (no batch copy of the table): existing rows keep NULL, which the
    # scheduler's first full read of the queue covers
    op.add_column('jobs', sa.Column('change_seq', sa.BigInteger(), nullable=True))
    op.create_index('ix_jobs_change_seq', 'jobs', ['change_seq'], unique=False)
    if op.get_bind().dialect.name == 'sqlite':
        op.execute(_COUNTER_ROW)
        for ddl in _TRIGGERS:
            op.execute(ddl)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'sqlite':
        op.execute('DROP TRIGGER IF EXISTS jobs_change_seq_update')
        op.execute('DROP TRIGGER IF EXISTS jobs_change_seq_insert')
    op.drop_index('ix_jobs_change_seq', table_name='jobs')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('change_seq')
    op.drop_table('job_change_counter')
