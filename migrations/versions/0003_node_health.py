"""node health: node events, validation runs and checks, node and job columns (issue 10)

Revision ID: 0003
Revises: 0001
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
import hai.db.base


revision: str = '0003'
down_revision: Union[str, None] = '0002'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('state_changed_at', hai.db.base.UTCDateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('state_detail', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('return_validation_id', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('heartbeats_since_quick', sa.Integer(), nullable=False, server_default='0'))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('move_cause', sa.String(length=16), nullable=True))
    op.create_table('node_events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('node_id', sa.Integer(), nullable=False),
    sa.Column('at', hai.db.base.UTCDateTime(timezone=True), nullable=False),
    sa.Column('from_state', sa.String(length=16), nullable=True),
    sa.Column('to_state', sa.String(length=16), nullable=False),
    sa.Column('actor', sa.String(length=128), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('detail', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_node_events_node_id_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_node_events'))
    )
    op.create_index(op.f('ix_node_events_node_id'), 'node_events', ['node_id'], unique=False)
    op.create_table('validation_runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('node_name', sa.String(length=128), nullable=False),
    sa.Column('level', sa.String(length=8), nullable=False),
    sa.Column('trigger', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('requested_by', sa.String(length=128), nullable=False),
    sa.Column('requested_at', hai.db.base.UTCDateTime(timezone=True), nullable=False),
    sa.Column('delivered_at', hai.db.base.UTCDateTime(timezone=True), nullable=True),
    sa.Column('started_at', hai.db.base.UTCDateTime(timezone=True), nullable=True),
    sa.Column('finished_at', hai.db.base.UTCDateTime(timezone=True), nullable=True),
    sa.Column('summary', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_validation_runs'))
    )
    op.create_index('ix_validation_runs_node_id', 'validation_runs', ['node_name', 'id'], unique=False)
    op.create_table('validation_checks',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('level', sa.String(length=8), nullable=False),
    sa.Column('critical', sa.Boolean(), nullable=False),
    sa.Column('status', sa.String(length=8), nullable=False),
    sa.Column('value', sa.Float(), nullable=True),
    sa.Column('threshold', sa.Float(), nullable=True),
    sa.Column('unit', sa.String(length=32), nullable=False),
    sa.Column('detail', sa.Text(), nullable=False),
    sa.Column('duration_s', sa.Float(), nullable=False),
    sa.Column('data', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['validation_runs.id'], name=op.f('fk_validation_checks_run_id_validation_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_validation_checks'))
    )
    op.create_index(op.f('ix_validation_checks_run_id'), 'validation_checks', ['run_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_validation_checks_run_id'), table_name='validation_checks')
    op.drop_table('validation_checks')
    op.drop_index('ix_validation_runs_node_id', table_name='validation_runs')
    op.drop_table('validation_runs')
    op.drop_index(op.f('ix_node_events_node_id'), table_name='node_events')
    op.drop_table('node_events')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('move_cause')
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('heartbeats_since_quick')
        batch_op.drop_column('return_validation_id')
        batch_op.drop_column('state_detail')
        batch_op.drop_column('state_changed_at')
