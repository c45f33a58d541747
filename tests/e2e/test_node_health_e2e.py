"""End to end, issue 10: node health with fake-GPU agents as real processes (`hai dev` plus an
agent started by the test with ``--inject-fault``). Drain moves a job at its checkpoint; a
fault makes a node unhealthy and its job resumes elsewhere; undrain is gated by validation; a
killed agent makes its node lost; non-admins are refused."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.e2e.conftest import start_stack, stop_stack, wait_for

TERMINAL = {"succeeded", "failed", "cancelled"}

# a job that counts steps, checkpoints (a JSON file) when asked to suspend and resumes from it
STEPPER = textwrap.dedent('''
    import json, os, sys, time
    from hai import sdk
    total = int(sys.argv[1])
    every = int(sys.argv[2]) if len(sys.argv) > 2 else 0  # also checkpoint every N steps
    start = 0
    path = sdk.resume_path()
    if path:
        start = json.load(open(path))["next"]
        print(f"resumed from {path} at step {start}", flush=True)
    for step in range(start, total):
        if sdk.should_suspend():
            ck = os.path.join(sdk.checkpoint_dir(), f"step-{step}.json")
            with open(ck, "w") as f:
                json.dump({"next": step}, f)
            sdk.report_checkpoint(ck, step=step)
            sdk.suspend_ready()
            print(f"suspended before step {step}", flush=True)
            sys.exit(0)
        if every and step and step % every == 0:
            ck = os.path.join(sdk.checkpoint_dir(), f"step-{step}.json")
            with open(ck, "w") as f:
                json.dump({"next": step}, f)
            sdk.report_checkpoint(ck, step=step)
        print(f"step {step}", flush=True)
        time.sleep(0.1)
    print("done", flush=True)
''')

ENV = {
    "HAI_SCHEDULER__MIN_RUNTIME_S": "0",
    "HAI_VALIDATION__QUICK_EVERY_HEARTBEATS": "1",
    "HAI_VALIDATION__UNDRAIN_TIMEOUT_S": "60",
    # above the agents' 10 s long poll, with room for a loaded 2-core CI machine: a node that
    # misses its lease there is found lost and its job requeued by the reaper, not by the fault
    "HAI_AGENT__LOST_AFTER_S": "30",
}


@pytest.fixture
def health_stack(tmp_path):
    s = start_stack(tmp_path, agents=2, extra_env=ENV, gpus_per_agent=2)
    yield s
    stop_stack(s)


def _script(tmp_path: Path) -> str:
    p = tmp_path / "stepper.py"
    p.write_text(STEPPER)
    return str(p)


def _node(stack, name: str) -> dict:
    with stack.client() as c:
        r = c.get(f"/api/v1/nodes/{name}")
        r.raise_for_status()
        return r.json()


def _state(stack, name: str) -> str | None:
    """The node's state, None while it is not registered yet."""
    with stack.client() as c:
        r = c.get(f"/api/v1/nodes/{name}")
    return r.json()["state"] if r.status_code == 200 else None


def _steps(logs: str) -> list[int]:
    return [int(m) for m in re.findall(r"^(?:\[[^\]]*\] )?step (\d+)$", logs, flags=re.M)]


