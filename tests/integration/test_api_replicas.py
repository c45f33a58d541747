"""Issue 12: any number of `hai server` replicas on one PostgreSQL. Two real API processes, a
separate `hai scheduler`, two fake-GPU agents split between the replicas; each job's log is
followed (SSE) through the replica its agent does not talk to, live, while the job runs; a
submission on either replica wakes the scheduler. With Redis the wake-ups cross processes
through pub/sub; without Redis every wait is bounded by HAI_REDIS__POLL_S and re-reads the
database."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hai.db.migrate import upgrade
from tests.e2e.conftest import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
ADMIN = "hai_replicas-admin-token-0123456789"
AGENT = "haiagent_replicas-agent-token-0123456789"

# the job prints a line, waits until the test has seen that line through the other replica,
# then prints another and exits
JOB = (
    "import os, sys, time\n"
    "print('started', os.environ['HAI_JOB_ID'], flush=True)\n"
    "gate = sys.argv[1]\n"
    "while not os.path.exists(gate):\n"
    "    time.sleep(0.1)\n"
    "print('done', flush=True)\n"
)


class Procs:
    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.tmp_path, self.env, self.procs = tmp_path, env, []

    def start(self, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
        log_path = self.tmp_path / f"{name}.log"
        log = log_path.open("w")
        p = subprocess.Popen([sys.executable, "-m", "hai.cli.main", *args], cwd=self.tmp_path, env=self.env,
                             stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((p, log))
        return p, log_path

    def stop(self) -> None:
        for p, _ in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p, log in reversed(self.procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
            log.close()


def follow(url: str, job_id: int, gate: Path, seen_running: list[str]) -> tuple[list[str], str]:
    """Follow the job's log as SSE from ``url``; open ``gate`` once 'started' arrived while the
    job was still running (as ``url`` says). Returns the lines and the final state."""
    lines: list[str] = []
    headers = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(120, connect=10)) as c:
        with c.stream("GET", f"/api/v1/jobs/{job_id}/logs", params={"follow": "true"}) as r:
            assert r.status_code == 200
            for event, data in sse(r.iter_lines()):
                if event == "log":
                    lines.append(data)
                    if "started" in data and not gate.exists():
                        seen_running.append(c.get(f"/api/v1/jobs/{job_id}").json()["state"])
                        gate.touch()
                elif event == "end":
                    return lines, data
    raise AssertionError(f"the stream ended without an end event: {lines}")


def sse(lines: Iterator[str]) -> Iterator[tuple[str | None, str]]:
    """(event, data) of each server-sent event's data line, as the lines arrive."""
    event = None
    for raw in lines:
        if raw.startswith("event:"):
            event = raw.split(":", 1)[1].strip()
        elif raw.startswith("data:"):
            yield event, raw.split(":", 1)[1].strip()


@pytest.mark.parametrize("with_redis", [True, False], ids=["redis", "polling"])
def test_two_api_replicas_with_agents_split_between_them(with_redis, pg_url, redis_url, tmp_path):
    upgrade(pg_url)
    ports = {"a": free_port(), "b": free_port()}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    env = {
        **os.environ, "PYTHONUNBUFFERED": "1", "HAI_DB__URL": pg_url, "HAI_REDIS__URL": redis_url if with_redis else "",
        "HAI_DATA_DIR": str(tmp_path / "data"), "HAI_FRONTEND_DIST": str(tmp_path / "none"),
        "HAI_AUTH__BOOTSTRAP_ADMIN_TOKEN": ADMIN, "HAI_AUTH__BOOTSTRAP_AGENT_TOKEN": AGENT,
        # with Redis the scheduler cycles only when woken (the interval is far beyond the test's
        # waits); without, it polls every second
        "HAI_SCHEDULER__INTERVAL_S": "300" if with_redis else "1", "HAI_SCHEDULER__LEASE_S": "900",
        "HAI_REDIS__POLL_S": "1",
    }
    procs = Procs(tmp_path, env)
    try:
        for name, port in ports.items():
            procs.start(f"server-{name}", "server", "--port", str(port))
        for url in urls.values():
            wait_for(lambda url=url: _healthy(url), timeout=120, what=f"{url} to serve")
        _, sched_log = procs.start("scheduler", "scheduler")
        wait_for(lambda: "scheduler: leading" in sched_log.read_text(), timeout=120, what="the scheduler to lead")
        talks_to = {"n0": "a", "n1": "b"}
        for node, replica in talks_to.items():
            procs.start(f"agent-{node}", "agent", "--server", urls[replica], "--token", AGENT, "--node", node,
                        "--zone", "A", "--leaf", "A1", "--fake-gpus", "2", "--state-dir", str(tmp_path / node),
                        "--address", "127.0.0.1", "--stop-jobs-on-exit", "--ranks-as-agent-user")
        admin = {"Authorization": f"Bearer {ADMIN}"}
        wait_for(lambda: sorted(n["name"] for n in httpx.get(f"{urls['b']}/api/v1/nodes", headers=admin).json()
                                if n["state"] == "ready") == ["n0", "n1"], timeout=120, what="both agents to register")

        for submit_on in ("b", "a"):
            gate = tmp_path / f"gate-{submit_on}"
            body = {"name": f"on-{submit_on}", "command": [sys.executable, "-c", JOB, str(gate)], "nodes": 1,
                    "gpus_per_node": 2}
            submitted = time.monotonic()
            r = httpx.post(f"{urls[submit_on]}/api/v1/jobs", json=body, headers=admin)
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            job = wait_for(lambda: _placed(urls[submit_on], job_id, admin), timeout=120, what=f"job {job_id} placed")
            if with_redis:
                # woken by the submission through Redis, not by its 300 s interval
                assert time.monotonic() - submitted < 120
            node = job["placement"][0]["node"]
            other = "b" if talks_to[node] == "a" else "a"
            seen_running: list[str] = []
            lines, final = follow(urls[other], job_id, gate, seen_running)
            assert final == "succeeded"
            assert seen_running in (["starting"], ["running"])  # the line came live, before the end
            assert [ln.split("] ", 1)[1] for ln in lines] == [f"started {job_id}", "done"]
    finally:
        procs.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _placed(url: str, job_id: int, headers: dict) -> dict | None:
    job = httpx.get(f"{url}/api/v1/jobs/{job_id}", headers=headers).json()
    return job if job.get("placement") else None
