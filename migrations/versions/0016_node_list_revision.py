"""node_list_revision: a number raised by every change the node list shows (issue 12, reads)

``GET /api/v1/nodes`` at 1,250 nodes cost ~16 ms of PostgreSQL's CPU per request (the allocations'
aggregate and writing 1,250 objects). Each API process now keeps the document it last built with
the revision it was built at, and serves it while the revision is unchanged and the document
younger than ``HAI_HTTP__NODE_LIST_MAX_AGE_S`` (services/nodes.NodeListCache). Triggers raise the
revision on every insert, delete and real change of a listed column of ``nodes`` (not the
heartbeats' figures) and of ``job_allocations``; on PostgreSQL deferred to commit, once per
transaction.

Revision ID: 0016
Revises: 0015
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# as hai.db.models.node_list_revision_ddl at this revision (copied: a migration does not change
# when the models do)
_ROW = 'INSERT INTO node_list_revision (id, rev) VALUES (1, 0) ON CONFLICT DO NOTHING'
_POSTGRESQL = (
    """CREATE OR REPLACE FUNCTION hai_node_list_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF coalesce(current_setting('hai.node_list_changed', true), '') <> 'y' THEN
    UPDATE node_list_revision SET rev = rev + 1 WHERE id = 1;
    PERFORM set_config('hai.node_list_changed', 'y', true);
  END IF;
  RETURN NULL;
END $$""",
    'CREATE CONSTRAINT TRIGGER nodes_list_rows AFTER INSERT OR DELETE ON nodes DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION hai_node_list_changed()',
    'CREATE CONSTRAINT TRIGGER nodes_list_update AFTER UPDATE OF name, zone, leaf, gpus, state, state_reason, address, fake_gpus ON nodes DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN ((OLD.name, OLD.zone, OLD.leaf, OLD.gpus, OLD.state, OLD.state_reason, OLD.address, OLD.fake_gpus) IS DISTINCT FROM (NEW.name, NEW.zone, NEW.leaf, NEW.gpus, NEW.state, NEW.state_reason, NEW.address, NEW.fake_gpus)) EXECUTE FUNCTION hai_node_list_changed()',
    'CREATE CONSTRAINT TRIGGER job_allocations_list_rows AFTER INSERT OR DELETE ON job_allocations DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION hai_node_list_changed()',
    'CREATE CONSTRAINT TRIGGER job_allocations_list_update AFTER UPDATE OF node_name, job_id, gpus, active ON job_allocations DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN ((OLD.node_name, OLD.job_id, OLD.gpus::text, OLD.active) IS DISTINCT FROM (NEW.node_name, NEW.job_id, NEW.gpus::text, NEW.active)) EXECUTE FUNCTION hai_node_list_changed()',
)
_SQLITE = (
    'CREATE TRIGGER IF NOT EXISTS nodes_list_insert AFTER INSERT ON nodes BEGIN UPDATE node_list_revision SET rev = rev + 1 WHERE id = 1; END',
    'CREATE TRIGGER IF NOT EXISTS nodes_list_delete AFTER DELETE ON nodes BEGIN UPDATE node_list_revision SET rev = rev + 1 WHERE id = 1; END',
    'CREATE TRIGGER IF NOT EXISTS nodes_list_update AFTER UPDATE OF name, zone, leaf, gpus, state, state_reason, address, fake_gpus ON nodes WHEN OLD.name IS NOT NEW.name OR OLD.zone IS NOT NEW.zone OR OLD.leaf IS NOT NEW.leaf OR OLD.gpus IS NOT NEW.gpus OR OLD.state IS NOT NEW.state OR OLD.state_reason IS NOT NEW.state_reason OR OLD.address IS NOT NEW.address OR OLD.fake_gpus IS NOT NEW.fake_gpus BEGIN UPDATE node_list_revision SET rev = rev + 1 WHERE id = 1; END',
    'CREATE TRIGGER IF NOT EXISTS job_allocations_list_insert AFTER INSERT ON job_allocations BEGIN UPDATE node_list_revision SET rev = rev + 1 WHERE id = 1; END',
    'CREATE TRIGGER IF NOT EXISTS job_allocations_list_delete AFTER DELETE ON job_allocations BEGIN UPDATE node_list_revision SET rev = rev + 1 WHERE id = 1; END',
    'CREATE TRIGGER IF NOT EXISTS job_allocations_list_update AFTER UPDATE OF node_name, job_id, gpus, active ON job_allocations WHEN OLD.node_name IS NOT NEW.node_name OR OLD.job_id IS NOT NEW.job_id OR OLD.gpus IS NOT NEW.gpus OR OLD.active IS NOT NEW.active BEGIN UPDATE node_list_revision SET rev = rev + 1 WHERE id = 1; END',
)

revision: str = '0016'
down_revision: Union[str, None] = '0015'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        'node_list_revision',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('rev', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.execute(_ROW)
    for ddl in _POSTGRESQL if op.get_bind().dialect.name == 'postgresql' else _SQLITE:
        op.execute(ddl)


def downgrade() -> None:
    for table in ('nodes', 'job_allocations'):
        if op.get_bind().dialect.name == 'postgresql':
            op.execute(f'DROP TRIGGER IF EXISTS {table}_list_rows ON {table}')
            op.execute(f'DROP TRIGGER IF EXISTS {table}_list_update ON {table}')
        else:
            for event in ('insert', 'delete', 'update'):
                op.execute(f'DROP TRIGGER IF EXISTS {table}_list_{event}')
    if op.get_bind().dialect.name == 'postgresql':
        op.execute('DROP FUNCTION IF EXISTS hai_node_list_changed()')
    op.drop_table('node_list_revision')
