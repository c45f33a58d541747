"""A submission survives a server crash between commit and response (issue 13): the server is
killed with SIGKILL right after the job's transaction commits (HAI_FAULT_CRASH_AT), the client
sees the connection drop, retries with the same Idempotency-Key on a restarted server and gets
the job that was created, never a second one."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid

import httpx
import pytest
from sqlalchemy import create_engine, func, select

from hai.db.models import IdempotencyKey, Job
from tests.e2e.conftest import wait_for

BODY = {"name": "ci-run", "command": ["echo", "hi"], "gpus_per_node": 1}
CRASH = {"HAI_FAULT_CRASH_AT": "after_submit_commit"}


def _db_counts(url: str) -> tuple[int, int]:
    engine = create_engine(url)
    with engine.connect() as conn:
        jobs = conn.scalar(select(func.count(Job.id)))
        keys = conn.scalar(select(func.count(IdempotencyKey.id)))
    engine.dispose()
    return jobs, keys


def test_replay_after_a_crash_between_commit_and_response(live_server, topology):
    live_server.start(topology=topology, **CRASH)
    key = str(uuid.uuid4())
    headers = {"Idempotency-Key": key}
    with live_server.client() as c, pytest.raises(httpx.TransportError):
        c.post("/api/v1/jobs", json=BODY, headers=headers)
    live_server.proc.wait(timeout=30)
    assert live_server.proc.returncode == -9  # it died at the crash point, after the commit
    assert _db_counts(live_server.db_url) == (1, 1)

    live_server.start(topology=topology)
    with live_server.client() as c:
        r = c.post("/api/v1/jobs", json=BODY, headers=headers)
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["name"] == "ci-run" and job["state"] == "queued"
        listed = c.get("/api/v1/jobs").json()
    assert listed["total"] == 1 and listed["items"][0]["id"] == job["id"]
    assert _db_counts(live_server.db_url) == (1, 1)


def test_hai_submit_retries_with_the_same_key_across_a_crash(live_server, topology):
    """`hai submit` against a server that dies after committing: a supervisor (this test)
    restarts the server; the CLI's retry gets the job created before the crash."""
    live_server.start(topology=topology, **CRASH)
    first = live_server.proc

    def restart_when_dead() -> None:
        first.wait(timeout=60)
        live_server.start(topology=topology)

    supervisor = threading.Thread(target=restart_when_dead)
    supervisor.start()
    env = {**os.environ, "HAI_SERVER": live_server.url, "HAI_TOKEN": live_server.admin_token}
    out = subprocess.run(
        [sys.executable, "-m", "hai.cli.main", "submit", "--gpus-per-node", "1", "--name", "cli", "--", "echo", "hi"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    supervisor.join(timeout=90)
    assert first.returncode == -9
    assert out.returncode == 0, out.stderr
    assert live_server.starts == 2
    wait_for(live_server.healthy, timeout=30, what="the restarted server")
    with live_server.client() as c:
        listed = c.get("/api/v1/jobs").json()
    assert listed["total"] == 1
    assert out.stdout.strip() == str(listed["items"][0]["id"])
    assert _db_counts(live_server.db_url) == (1, 1)
