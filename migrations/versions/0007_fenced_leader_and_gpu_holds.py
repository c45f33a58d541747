"""fenced scheduler leadership (scheduler_leases, epochs on decisions) and one row per held GPU
with a unique index over (node, GPU) (issue 12)

Revision ID: 0007
Revises: 0006
"""
import json
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

import hai.db.base

revision: str = "0007"
down_revision: Union[str, None] = "0006"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "scheduler_leases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=256), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("expires_at", hai.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_scheduler_leases")),
    )
    op.create_table(
        "gpu_holds",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("allocation_id", sa.Integer(), nullable=False),
        sa.Column("node_name", sa.String(length=128), nullable=False),
        sa.Column("gpu", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["allocation_id"], ["job_allocations.id"],
                                name=op.f("fk_gpu_holds_allocation_id_job_allocations"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpu_holds")),
        sa.UniqueConstraint("node_name", "gpu", name="uq_gpu_holds_node_gpu"),
    )
    op.create_index(op.f("ix_gpu_holds_allocation_id"), "gpu_holds", ["allocation_id"], unique=False)
    with op.batch_alter_table("job_allocations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("epoch", sa.Integer(), nullable=True))
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("epoch", sa.Integer(), nullable=True))
    # the GPUs active allocations hold today get their rows
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id, node_name, gpus FROM job_allocations WHERE active")).all()
    holds = []
    for alloc_id, node, gpus in rows:
        for gpu in json.loads(gpus) if isinstance(gpus, str) else (gpus or []):
            holds.append({"allocation_id": alloc_id, "node_name": node, "gpu": int(gpu)})
    if holds:
        conn.execute(sa.text("INSERT INTO gpu_holds (allocation_id, node_name, gpu) VALUES (:allocation_id, :node_name, :gpu)"), holds)


def downgrade() -> None:
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.drop_column("epoch")
    with op.batch_alter_table("job_allocations", schema=None) as batch_op:
        batch_op.drop_column("epoch")
    op.drop_index(op.f("ix_gpu_holds_allocation_id"), table_name="gpu_holds")
    op.drop_table("gpu_holds")
    op.drop_table("scheduler_leases")
