"""The whole system: `hai dev` as a real process (API server, scheduler, agent processes), on
loopback, on a fresh data dir. Tests talk to it over HTTP like a user would."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import httpx
import pytest

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], T], *, timeout: float = 60.0, what: str = "condition", interval: float = 0.1) -> T:
    """Poll a condition until it holds (returns its truthy value) or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value: {last!r})")


@dataclass
class Stack:
    url: str
    data_dir: Path
    proc: subprocess.Popen
    admin_token: str

    def client(self, token: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token or self.admin_token}"}, timeout=30)

    def job(self, job_id: int) -> dict:
        with self.client() as c:
            r = c.get(f"/api/v1/jobs/{job_id}")
            r.raise_for_status()
            return r.json()

    def submit(self, **body) -> dict:
        body.setdefault("name", "e2e")
        with self.client() as c:
            r = c.post("/api/v1/jobs", json=body)
            assert r.status_code == 201, r.text
            return r.json()

    def wait_state(self, job_id: int, states: set[str], timeout: float = 90) -> dict:
        return wait_for(lambda: (j := self.job(job_id))["state"] in states and j, timeout=timeout,
                        what=f"job {job_id} to reach {sorted(states)}")

    def job_processes(self, job_id: int) -> list[int]:
        return processes_with_env("HAI_JOB_ID", str(job_id), within=self.data_dir)

    def logs(self, job_id: int, **params) -> str:
        with self.client() as c:
            return c.get(f"/api/v1/jobs/{job_id}/logs", params=params).text

    def cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        env = {**os.environ, "HAI_SERVER": self.url, "HAI_TOKEN": self.admin_token}
        out = subprocess.run([sys.executable, "-m", "hai.cli.main", *args], env=env, capture_output=True, text=True, timeout=120)
        if check:
            assert out.returncode == 0, out.stderr
        return out


def start_stack(tmp_path: Path, agents: int = 2, extra_env: dict | None = None, gpus_per_agent: int = 8, *,
                nodes_ready: Callable[[list[dict]], bool] | None = None, what: str = "hai dev and its agents") -> Stack:
    """`hai dev` with ``agents`` fake-GPU agents, up once ``nodes_ready(GET /api/v1/nodes)`` holds
    (default: ``agents`` nodes are ready). Its log, ``tmp_path/dev.log``, is appended to, so a
    stack restarted in the same folder keeps the first one's lines."""
    if nodes_ready is None:
        def nodes_ready(nodes: list[dict]) -> bool:
            return len([n for n in nodes if n["state"] == "ready"]) == agents
    port = free_port()
    data_dir = tmp_path / "hai"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HAI_FRONTEND_DIST": str(tmp_path / "no-dashboard"), **(extra_env or {})}
    log = (tmp_path / "dev.log").open("a")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hai.cli.main", "dev", "--port", str(port), "--agents", str(agents), "--data-dir", str(data_dir),
         "--gpus-per-agent", str(gpus_per_agent)],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def ready():
        if proc.poll() is not None:
            raise AssertionError(f"hai dev exited with {proc.returncode}: {(tmp_path / 'dev.log').read_text()[-3000:]}")
        token_file = data_dir / "admin-token"
        if not token_file.exists():
            return None
        try:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token_file.read_text().strip()}"}) as c:
                nodes = c.get("/api/v1/nodes").json()
        except (httpx.HTTPError, ValueError):
            return None
        return isinstance(nodes, list) and nodes_ready(nodes)

    wait_for(ready, timeout=90, what=what)
    return Stack(url=url, data_dir=data_dir, proc=proc, admin_token=(data_dir / "admin-token").read_text().strip())


def stop_stack(stack: Stack) -> None:
    if stack.proc.poll() is None:
        stack.proc.send_signal(signal.SIGINT)
        try:
            stack.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(stack.proc.pid, signal.SIGKILL)
            stack.proc.wait(10)


@pytest.fixture
def stack(tmp_path):
    s = start_stack(tmp_path, agents=2)
    yield s
    stop_stack(s)


