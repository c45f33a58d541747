"""gpu metrics: per-node GPU samples at the fine grain, rollups per cluster/node/job, GPU status

Revision ID: 0004
Revises: 0001
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: Union[str, None] = "0003"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "gpu_samples",
        sa.Column("node_name", sa.String(length=128), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("part", sa.Integer(), nullable=False),
        sa.Column("gpus", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("node_name", "bucket", "part", name=op.f("pk_gpu_samples")),
    )
    op.create_table(
        "metric_rollups",
        sa.Column("scope", sa.String(length=8), nullable=False),
        sa.Column("key", sa.String(length=128), nullable=False),
        sa.Column("grain_s", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("busy_n", sa.Integer(), nullable=False),
        sa.Column("util_sum", sa.Float(), nullable=False),
        sa.Column("util_max", sa.Float(), nullable=False),
        sa.Column("mem_used_sum_mib", sa.Float(), nullable=False),
        sa.Column("temp_max_c", sa.Float(), nullable=False),
        sa.Column("power_sum_w", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("scope", "key", "grain_s", "bucket", name=op.f("pk_metric_rollups")),
    )
    op.create_table(
        "gpu_status",
        sa.Column("node_name", sa.String(length=128), nullable=False),
        sa.Column("gpu_index", sa.SmallInteger(), nullable=False),
        sa.Column("last_seen_at", sa.Float(), nullable=False),
        sa.Column("last_busy_at", sa.Float(), nullable=False),
        sa.Column("util_pct", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("node_name", "gpu_index", name=op.f("pk_gpu_status")),
    )


def downgrade() -> None:
    op.drop_table("gpu_status")
    op.drop_table("metric_rollups")
    op.drop_table("gpu_samples")
