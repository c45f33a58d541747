"""node_sizes: how many nodes have each GPU count, kept by triggers on nodes (issue 12)

A submission's admission check (enough nodes, a node large enough, enough whole nodes of the
job's size) aggregated every row of ``nodes``: at 1,250 nodes a scan of all of them, their
heartbeat figures' pages included, in every submission (the submission's statement took 0.34 ms
of PostgreSQL's execution there, 0.19 ms with 2 nodes; on SQLite a submission took 1.16 ms,
0.48 with 2 nodes; benchmarks/queue_limit.py --nodes). The counts are now kept
per GPU count by row triggers on ``nodes`` (insert, delete, and an update that changes
``gpus``), and the check reads those few rows. The nodes present at the upgrade are counted.

Revision ID: 0020
Revises: 0019
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# as hai.db.models.node_size_ddl at this revision (copied: a migration does not change when the
# models do)
_POSTGRESQL = (
    """CREATE OR REPLACE FUNCTION hai_node_size() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP <> 'INSERT' THEN
    UPDATE node_sizes SET nodes = nodes - 1 WHERE gpus = OLD.gpus;
  END IF;
  IF TG_OP <> 'DELETE' THEN
    INSERT INTO node_sizes (gpus, nodes) VALUES (NEW.gpus, 1)
      ON CONFLICT (gpus) DO UPDATE SET nodes = node_sizes.nodes + 1;
  END IF;
  RETURN NULL;
END $$""",
    "DROP TRIGGER IF EXISTS nodes_size_insert ON nodes",
    "DROP TRIGGER IF EXISTS nodes_size_update ON nodes",
    "DROP TRIGGER IF EXISTS nodes_size_delete ON nodes",
    "CREATE TRIGGER nodes_size_insert AFTER INSERT ON nodes FOR EACH ROW EXECUTE FUNCTION hai_node_size()",
    "CREATE TRIGGER nodes_size_update AFTER UPDATE OF gpus ON nodes FOR EACH ROW "
    "WHEN (OLD.gpus IS DISTINCT FROM NEW.gpus) EXECUTE FUNCTION hai_node_size()",
    "CREATE TRIGGER nodes_size_delete AFTER DELETE ON nodes FOR EACH ROW EXECUTE FUNCTION hai_node_size()",
)
_ADD = ("INSERT OR IGNORE INTO node_sizes (gpus, nodes) VALUES (NEW.gpus, 0); "
        "UPDATE node_sizes SET nodes = nodes + 1 WHERE gpus = NEW.gpus;")
_REMOVE = "UPDATE node_sizes SET nodes = nodes - 1 WHERE gpus = OLD.gpus;"
_SQLITE = (
    "DROP TRIGGER IF EXISTS nodes_size_insert",
    "DROP TRIGGER IF EXISTS nodes_size_update",
    "DROP TRIGGER IF EXISTS nodes_size_delete",
    f"CREATE TRIGGER nodes_size_insert AFTER INSERT ON nodes BEGIN {_ADD} END",
    f"CREATE TRIGGER nodes_size_update AFTER UPDATE OF gpus ON nodes WHEN OLD.gpus IS NOT NEW.gpus "
    f"BEGIN {_REMOVE} {_ADD} END",
    f"CREATE TRIGGER nodes_size_delete AFTER DELETE ON nodes BEGIN {_REMOVE} END",
)

revision: str = '0020'
down_revision: Union[str, None] = '0019'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        'node_sizes',
        sa.Column('gpus', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('nodes', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('gpus', name=op.f('pk_node_sizes')),
    )
    op.execute("INSERT INTO node_sizes (gpus, nodes) SELECT gpus, count(*) FROM nodes GROUP BY gpus")
    for ddl in _POSTGRESQL if op.get_bind().dialect.name == 'postgresql' else _SQLITE:
        op.execute(ddl)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        for event in ('insert', 'update', 'delete'):
            op.execute(f'DROP TRIGGER IF EXISTS nodes_size_{event} ON nodes')
        op.execute('DROP FUNCTION IF EXISTS hai_node_size()')
    else:
        for event in ('insert', 'update', 'delete'):
            op.execute(f'DROP TRIGGER IF EXISTS nodes_size_{event}')
    op.drop_table('node_sizes')