def live_processes(part: str) -> Iterator[tuple[int, list[bytes]]]:
    """(pid, its /proc ``part``, "environ" or "cmdline", split at NULs) of every live process,
    zombies left out (reads /proc, like ps e)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / part).read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if ") Z " not in stat:
            yield int(entry.name), fields


def processes_with_env(key: str, value: str, *, within: Path | None = None) -> list[int]:
    """PIDs of live processes whose environment holds key=value and, with ``within``, some
    variable pointing under that folder (one stack's jobs, not another's)."""
    needle = f"{key}={value}".encode()
    marker = str(within).encode() if within is not None else b""
    return [pid for pid, env in live_processes("environ")
            if needle in env and (not marker or any(marker in v for v in env))]


TERMINAL = {"succeeded", "failed", "cancelled"}
DDP_EXAMPLE = str(REPO / "examples" / "haiscale_ddp.py")


def final_step(logs: str) -> tuple[int, str]:
    """The DDP example's last (step, parameter checksum), from rank 0 of whichever attempt."""
    m = re.search(r"\[(?:attempt \d+ )?rank 0\] final step=(\d+) checksum=(\w+)", logs)
    assert m, logs[-2000:]
    return int(m.group(1)), m.group(2)


def low_job_yields_to_high_job_and_resumes_exactly(stack: Stack, *,
                                                    suspend_requested: Callable[[int], object] | None = None) -> None:
    """The checkpoint handshake end to end, whatever runs the ranks (agents or pods): a LOW 2-node
    torch DDP job (gloo) is suspended at its checkpoint for a HIGH job, which runs on the GPUs it
    freed; the LOW job resumes from that checkpoint and ends at the same step with the same
    parameters as the same training never interrupted. ``suspend_requested(job_id)``: a check
    of how the executor delivered the suspend request, polled until true."""
    ddp = [sys.executable, DDP_EXAMPLE, "--steps", "150", "--step-sleep", "0.05", "--backend", "gloo", "--log-every", "50"]
    low = stack.submit(name="low", priority="LOW", nodes=2, gpus_per_node=2, job_type="torch", command=ddp)
    stack.wait_state(low["id"], {"running"})
    wait_for(lambda: "first step done" in stack.logs(low["id"]), timeout=120, what="the LOW job to train")

    high = stack.submit(name="high", priority="HIGH", nodes=1, gpus_per_node=2, command=["bash", "-c", "echo high ran"])
    if suspend_requested is not None:
        wait_for(lambda: suspend_requested(low["id"]), timeout=60, what="the suspend request to reach the LOW job")
    # the LOW job is asked to suspend, checkpoints, and goes back to the queue
    suspended = wait_for(lambda: (j := stack.job(low["id"]))["suspensions"] == 1 and j, timeout=120,
                         what="the LOW job to be suspended")
    assert suspended["last_checkpoint"] is not None, suspended["events"]
    assert suspended["lost_gpu_s"] == 0, suspended["events"]
    assert any("suspended at its checkpoint" in e["reason"] for e in suspended["events"]), suspended["events"]
    assert any(e["to_state"] == "suspending" and "HIGH" in e["reason"] for e in suspended["events"]), suspended["events"]
    # the HIGH job runs, on GPUs the LOW job freed
    done_high = stack.wait_state(high["id"], TERMINAL, timeout=120)
    assert done_high["state"] == "succeeded"
    assert "high ran" in stack.logs(high["id"])
    # the LOW job resumes from its checkpoint and finishes
    done_low = stack.wait_state(low["id"], TERMINAL, timeout=240)
    assert done_low["state"] == "succeeded", done_low
    assert done_low["attempt"] == 2 and done_low["exit_code"] == 0
    logs = stack.logs(low["id"])
    assert f"resumed from {suspended['last_checkpoint']['path']}" in logs
    assert "[attempt 1 rank 0] suspended at step" in logs
    step, checksum = final_step(logs)

    # the same training, never interrupted, ends at the same step with the same parameters (run
    # through the platform once per test session: gloo on the CPU gives the same result whichever
    # executor ran it, agents or pods, so the second test compares with the first one's run)
    assert (step, checksum) == _uninterrupted(stack, ddp)
    assert step == 150


_REFERENCE: dict[tuple[str, ...], tuple[int, str]] = {}


def _uninterrupted(stack: Stack, ddp: list[str]) -> tuple[int, str]:
    key = tuple(ddp[1:])
    if key not in _REFERENCE:
        ref = stack.submit(name="reference", priority="LOW", nodes=2, gpus_per_node=2, job_type="torch", command=ddp)
        done_ref = stack.wait_state(ref["id"], TERMINAL, timeout=240)
        assert done_ref["state"] == "succeeded" and done_ref["suspensions"] == 0 and done_ref["attempt"] == 1
        _REFERENCE[key] = final_step(stack.logs(ref["id"]))
    return _REFERENCE[key]
