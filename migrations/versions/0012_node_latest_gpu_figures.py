"""nodes: the latest heartbeat's mean GPU utilisation and busy GPU count as columns (issue 11)

The cluster summary and the fat-tree view read these instead of scanning every node's
``gpu_metrics`` JSON on each page load. Existing rows are filled from their ``gpu_metrics`` here
(the busy count at the default threshold, 5%); every heartbeat refreshes both.

Revision ID: 0012
Revises: 0010
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0012'
down_revision: Union[str, None] = '0010'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpu_util_pct', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('gpus_busy', sa.Integer(), server_default='0', nullable=False))
    nodes = sa.table('nodes', sa.column('id', sa.Integer), sa.column('gpu_metrics', sa.JSON),
                     sa.column('gpu_util_pct', sa.Float), sa.column('gpus_busy', sa.Integer))
    bind = op.get_bind()
    for node_id, gpus in bind.execute(sa.select(nodes.c.id, nodes.c.gpu_metrics)).all():
        utils = [float(g['util_pct']) for g in (gpus or []) if isinstance(g, dict) and g.get('util_pct') is not None]
        if utils:
            bind.execute(nodes.update().where(nodes.c.id == node_id).values(
                gpu_util_pct=sum(utils) / len(utils), gpus_busy=sum(1 for u in utils if u >= 5.0)))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('gpus_busy')
        batch_op.drop_column('gpu_util_pct')
