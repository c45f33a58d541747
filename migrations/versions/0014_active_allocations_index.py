"""job_allocations: a partial index over the active allocations (issue 12, the node list)

The node list (and the cluster view) aggregate every active allocation per node: 10,000 rows at
1,250 busy nodes among every allocation ever made (90,000 in the read benchmark), which a
sequential scan filtered (20 ms; EXPLAIN ANALYZE in benchmarks/README.md). This index holds only
the active rows, with the columns the aggregate reads, so that it is an index-only scan. Queries
must say ``WHERE active`` (not ``active IS true``) for the planner to use it.

Revision ID: 0014
Revises: 0013
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0014'
down_revision: Union[str, None] = '0013'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_index('ix_job_allocations_active', 'job_allocations', ['node_name'], unique=False,
                    postgresql_where=sa.text('active'), postgresql_include=['job_id', 'gpus'],
                    sqlite_where=sa.text('active = 1'))


def downgrade() -> None:
    op.drop_index('ix_job_allocations_active', table_name='job_allocations')
