"""validation_runs: an agent's own periodic quick round stored once (issue 12, protocol version 2)

From protocol version 2 the agent runs its periodic quick rounds itself and reports them without
a run id; the server keeps each as a run (``requested_by = 'agent'``, trigger ``periodic``). A
report is sent again until a reply to a heartbeat that carried it arrives, so the same round can
reach the server twice (a reply lost on the way, another API replica): this partial unique index
over (node, start) of those runs makes the second insert a no-op (``ON CONFLICT DO NOTHING``).

Revision ID: 0017
Revises: 0016
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0017'
down_revision: Union[str, None] = '0016'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_index('ux_validation_runs_own_round', 'validation_runs', ['node_name', 'started_at'], unique=True,
                    postgresql_where=sa.text("requested_by = 'agent'"),
                    sqlite_where=sa.text("requested_by = 'agent'"))


def downgrade() -> None:
    op.drop_index('ux_validation_runs_own_round', table_name='validation_runs')
