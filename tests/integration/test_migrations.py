"""`alembic upgrade head` builds the schema the models describe, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
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
          "gpu_holds", "scheduler_leases", "job_change_counter", "node_list_revision", "queued_counts", "node_sizes"}


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


def test_node_gpu_figure_columns_are_filled_from_the_latest_heartbeat(any_url):
    """0012 folds the nodes' stored gpu_metrics into gpu_util_pct / gpus_busy (busy at >= 5%)."""
    from sqlalchemy import text

    upgrade(any_url, "0006")
    engine = create_engine(any_url)
    with engine.begin() as c:
        for name, metrics in (("a", '[{"index": 0, "util_pct": 90.0}, {"index": 1, "util_pct": 2.0}]'), ("b", "[]")):
            c.execute(text("INSERT INTO nodes (name, zone, leaf, gpus, state, address, fake_gpus, gpu_inventory, gpu_metrics,"
                           " nics, agent_version, protocol_version, registered_at, state_reason, labels_from_topology,"
                           " heartbeats_since_quick) VALUES (:n, 'z', 'l', 2, 'ready', '', false, '[]', :m, '[]', '', 1,"
                           " CURRENT_TIMESTAMP, '', false, 0)"), {"n": name, "m": metrics})
    upgrade(any_url)
    with engine.connect() as c:
        rows = dict((n, (u, b)) for n, u, b in c.execute(text("SELECT name, gpu_util_pct, gpus_busy FROM nodes")))
    engine.dispose()
    assert rows == {"a": (46.0, 1), "b": (None, 0)}
    downgrade(any_url, "0006")


def test_node_gpu_indices_are_filled_from_the_inventory(any_url):
    """0013 keeps an agent's own GPU numbering (GPUs 4-7 of a host) as a column, NULL for 0..n-1."""
    from sqlalchemy import text

    upgrade(any_url, "0012")
    engine = create_engine(any_url)
    inv = lambda idx: "[" + ", ".join(f'{{"index": {i}, "uuid": "GPU-{i}"}}' for i in idx) + "]"  # noqa: E731
    with engine.begin() as c:
        for name, gpus, inventory in (("upper", 4, inv([6, 4, 7, 5])), ("plain", 2, inv([0, 1])), ("none", 8, "[]")):
            c.execute(text("INSERT INTO nodes (name, zone, leaf, gpus, state, address, fake_gpus, gpu_inventory, gpu_metrics,"
                           " nics, agent_version, protocol_version, registered_at, state_reason, labels_from_topology,"
                           " heartbeats_since_quick) VALUES (:n, 'z', 'l', :g, 'ready', '', false, :i, '[]', '[]', '', 1,"
                           " CURRENT_TIMESTAMP, '', false, 0)"), {"n": name, "g": gpus, "i": inventory})
    upgrade(any_url)
    with engine.connect() as c:
        rows = dict(c.execute(text("SELECT name, gpu_indices FROM nodes")).all())
    engine.dispose()
    rows = {k: (json.loads(v) if isinstance(v, str) else v) for k, v in rows.items()}
    assert rows == {"upper": [4, 5, 6, 7], "plain": None, "none": None}
    downgrade(any_url, "0012")