def _start_agent(stack, tmp_path: Path, node: str, *extra: str) -> subprocess.Popen:
    token = (stack.data_dir / "agent-token").read_text().strip()
    cmd = [sys.executable, "-m", "hai.cli.main", "agent", "--server", stack.url, "--token", token, "--node", node,
           "--zone", "A", "--leaf", "A1", "--fake-gpus", "2", "--state-dir", str(tmp_path / "agents" / node),
           "--address", "127.0.0.1", "--stop-jobs-on-exit", "--ranks-as-agent-user",
           "--checkpoint-root", str((stack.data_dir / "checkpoints").resolve()), *extra]
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=(tmp_path / f"{node}.log").open("w"), stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_admin_drain_moves_the_job_at_its_checkpoint_and_leaves_the_node_drained(health_stack, tmp_path):
    stack = health_stack
    job = stack.submit(name="stepper", gpus_per_node=2, command=[sys.executable, _script(tmp_path), "60"])
    running = stack.wait_state(job["id"], {"running"})
    node = running["placement"][0]["node"]
    wait_for(lambda: len(_steps(stack.logs(job["id"]))) >= 5, what="the job to make progress")
    out = stack.cli("nodes", "drain", node, "--reason", "replacing a fan")
    assert out.returncode == 0, out.stderr
    assert "draining" in out.stdout or "drained" in out.stdout
    # the job checkpoints, leaves, resumes on the other node and finishes
    done = stack.wait_state(job["id"], TERMINAL, timeout=120)
    assert done["state"] == "succeeded", done
    assert done["attempt"] == 2 and done["suspensions"] == 0 and done["restarts"] == 0
    assert done["placement"][0]["node"] != node
    assert any(f"moved off node {node} (drain) at its checkpoint" in e["reason"] for e in done["events"])
    logs = stack.logs(job["id"])
    assert _steps(logs) == list(range(60))  # every step exactly once across the two attempts
    assert "resumed from" in logs
    n = _node(stack, node)
    assert n["state"] == "drained" and n["state_reason"] == "drained by admin: replacing a fan"
    assert [e["to_state"] for e in n["events"]][-2:] == ["draining", "drained"]
    # the CLI lists it with the reason; show prints the events
    listing = stack.cli("nodes", check=True).stdout
    assert re.search(rf"{node}\s.*drained\s+drained by admin: replacing a fan", listing), listing
    assert "draining -> drained" in stack.cli("nodes", "show", node, check=True).stdout
    # undrain of a healthy node passes its validation and brings it back
    out = stack.cli("nodes", "undrain", node)
    assert out.returncode == 0, out.stderr
    n = _node(stack, node)
    assert n["state"] == "ready" and "validation run" in n["events"][-1]["reason"]
    with stack.client() as c:
        runs = c.get(f"/api/v1/nodes/{node}/validations").json()  # newest first
    # (the agent's own quick rounds, every heartbeat here, may already have come after it)
    undrain = next(r for r in runs if r["trigger"] == "undrain")
    assert undrain["status"] == "passed" and undrain["requested_by"].startswith("admin:")
    assert {c["name"] for c in undrain["checks"]} >= {"gpu_xid", "gemm_tflops", "gpu_memtest"}
    # issue 12 (protocol version 2): the agent ran its periodic quick rounds itself; each is a run
    own = [r for r in runs if r["requested_by"] == "agent"]
    assert own and all(r["trigger"] == "periodic" and r["level"] == "quick" and r["status"] == "passed"
                       and r["started_at"] and {c["name"] for c in r["checks"]} >= {"gpu_inventory", "gpu_xid"}
                       for r in own), own


