"""Alembic environment: one tree for SQLite and PostgreSQL (render_as_batch for SQLite).

The URL is, in order: a connection handed in by code (config.attributes["connection"]), the
``sqlalchemy.url`` option set by code, or HAI settings (HAI_DB__URL / SQLite under HAI_DATA_DIR).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from hai.db.models import Base
from hai.settings import Settings

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return settings.database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def _run(connection) -> None:  # noqa: ANN001
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
