"""Issue 12, scale beyond one machine: the API replicas behind PgBouncer in transaction mode, as
benchmarks/README.md ("What 10,000 nodes would need") recommends for thousands of API
connections. A real PgBouncer (Debian's ``pgbouncer``, started by ``benchmarks/pgbouncer.py`` on a
spare port in front of the test PostgreSQL) with a pool of a few server connections shared by every client connection.

PgBouncer before 1.21 (Debian 12 ships 1.18) hands each transaction whichever server
connection is free, so a statement that psycopg prepared on one (after its fifth execution on a
client connection) is unknown on the next: the API must run with
``HAI_DB__PREPARED_STATEMENTS=false``. The first test shows the failure and the setting that
avoids it on a bare engine; the second runs the whole platform through PgBouncer (two API
workers, submissions single, grouped and batched, reads, an agent's heartbeats, logs) with the
scheduler connected directly (its leader's advisory lock is a session lock)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.exc import ProgrammingError

from benchmarks.pgbouncer import PgBouncer
from hai.db.migrate import upgrade
from hai.db.session import make_engine
from hai.services.context import Platform
from hai.settings import Settings
from tests.e2e.conftest import free_port, wait_for
from tests.integration.test_api_replicas import Procs, _healthy, sse

ADMIN = "hai_pgbouncer-admin-token-0123456789"
AGENT = "haiagent_pgbouncer-agent-token-0123456789"
SERVER_POOL = 3  # PgBouncer's server connections to the database: far fewer than its clients


@pytest.fixture
def bouncer(pg_url: str) -> Iterator[PgBouncer]:
    b = PgBouncer(pg_url, pool_size=SERVER_POOL)
    try:
        yield b
    finally:
        b.stop()


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "never-prepared"])
def test_a_prepared_statement_is_lost_behind_transaction_pooling_unless_turned_off(prepared, bouncer):
    """Client A runs one statement six times (psycopg prepares it on the sixth, on the only
    server connection there is); B then holds that server connection in a transaction, so A's
    next transaction gets a new one, which never saw the statement."""
    engine = make_engine(bouncer.url, prepared_statements=prepared, pool_size=2, max_overflow=0)
    stmt = text("SELECT CAST(:x AS integer) + 1")
    try:
        with engine.connect() as a, engine.connect() as b:
            for x in range(6):
                assert a.execute(stmt, {"x": x}).scalar() == x + 1
                a.commit()
            assert bouncer.show("POOLS")["sv_idle"] == 1  # one server connection so far
            b.execute(text("SELECT 1"))  # B's transaction holds it
            if prepared:
                with pytest.raises(ProgrammingError, match=r'prepared statement "_pg3_\d+" does not exist'):
                    a.execute(stmt, {"x": 6})
                a.rollback()
            else:
                assert [a.execute(stmt, {"x": x}).scalar() for x in range(6, 12)] == list(range(7, 13))
                a.commit()
            b.rollback()
    finally:
        engine.dispose()


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "never-prepared"])
def test_a_process_opens_its_connections_as_the_settings_say(prepared, pg_url, tmp_path):
    """``HAI_DB__POOL_SIZE`` / ``MAX_OVERFLOW`` size the process's pool and
    ``HAI_DB__PREPARED_STATEMENTS`` reaches psycopg's connections (the event loop's pool is
    covered by the test below: its submissions fail through PgBouncer if it is left out)."""
    settings = Settings(data_dir=tmp_path, db={"url": pg_url, "pool_size": 3, "max_overflow": 1,
                                               "prepared_statements": prepared})
    platform = Platform.from_settings(settings)
    try:
        pool = platform.engine.pool
        assert (pool.size(), pool._max_overflow) == (3, 1)
        with platform.engine.connect() as conn:
            assert conn.connection.dbapi_connection.prepare_threshold == (5 if prepared else None)
    finally:
        platform.close()


def test_the_platform_through_pgbouncer_in_transaction_mode(pg_url, redis_url, bouncer, tmp_path):
    upgrade(pg_url)  # migrations and the scheduler connect directly
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    base = {
        **os.environ, "PYTHONUNBUFFERED": "1", "HAI_REDIS__URL": redis_url,
        "HAI_DATA_DIR": str(tmp_path / "data"), "HAI_FRONTEND_DIST": str(tmp_path / "none"),
        "HAI_AUTH__BOOTSTRAP_ADMIN_TOKEN": ADMIN, "HAI_AUTH__BOOTSTRAP_AGENT_TOKEN": AGENT,
        "HAI_SCHEDULER__LEASE_S": "900",
    }
    through_bouncer = {
        **base, "HAI_DB__URL": bouncer.url, "HAI_DB__PREPARED_STATEMENTS": "false",
        "HAI_DB__POOL_SIZE": "4", "HAI_DB__MAX_OVERFLOW": "4",
    }
    procs = Procs(tmp_path, through_bouncer)
    try:
        _, server_log = procs.start("server", "server", "--port", str(port), "--workers", "2")
        wait_for(lambda: _healthy(api), timeout=120, what="the API to serve")
        procs.env = {**base, "HAI_DB__URL": pg_url}
        _, sched_log = procs.start("scheduler", "scheduler")
        wait_for(lambda: "scheduler: leading" in sched_log.read_text(), timeout=120, what="the scheduler to lead")
        procs.start("agent", "agent", "--server", api, "--token", AGENT, "--node", "n0", "--zone", "A",
                    "--leaf", "A1", "--fake-gpus", "8", "--state-dir", str(tmp_path / "n0"),
                    "--address", "127.0.0.1", "--stop-jobs-on-exit", "--ranks-as-agent-user")
        admin = {"Authorization": f"Bearer {ADMIN}"}
        wait_for(lambda: [n["state"] for n in httpx.get(f"{api}/api/v1/nodes", headers=admin).json()] == ["ready"],
                 timeout=120, what="the agent to register")
        before = bouncer.show("STATS")["total_xact_count"]

        job = {"command": [sys.executable, "-c", "import os; print('job', os.environ['HAI_JOB_ID'])"],
               "nodes": 1, "gpus_per_node": 1}
        ids, reads = asyncio.run(_load(api, admin, job))
        assert len(ids) == len(set(ids)) == 48 + 8

        def all_ended() -> bool:
            got = httpx.get(f"{api}/api/v1/jobs", params={"limit": 100}, headers=admin).json()
            items = got["items"] if isinstance(got, dict) else got
            return sorted(j["id"] for j in items if j["state"] == "succeeded") == sorted(ids)

        wait_for(all_ended, timeout=180, interval=0.5, what="every job to succeed")
        for jid in (ids[0], ids[-1]):
            r = httpx.get(f"{api}/api/v1/jobs/{jid}/logs", headers=admin)
            assert r.status_code == 200 and r.text.strip() == f"[rank 0] job {jid}", r.text
        assert _followed(api, admin, ids[1]) == ([f"[rank 0] job {ids[1]}"], "succeeded")

        # the API's transactions went through PgBouncer (each read above is one at least), its
        # client connections more than the server connections they shared, and nothing failed
        assert bouncer.show("STATS")["total_xact_count"] - before >= reads
        assert bouncer.show("POOLS")["cl_active"] > SERVER_POOL
        for line in server_log.read_text().splitlines():
            assert "Traceback" not in line and "prepared statement" not in line, line
    finally:
        procs.stop()


async def _load(api: str, headers: dict, job: dict) -> tuple[list[int], int]:
    """48 single submissions, 8 in flight (the API writes those in flight together as one
    group), a batch of 8, and after each submission a page of the job list and the job: every
    statement runs far more than five times on each API connection. Returns the ids made and
    the number of reads."""
    ids: list[int] = []
    reads = 0
    async with httpx.AsyncClient(base_url=api, headers=headers, timeout=60) as c:
        sem = asyncio.Semaphore(8)

        async def one(k: int) -> None:
            nonlocal reads
            async with sem:
                r = await c.post("/api/v1/jobs", json={**job, "name": f"single-{k}"})
                assert r.status_code == 201, r.text
                jid = r.json()["id"]
                ids.append(jid)
                for path, params in (("/api/v1/jobs", {"limit": 50}), (f"/api/v1/jobs/{jid}", None)):
                    got = await c.get(path, params=params)
                    assert got.status_code == 200, got.text
                reads += 2

        await asyncio.gather(*(one(k) for k in range(48)))
        r = await c.post("/api/v1/jobs/batch", json={"jobs": [{**job, "name": f"batch-{k}"} for k in range(8)]})
        assert r.status_code == 201, r.text
        ids.extend(j["id"] for j in r.json()["jobs"])
    return ids, reads


def _followed(api: str, headers: dict, job_id: int) -> tuple[list[str], str]:
    """The job's log followed as server-sent events: its lines and the final state."""
    lines: list[str] = []
    with httpx.stream("GET", f"{api}/api/v1/jobs/{job_id}/logs", params={"follow": "true"}, headers=headers,
                      timeout=60) as r:
        assert r.status_code == 200
        for event, data in sse(r.iter_lines()):
            if event == "log":
                lines.append(data)
            elif event == "end":
                return lines, data
    raise AssertionError(f"the stream ended without an end event: {lines}")