def test_an_xid_79_makes_the_node_unhealthy_and_its_job_resumes_elsewhere(health_stack, tmp_path):
    stack = health_stack
    # both dev nodes busy with a long job each, so our job lands on the faulty node
    blockers = [stack.submit(name=f"block{i}", gpus_per_node=2, command=["sleep", "600"]) for i in range(2)]
    for b in blockers:
        stack.wait_state(b["id"], {"running"})
    agent = _start_agent(stack, tmp_path, "faulty", "--inject-fault", "xid:79@8")
    try:
        wait_for(lambda: _state(stack, "faulty") == "ready", timeout=60, what="the faulty node to register")
        job = stack.submit(name="stepper", gpus_per_node=2, command=[sys.executable, _script(tmp_path), "400"])
        running = stack.wait_state(job["id"], {"running"})
        assert running["placement"][0]["node"] == "faulty"
        n = wait_for(lambda: (x := _node(stack, "faulty"))["state"] == "unhealthy" and x, timeout=90,
                     what="the node to become unhealthy")
        assert "Xid 79" in n["state_reason"] and "gpu_xid" in n["state_reason"]
        assert n["events"][-1]["actor"] == "validator"
        # free a healthy node: the job resumes there from its checkpoint
        with stack.client() as c:
            c.post(f"/api/v1/jobs/{blockers[0]['id']}/cancel").raise_for_status()
        done = stack.wait_state(job["id"], TERMINAL, timeout=150)
        assert done["state"] == "succeeded", done
        assert done["failure_reason"] is None and done["attempt"] == 2
        assert done["placement"][0]["node"] != "faulty"
        assert _steps(stack.logs(job["id"])) == list(range(400))
        # undrain is refused naming the failed check; force succeeds
        out = stack.cli("nodes", "undrain", "faulty")
        assert out.returncode == 1 and "gpu_xid" in out.stderr and "Xid 79" in out.stderr, out.stderr
        with stack.client() as c:
            r = c.post("/api/v1/nodes/faulty/undrain", json={"force": False})
        assert r.status_code == 409
        assert [f["name"] for f in r.json()["detail"]["failed_checks"]] == ["gpu_xid"]
        assert _node(stack, "faulty")["state"] == "unhealthy"
        assert stack.cli("nodes", "undrain", "faulty", "--force").returncode == 0
        n = _node(stack, "faulty")
        forced = [e for e in n["events"] if e["to_state"] == "ready" and "forced" in e["reason"]]
        assert len(forced) == 1 and forced[0]["from_state"] == "unhealthy"
        # the Xid stays in the kernel log: the agent's next own quick round (every heartbeat here)
        # finds it again and the node is out of service once more
        at = n["events"].index(forced[0])  # (the round may have come already)
        n = wait_for(lambda: (x := _node(stack, "faulty"))["state"] == "unhealthy" and len(x["events"]) > at + 1 and x,
                     timeout=60, what="the next quick round to find the Xid")
        assert n["events"][at + 1]["to_state"] == "unhealthy"
        assert "gpu_xid" in n["state_reason"]
        run_id = n["events"][-1]["detail"]["run_id"]
        with stack.client() as c:
            run = c.get(f"/api/v1/validations/{run_id}").json()
        assert (run["trigger"], run["requested_by"], run["status"]) == ("periodic", "agent", "failed")
    finally:
        _stop(agent)


def test_a_gpu_lost_under_a_job_kills_its_rank_and_the_job_restarts_from_its_checkpoint(health_stack, tmp_path):
    stack = health_stack
    blockers = [stack.submit(name=f"block{i}", gpus_per_node=2, command=["sleep", "600"]) for i in range(2)]
    for b in blockers:
        stack.wait_state(b["id"], {"running"})
    agent = _start_agent(stack, tmp_path, "flaky", "--inject-fault", "gpu-missing@12")
    try:
        wait_for(lambda: _state(stack, "flaky") == "ready", timeout=60, what="the flaky node to register")
        job = stack.submit(name="stepper", gpus_per_node=2, command=[sys.executable, _script(tmp_path), "300", "20"])
        assert stack.wait_state(job["id"], {"running"})["placement"][0]["node"] == "flaky"
        # the GPU goes, the rank is killed, the node's checks find it: unhealthy, job requeued
        n = wait_for(lambda: (x := _node(stack, "flaky"))["state"] == "unhealthy" and x, timeout=90,
                     what="the node to become unhealthy")
        assert "gpu_inventory" in n["state_reason"]
        queued = wait_for(lambda: (j := stack.job(job["id"]))["restarts"] == 1 and j, timeout=60,
                          what="the job requeued as a restart")
        assert queued["failure_reason"] is None and queued["exit_code"] is None
        assert any("faulty" in e["reason"] for e in queued["events"]), (
            [e["reason"] for e in queued["events"]], [e["reason"] for e in _node(stack, "flaky")["events"]])
        ckpt_step = queued["last_checkpoint"]["step"]
        with stack.client() as c:
            c.post(f"/api/v1/jobs/{blockers[0]['id']}/cancel").raise_for_status()
        done = stack.wait_state(job["id"], TERMINAL, timeout=150)
        assert done["state"] == "succeeded" and done["attempt"] == 2 and done["restarts"] == 1
        logs = stack.logs(job["id"])
        assert f"at step {ckpt_step}" in logs  # resumed from its last reported checkpoint
        steps = _steps(logs)
        assert sorted(set(steps)) == list(range(300)) and steps[-1] == 299
    finally:
        _stop(agent)