def test_sqlite_job_rows_get_a_rising_change_marker_whoever_writes_them(tmp_path):
    """0015 (issue 12): on SQLite the database marks every insert and update of a job row with
    the next value of job_change_counter, raw SQL included; markers rise in commit order, and a
    rolled-back write hands out none. The scheduler's queue cache relies on exactly this."""
    from sqlalchemy import text

    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url)
    engine = create_engine(url)

    def insert(c, name):  # noqa: ANN001, ANN202
        c.execute(text("INSERT INTO users (name, \"group\", is_admin, created_at) VALUES (:n, 'g', 0, CURRENT_TIMESTAMP)"
                       " ON CONFLICT DO NOTHING"), {"n": "u"})
        return c.execute(text(
            "INSERT INTO jobs (name, user_id, user_name, \"group\", command, env, tags, job_type, nodes, gpus_per_node,"
            " priority, submitted_priority, allow_cross_zone, suspend_grace_s, state, created_at, queued_at, attempt,"
            " suspensions, restarts, reserved_nodes, desired_action, user_suspended, lost_gpu_s, run_s)"
            " VALUES (:n, 1, 'u', 'g', '[]', '{}', '[]', 'command', 1, 1, 'NORMAL', 'NORMAL', 0, 60, 'queued',"
            " CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 0, 0, 0, '[]', 'run', 0, 0, 0) RETURNING id"), {"n": name}).scalar()

    def marks(c):  # noqa: ANN001, ANN202
        return dict(c.execute(text("SELECT name, change_seq FROM jobs")).all())

    with engine.begin() as c:
        a, b = insert(c, "a"), insert(c, "b")
    with engine.connect() as c:
        assert marks(c) == {"a": 1, "b": 2}
    with engine.begin() as c:
        c.execute(text("UPDATE jobs SET pending_reason = 'x' WHERE id = :i"), {"i": a})
    with engine.begin() as c:
        c.execute(text("UPDATE jobs SET priority = 'HIGH'"))  # both rows, one statement
    with engine.connect() as c:
        m = marks(c)
        assert m["a"] > 3 and m["b"] > 3 and m["a"] != m["b"] and max(m.values()) == 5
    with engine.connect() as c:
        tx = c.begin()
        c.execute(text("UPDATE jobs SET state = 'cancelled' WHERE id = :i"), {"i": b})
        tx.rollback()
    with engine.begin() as c:
        c.execute(text("UPDATE jobs SET state = 'cancelled' WHERE id = :i"), {"i": b})
        assert c.execute(text("SELECT seq FROM job_change_counter")).scalar() == 6
    with engine.connect() as c:
        assert marks(c)["b"] == 6
    engine.dispose()
    downgrade(url, "0014")
    upgrade(url)
    engine = create_engine(url)
    with engine.connect() as c:
        triggers = {r[0] for r in c.execute(text("SELECT name FROM sqlite_master WHERE type = 'trigger'"))}
    engine.dispose()
    assert triggers == {"jobs_change_seq_insert", "jobs_change_seq_update"} | NODE_LIST_SQLITE_TRIGGERS | QUEUED_TRIGGERS | NODE_SIZE_TRIGGERS


QUEUED_TRIGGERS = {f"jobs_queued_{e}" for e in ("insert", "update", "delete")}
NODE_SIZE_TRIGGERS = {f"nodes_size_{e}" for e in ("insert", "update", "delete")}
NODE_LIST_SQLITE_TRIGGERS = {f"{t}_list_{e}" for t in ("nodes", "job_allocations") for e in ("insert", "delete", "update")}


def test_the_node_list_revision_and_its_triggers_come_and_go_with_0016(any_url):
    """0016 (issue 12): the revision row and the triggers that raise it exist at head, on both
    databases, and a downgrade to 0015 removes them (tests/integration/test_node_list_cache.py
    checks what raises it)."""
    from sqlalchemy import text

    def present() -> tuple[set[str], list]:  # noqa: ANN202
        engine = create_engine(any_url)
        with engine.connect() as c:
            if engine.dialect.name == "sqlite":
                names = {r[0] for r in c.execute(text("SELECT name FROM sqlite_master WHERE type = 'trigger'"))}
            else:
                names = {r[0] for r in c.execute(text("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal"))}
            rows = c.execute(text("SELECT id, rev FROM node_list_revision")).all() if "node_list_revision" in \
                inspect(engine).get_table_names() else None
        engine.dispose()
        return {n for n in names if "_list_" in n}, rows

    upgrade(any_url)
    expected = NODE_LIST_SQLITE_TRIGGERS if any_url.startswith("sqlite") else {
        f"{t}_list_{e}" for t in ("nodes", "job_allocations") for e in ("rows", "update")}
    assert present() == (expected, [(1, 0)])
    downgrade(any_url, "0015")
    assert present() == (set(), None)
    upgrade(any_url)
    assert present() == (expected, [(1, 0)])
