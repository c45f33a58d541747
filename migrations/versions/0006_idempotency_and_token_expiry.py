"""idempotency keys for job submission; api token expiry (issue 13)

Revision ID: 0006
Revises: 0003
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
import hai.db.base


revision: str = '0006'
down_revision: Union[str, None] = '0004'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.add_column(sa.Column('expires_at', hai.db.base.UTCDateTime(timezone=True), nullable=True))
    op.create_table('idempotency_keys',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('user_id', sa.Integer(), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('request_hash', sa.String(length=64), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('created_at', hai.db.base.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_idempotency_keys_job_id_jobs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_idempotency_keys_user_id_users'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_idempotency_keys')),
    sa.UniqueConstraint('user_id', 'key', name='uq_idempotency_keys_user_id_key')
    )
    op.create_index(op.f('ix_idempotency_keys_job_id'), 'idempotency_keys', ['job_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_idempotency_keys_job_id'), table_name='idempotency_keys')
    op.drop_table('idempotency_keys')
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.drop_column('expires_at')
