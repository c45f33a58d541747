"""End to end, issue 4: the checkpoint handshake with a real torch DDP job (gloo on CPU), a job
that ignores the request, and an agent restarted mid-job. Real agent and job processes."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import TERMINAL, low_job_yields_to_high_job_and_resumes_exactly, start_stack, stop_stack, wait_for

pytest.importorskip("torch", reason="torch is installed by `make test` (torch==2.13.0)")



@pytest.fixture
def preempting_stack(tmp_path):
    s = start_stack(tmp_path, agents=2, extra_env={"HAI_SCHEDULER__MIN_RUNTIME_S": "0"}, gpus_per_agent=2)
    yield s
    stop_stack(s)


def test_low_job_yields_to_high_job_and_resumes_exactly(preempting_stack):
    low_job_yields_to_high_job_and_resumes_exactly(preempting_stack)


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


def _agent_pid(node: str) -> tuple[int, list[str], dict[str, str]]:
    """The agent process of ``node``: its pid, argv and environment (``hai dev`` hands agents the
    node credential by environment, not on the command line)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "agent" in argv and "--node" in argv and argv[argv.index("--node") + 1] == node and "hai.cli.main" in argv:
            env = dict(kv.split("=", 1) for kv in (entry / "environ").read_bytes().decode().split("\0") if "=" in kv)
            return int(entry.name), [a for a in argv if a], env
    raise AssertionError(f"no agent process for {node}")


def test_agent_killed_and_restarted_mid_job_reattaches(stack, tmp_path):
    job = stack.submit(name="survivor", gpus_per_node=1,
                       command=["bash", "-c", "echo before; sleep 8; echo after"])
    running = stack.wait_state(job["id"], {"running"})
    node = running["placement"][0]["node"]
    pids_before = sorted(stack.job_processes(job["id"]))
    assert pids_before
    pid, argv, agent_env = _agent_pid(node)
    os.kill(pid, signal.SIGKILL)
    # the job's processes live on without their agent (every one seen before the kill is still
    # there; bash may have forked its `sleep` in between, so the set may have grown)
    assert set(pids_before) <= set(stack.job_processes(job["id"]))
    restarted = subprocess.Popen(argv, env={**agent_env, "PYTHONUNBUFFERED": "1"},
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
