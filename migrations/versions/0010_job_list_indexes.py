"""indexes for the job list's filters in id order and for the per-user queue limit (issue 12)

Revision ID: 0010
Revises: 0007
"""
from typing import Sequence, Union

from alembic import op


revision: str = '0010'
down_revision: Union[str, None] = '0007'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    # GET /api/v1/jobs filters by state and/or user and pages newest first (ORDER BY id DESC):
    # each filter walks its index backwards and stops after a page; the queue-limit count of a
    # submission reads the user's queued jobs only
    op.create_index('ix_jobs_state_id', 'jobs', ['state', 'id'], unique=False)
    op.create_index('ix_jobs_user_name_state_id', 'jobs', ['user_name', 'state', 'id'], unique=False)
    op.create_index('ix_jobs_user_name_id', 'jobs', ['user_name', 'id'], unique=False)
    op.create_index('ix_jobs_user_id_state', 'jobs', ['user_id', 'state'], unique=False)
    op.drop_index('ix_jobs_user_name', table_name='jobs')  # a prefix of ix_jobs_user_name_id


def downgrade() -> None:
    op.create_index('ix_jobs_user_name', 'jobs', ['user_name'], unique=False)
    op.drop_index('ix_jobs_user_id_state', table_name='jobs')
    op.drop_index('ix_jobs_user_name_id', table_name='jobs')
    op.drop_index('ix_jobs_user_name_state_id', table_name='jobs')
    op.drop_index('ix_jobs_state_id', table_name='jobs')
