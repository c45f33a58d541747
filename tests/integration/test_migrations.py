"""`alembic upgrade head` builds the schema the models describe, on SQLite and PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from hai.db.migrate import downgrade, upgrade
from hai.db.models import Base

REPO = Path(__file__).resolve().parents[2]
TABLES = {"users", "api_tokens", "nodes", "jobs", "job_events", "job_allocations", "log_lines", "quotas", "user_usage", "alembic_version",
          "node_events", "validation_runs", "validation_checks",
          "gpu_samples", "metric_rollups", "gpu_status", "idempotency_keys",
          "gpu_holds", "scheduler_leases"}


def _diff(url: str) -> list:
    engine = create_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    return diff


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    names = set(inspect(engine).get_table_names())
    engine.dispose()
    return names


@pytest.fixture(params=["sqlite", "postgresql"])
def any_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}"
    return request.getfixturevalue("pg_url")


def test_upgrade_head_matches_the_models(any_url):
    upgrade(any_url)
    assert _tables(any_url) == TABLES
    assert _diff(any_url) == []


def test_downgrade_and_upgrade_again(any_url):
    upgrade(any_url)
    downgrade(any_url, "base")
    assert _tables(any_url) == {"alembic_version"}
    upgrade(any_url)
    assert _tables(any_url) == TABLES


def test_alembic_command_line_reads_the_url_from_settings(pg_url):
    env = {"PATH": "/usr/bin:/bin", "HAI_DB__URL": pg_url}
    out = subprocess.run(
        [str(Path(sys.executable).parent / "alembic"), "upgrade", "head"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert _tables(pg_url) == TABLES
