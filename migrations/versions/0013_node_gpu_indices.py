"""nodes: the GPU numbering of the node's agent as a column (issue 14)

``gpu_indices`` is NULL when the agent numbers its GPUs 0..gpus-1 (the common case) and the
sorted list of its NVML indices otherwise (an agent owning GPUs 4-7 of a host). Every scheduling
cycle needs this numbering for every node; it read it from ``gpu_inventory``, a JSON document of
every GPU's model, memory and UUID, decoded for the whole cluster each cycle (the Kubernetes
reconcile profile: a third of a cycle at 1,250 nodes). Existing rows are filled from their
``gpu_inventory`` here; every registration writes it.

Revision ID: 0013
Revises: 0012
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0013'
down_revision: Union[str, None] = '0012'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpu_indices', sa.JSON(), nullable=True))
    nodes = sa.table('nodes', sa.column('id', sa.Integer), sa.column('gpus', sa.Integer),
                     sa.column('gpu_inventory', sa.JSON), sa.column('gpu_indices', sa.JSON))
    bind = op.get_bind()
    for node_id, gpus, inventory in bind.execute(sa.select(nodes.c.id, nodes.c.gpus, nodes.c.gpu_inventory)).all():
        indices = sorted(int(g['index']) for g in (inventory or []) if isinstance(g, dict) and 'index' in g)
        if len(indices) == gpus and indices != list(range(gpus)):
            bind.execute(nodes.update().where(nodes.c.id == node_id).values(gpu_indices=indices))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('gpu_indices')
