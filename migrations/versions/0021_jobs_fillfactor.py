"""jobs: fillfactor 80, room in each page for the new versions of its rows (issue 12)

A scheduling cycle rewrites queued jobs' pending reasons and reservations
(services/scheduling.write_queued_pg): every new job's in its first cycle, and many at once when
the cluster changes. Neither column is indexed, so each such update could be HOT (the new
version in the same page, no new entry in any of the table's seven indexes), but with the
default fillfactor (100) submissions fill each page and the new version had to go to another
page: 6,023 of 177,600 updates were HOT in ``benchmarks/write_queued.py --fillfactor 100``. With
80, 135,083 were (76%), and PostgreSQL's CPU to give 10,000 queued jobs new reasons in one
statement fell from 127 to 60 ms (the same benchmark). PostgreSQL only; ALTER TABLE ... SET does not rewrite the table: pages written from
now on keep the room (a VACUUM FULL or pg_repack rewrites the old ones, at a time of your choice).

Revision ID: 0021
Revises: 0020
"""
from typing import Sequence, Union

from alembic import op

revision: str = '0021'
down_revision: Union[str, None] = '0020'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.execute('ALTER TABLE jobs SET (fillfactor = 80)')


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.execute('ALTER TABLE jobs RESET (fillfactor)')