def test_validate_on_demand_with_fault_injection_reports_each_check(health_stack, tmp_path):
    stack = health_stack
    agent = _start_agent(stack, tmp_path, "slow", "--inject-fault", "slow-gemm")
    try:
        wait_for(lambda: _state(stack, "slow") in ("ready", "unhealthy"), timeout=60, what="registration")
        out = stack.cli("nodes", "validate", "slow", "--wait")
        assert out.returncode == 1, out.stdout + out.stderr
        assert re.search(r"failed\s+gemm_tflops\s+critical", out.stdout), out.stdout
        assert re.search(r"skipped\s+ib_ports", out.stdout), out.stdout
        assert _node(stack, "slow")["state"] == "unhealthy"
    finally:
        _stop(agent)


def test_a_killed_agent_makes_its_node_lost_and_its_job_requeue(health_stack, tmp_path):
    stack = health_stack
    # keep the dev nodes busy so the job lands on the mortal node
    blockers = [stack.submit(name=f"block{i}", gpus_per_node=2, command=["sleep", "600"]) for i in range(2)]
    for b in blockers:
        stack.wait_state(b["id"], {"running"})
    agent = _start_agent(stack, tmp_path, "mortal")
    wait_for(lambda: _state(stack, "mortal") == "ready", timeout=60, what="registration")
    job = stack.submit(name="victim", gpus_per_node=2, command=["sleep", "600"])
    running = stack.wait_state(job["id"], {"running"})
    assert running["placement"][0]["node"] == "mortal"
    agent.kill()
    agent.wait(10)
    n = wait_for(lambda: (x := _node(stack, "mortal"))["state"] == "lost" and x, timeout=90, what="the node lost")
    assert n["events"][-1]["actor"] == "reaper"
    j = wait_for(lambda: (x := stack.job(job["id"]))["restarts"] == 1 and x, timeout=30, what="the requeue")
    assert j["failure_reason"] is None and j["state"] in ("queued", "starting", "running")
    # the agent comes back: ready only after a passing validation
    agent = _start_agent(stack, tmp_path, "mortal")
    try:
        n = wait_for(lambda: (x := _node(stack, "mortal"))["state"] == "ready" and x, timeout=90,
                     what="the node back to ready")
        assert n["events"][-1]["from_state"] == "lost" and "validation run" in n["events"][-1]["reason"]
    finally:
        _stop(agent)


def test_non_admins_are_refused_everywhere(health_stack):
    stack = health_stack
    out = subprocess.run([sys.executable, "-m", "hai.cli.main", "admin", "create-user", "eve", "--group", "g",
                          "--data-dir", str(stack.data_dir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip().splitlines()[-1]
    with stack.client(token) as c:
        for path, body in (("drain", {"reason": "x"}), ("undrain", {"force": True}), ("undrain", {"force": False}),
                           ("validate", None)):
            assert c.post(f"/api/v1/nodes/node-01/{path}", json=body).status_code == 403
    assert _node(stack, "node-01")["state"] == "ready"
    env = {**os.environ, "HAI_SERVER": stack.url, "HAI_TOKEN": token}
    out = subprocess.run([sys.executable, "-m", "hai.cli.main", "nodes", "drain", "node-01", "--reason", "x"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "403" in out.stderr
