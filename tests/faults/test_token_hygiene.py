"""Tokens never reach the logs (issue 13): a real `hai server` is driven through every kind of
authenticated request -- users, a node agent, tokens created and revoked, a token tried in the
query string, wrong tokens -- and its whole log output is searched for every secret issued."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from hai.protocol import AgentHello, GpuInfo
from tests.e2e.conftest import start_stack, stop_stack


def test_no_issued_token_appears_in_the_server_logs(live_server, topology):
    live_server.start(topology=topology)
    issued = [live_server.admin_token, live_server.agent_token]
    with live_server.client() as admin:
        assert admin.get("/api/v1/me").status_code == 200
        for name in ("ci", "laptop"):
            r = admin.post("/api/v1/tokens", json={"name": name, "expires_in_s": 3600})
            assert r.status_code == 201, r.text
            issued.append(r.json()["token"])
            token_id = r.json()["id"]
        with live_server.client(issued[-1]) as user:
            assert user.get("/api/v1/jobs").status_code == 200
            r = user.post("/api/v1/jobs", json={"name": "j", "command": ["true"], "gpus_per_node": 1},
                          headers={"Idempotency-Key": "log-test"})
            assert r.status_code == 201, r.text
        assert admin.delete(f"/api/v1/tokens/{token_id}").status_code == 200
        with live_server.client(issued[-1]) as revoked:
            assert revoked.get("/api/v1/me").status_code == 401
        # a token in the URL is refused, and its access-log line is masked
        assert admin.get("/api/v1/me", params={"access_token": issued[2]}).status_code == 400
        assert admin.get("/api/v1/jobs", params={"q": issued[2]}).status_code in (200, 422)
    with live_server.client(live_server.agent_token) as agent:
        hello = AgentHello(node="n0", zone="A", leaf="A1", address="127.0.0.1", fake_gpus=True,
                           gpus=[GpuInfo(index=0, uuid="GPU-n0-0", model="Fake", memory_total_mib=1024)])
        assert agent.post("/api/v1/agent/register", json=hello.model_dump(mode="json")).status_code == 200
    with live_server.client("hai_" + "x" * 43) as wrong:
        assert wrong.get("/api/v1/me").status_code == 401
    live_server.kill()

    logs = live_server.logs()
    assert "GET /api/v1/me" in logs and "POST /api/v1/agent/register" in logs  # the access log is there
    assert "access_token=hai_***" in logs  # the refused URL was logged, masked
    leaked = [t[:10] for t in issued if t in logs]
    assert leaked == [], f"tokens found in the server log: {leaked}"
    assert "x" * 43 not in logs


def test_a_full_run_prints_no_token_anywhere(tmp_path):
    """Server, scheduler and agent (`hai dev`, one log), the CLI (create-user, submit, jobs, logs,
    me), personal tokens made, used and revoked, and a job that prints its whole environment:
    no token issued appears in the server/agent log, the CLI's output other than the one
    command that hands a token out, the job's log, the agent's state folder or the database."""
    stack = start_stack(tmp_path, agents=1)
    issued = [stack.admin_token, (stack.data_dir / "agent-token").read_text().strip()]
    outputs: list[str] = []
    try:
        made = stack.cli("admin", "create-user", "carol", "--group", "g", "--data-dir", str(stack.data_dir), check=True)
        issued.append(made.stdout.strip().splitlines()[-1])  # handing the token out is this command's job
        outputs.append(made.stderr)
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {issued[2]}"}, timeout=30) as c:
            r = c.post("/api/v1/tokens", json={"name": "ci", "expires_in_s": 3600})
            assert r.status_code == 201, r.text
            issued.append(r.json()["token"])
            assert c.delete(f"/api/v1/tokens/{r.json()['id']}").status_code == 200
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {issued[3]}"}, timeout=30) as c:
            assert c.get("/api/v1/me").status_code == 401  # revoked
        env = {"HAI_SERVER": stack.url, "HAI_TOKEN": issued[2]}

        def cli(*args: str) -> str:
            out = subprocess.run([sys.executable, "-m", "hai.cli.main", *args], env={**os.environ, **env},
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            outputs.append(out.stdout + out.stderr)
            return out.stdout

        job_id = int(cli("submit", "--gpus-per-node", "1", "--", "env").strip().split()[-1])
        stack.wait_state(job_id, {"succeeded"}, timeout=180)
        cli("jobs")
        cli("me")
        job_log = cli("logs", str(job_id))
        assert "HAI_JOB_ID=" in job_log  # the job did print its environment
    finally:
        stop_stack(stack)

    searched = {"dev.log (server, scheduler, agent)": (tmp_path / "dev.log").read_text(errors="replace"),
                "CLI output": "\n".join(outputs)}
    for path in stack.data_dir.rglob("*"):
        if path.is_file() and path.name not in ("admin-token", "agent-token"):  # the secrets' own files
            searched[str(path.relative_to(stack.data_dir))] = path.read_bytes().decode(errors="replace")
    assert any(k.startswith("agents") for k in searched), "the agent's state folder was searched"
    leaks = [(where, token[:12]) for where, text in searched.items() for token in issued if token in text]
    assert leaks == [], f"tokens found: {leaks}"
