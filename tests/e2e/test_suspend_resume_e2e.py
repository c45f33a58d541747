"""End to end, issue 4: the checkpoint handshake with a real torch DDP job (gloo on CPU), a job
that ignores the request, and an agent restarted mid-job. Real agent and job processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, start_stack, stop_stack, wait_for

pytest.importorskip("torch", reason="torch is installed by `make test` (torch==2.13.0)")

EXAMPLE = str(REPO / "examples" / "haiscale_ddp.py")
TERMINAL = {"succeeded", "failed", "cancelled"}


@pytest.fixture
def preempting_stack(tmp_path):
    s = start_stack(tmp_path, agents=2, extra_env={"HAI_SCHEDULER__MIN_RUNTIME_S": "0"}, gpus_per_agent=2)
    yield s
    stop_stack(s)


def _final(logs: str) -> tuple[int, str]:
    m = re.search(r"\[(?:attempt \d+ )?rank 0\] final step=(\d+) checksum=(\w+)", logs)
    assert m, logs[-2000:]
    return int(m.group(1)), m.group(2)


def test_low_job_yields_to_high_job_and_resumes_exactly(preempting_stack):
    stack = preempting_stack
    ddp = [sys.executable, EXAMPLE, "--steps", "150", "--step-sleep", "0.05", "--backend", "gloo", "--log-every", "50"]
    low = stack.submit(name="low", priority="LOW", nodes=2, gpus_per_node=2, job_type="torch", command=ddp)
    stack.wait_state(low["id"], {"running"})
    wait_for(lambda: "first step done" in stack.logs(low["id"]), timeout=120, what="the LOW job to train")

    high = stack.submit(name="high", priority="HIGH", nodes=1, gpus_per_node=2, command=["bash", "-c", "echo high ran"])
    # the LOW job is asked to suspend, checkpoints, and goes back to the queue
    suspended = wait_for(lambda: (j := stack.job(low["id"]))["suspensions"] == 1 and j, timeout=120,
                         what="the LOW job to be suspended")
    assert suspended["last_checkpoint"] is not None
    assert suspended["lost_gpu_s"] == 0
    assert any("suspended at its checkpoint" in e["reason"] for e in suspended["events"])
    assert any(e["to_state"] == "suspending" and "HIGH" in e["reason"] for e in suspended["events"]), suspended["events"]
    # the HIGH job runs, on GPUs the LOW job freed
    done_high = stack.wait_state(high["id"], TERMINAL, timeout=120)
    assert done_high["state"] == "succeeded"
    # the LOW job resumes from its checkpoint and finishes
    done_low = stack.wait_state(low["id"], TERMINAL, timeout=240)
    assert done_low["state"] == "succeeded", done_low
    assert done_low["attempt"] == 2 and done_low["exit_code"] == 0
    logs = stack.logs(low["id"])
    assert f"resumed from {suspended['last_checkpoint']['path']}" in logs
    assert "[attempt 1 rank 0] suspended at step" in logs
    step, checksum = _final(logs)

    # the same training, never interrupted, ends at the same step with the same parameters
    ref = stack.submit(name="reference", priority="LOW", nodes=2, gpus_per_node=2, job_type="torch", command=ddp)
    done_ref = stack.wait_state(ref["id"], TERMINAL, timeout=240)
    assert done_ref["state"] == "succeeded" and done_ref["suspensions"] == 0
    assert (step, checksum) == _final(stack.logs(ref["id"]))
    assert step == 150


def test_job_ignoring_the_request_is_stopped_after_its_grace_period(preempting_stack):
    stack = preempting_stack
    job = stack.submit(name="stubborn", gpus_per_node=1, suspend_grace_s=2,
                       command=["bash", "-c", "trap '' TERM; echo ignoring; sleep 600"])
    stack.wait_state(job["id"], {"running"})
    wait_for(lambda: stack.job_processes(job["id"]), what="the job's process")
    with stack.client() as c:
        assert c.post(f"/api/v1/jobs/{job['id']}/suspend").json()["state"] == "suspending"
    stopped = stack.wait_state(job["id"], {"queued"}, timeout=60)
    assert stopped["suspensions"] == 1 and stopped["held"] is True
    assert stopped["exit_code"] is None and stopped["failure_reason"] is None  # never a failure
    assert stopped["lost_gpu_s"] > 0
    assert "stopped without a checkpoint" in stopped["events"][-1]["reason"]
    wait_for(lambda: stack.job_processes(job["id"]) == [], what="SIGKILL after SIGTERM was ignored")


def _agent_pid(node: str) -> tuple[int, list[str]]:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "agent" in argv and "--node" in argv and argv[argv.index("--node") + 1] == node and "hai.cli.main" in argv:
            return int(entry.name), [a for a in argv if a]
    raise AssertionError(f"no agent process for {node}")


def test_agent_killed_and_restarted_mid_job_reattaches(stack, tmp_path):
    job = stack.submit(name="survivor", gpus_per_node=1,
                       command=["bash", "-c", "echo before; sleep 8; echo after"])
    running = stack.wait_state(job["id"], {"running"})
    node = running["placement"][0]["node"]
    pids_before = sorted(stack.job_processes(job["id"]))
    assert pids_before
    pid, argv = _agent_pid(node)
    os.kill(pid, signal.SIGKILL)
    # the job's processes live on without their agent (every one seen before the kill is still
    # there; bash may have forked its `sleep` in between, so the set may have grown)
    assert set(pids_before) <= set(stack.job_processes(job["id"]))
    restarted = subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                 stdout=(tmp_path / "agent2.log").open("w"), stderr=subprocess.STDOUT)
    try:
        done = stack.wait_state(job["id"], TERMINAL, timeout=120)
        assert done["state"] == "succeeded"
        assert done["attempt"] == 1 and done["restarts"] == 0  # no second launch
        logs = stack.logs(job["id"])
        assert logs.count("before") == 1 and logs.count("after") == 1
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(30)
