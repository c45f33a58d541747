#!/usr/bin/env python
"""The platform on real GPUs, in one command: server + scheduler, N agents (one GPU each,
standing for N nodes; two by default), and examples/haiscale_ddp.py as an N-node `torch` job over
NCCL.

Measures and checks:
  1. throughput of the job under the platform vs the same script started by hand (target >= 98%);
  2. the agents' NVML utilisation while the job trains (from GET /api/v1/nodes);
  3. suspend -> GPUs released, resume -> first training step (seconds);
  4. the suspended-and-resumed run ends at the same step with the same parameters as the
     uninterrupted one.

    python benchmarks/gpu_platform_run.py --out results/            # on a host with 2 GPUs
    python benchmarks/gpu_platform_run.py --agents 1 --out results/ # one GPU: a 1-node job
    python benchmarks/gpu_platform_run.py --share-gpu --backend gloo  # one GPU, two agents on it
    python benchmarks/gpu_platform_run.py --cpu --steps 60 ...      # the same flow on CPU, fake GPUs

With --share-gpu every agent owns GPU 0 (two nodes standing on one GPU): NCCL refuses two ranks
of one communicator on the same GPU, so that mode needs --backend gloo (the model still trains on
the GPU; only the gradient all-reduce goes through host memory).

Prints one JSON object (also written to OUT/gpu_platform_run.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "haiscale_ddp.py"
FINAL = re.compile(r"final step=(\d+) checksum=(\w+)")
THROUGHPUT = re.compile(r"throughput samples/s=([0-9.]+)")
FIRST_STEP = re.compile(r"first step done at ([0-9.]+)")
TERMINAL = {"succeeded", "failed", "cancelled"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


class Platform:
    def __init__(self, work: Path, *, cpu: bool, agents: int, share_gpu: bool, log) -> None:  # noqa: ANN001
        self.work = work
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HAI_SCHEDULER__MIN_RUNTIME_S": "0",
               "HAI_FRONTEND_DIST": str(work / "none")}
        hai = [sys.executable, "-m", "hai.cli.main"]
        self.procs.append(subprocess.Popen(
            hai + ["dev", "--agents", "0", "--port", str(self.port), "--data-dir", str(work / "server")],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        wait_for(lambda: (work / "server" / "agent-token").exists() and self._healthy(), 120, "the server")
        self.admin = (work / "server" / "admin-token").read_text().strip()
        agent_token = (work / "server" / "agent-token").read_text().strip()
        self.agents = agents
        for i in range(agents):
            gpu_args = ["--fake-gpus", "1"] if cpu else ["--gpus", str(0 if share_gpu else i)]
            self.procs.append(subprocess.Popen(
                hai + ["agent", "--server", self.url, "--token", agent_token, "--node", f"gpu-node-{i}",
                       "--zone", "A", "--leaf", f"A{i + 1}", "--state-dir", str(work / f"agent{i}"),
                       "--checkpoint-root", str(work / "checkpoints"), "--address", "127.0.0.1",
                       "--stop-jobs-on-exit", "--ranks-as-agent-user", *gpu_args],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.admin}"}, timeout=30)
        wait_for(lambda: len([n for n in self.http.get("/api/v1/nodes").json() if n["state"] == "ready"]) == agents,
                 120, f"{agents} agents")

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def submit(self, name: str, command: list[str]) -> int:
        r = self.http.post("/api/v1/jobs", json={"name": name, "command": command, "nodes": self.agents, "gpus_per_node": 1,
                                                 "job_type": "torch", "suspend_grace_s": 120})
        r.raise_for_status()
        return r.json()["id"]

    def job(self, job_id: int) -> dict:
        return self.http.get(f"/api/v1/jobs/{job_id}").json()

    def logs(self, job_id: int, **params) -> str:
        return self.http.get(f"/api/v1/jobs/{job_id}/logs", params=params).text

    def wait_done(self, job_id: int, timeout: float = 600) -> dict:
        return wait_for(lambda: (j := self.job(job_id))["state"] in TERMINAL and j, timeout, f"job {job_id}")

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def by_hand(args_list: list[str], work: Path, cpu: bool, world: int, share_gpu: bool) -> str:
    """The same script, one process per node started by hand (what a user would do without the platform)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
        if not cpu:
            env["CUDA_VISIBLE_DEVICES"] = str(0 if share_gpu else rank)
        procs.append(subprocess.Popen([sys.executable, str(EXAMPLE), *args_list, "--ckpt-dir", str(work / f"hand{rank}")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"by-hand run failed: {outs}")
    return outs[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-run"))
    ap.add_argument("--cpu", action="store_true", help="fake GPUs and gloo: check the flow without GPUs")
    ap.add_argument("--agents", type=int, default=2, help="agents (nodes), one GPU each; the job spans all of them")
    ap.add_argument("--share-gpu", action="store_true", help="every agent owns GPU 0 (a host with one GPU)")
    ap.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl on GPUs, gloo on CPU")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=3, help="by-hand and platform runs, alternating")
    ap.add_argument("--suspend-at", type=int, default=200, help="suspend once the job reports this step")
    ap.add_argument("--model", default="--dim 1024 --hidden 4096 --layers 6 --batch-size 256",
                    help="the example's model options, one string")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("HAI_BENCH_WORK", "/tmp/hai-gpu-run"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if a.share_gpu and a.agents > 1 and a.backend == "nccl":
        ap.error("--share-gpu puts several ranks on one GPU, which NCCL refuses: use --backend gloo")
    backend = a.backend or ("gloo" if a.cpu or a.share_gpu else "nccl")
    train = [*shlex.split(a.model), "--steps", str(a.steps), "--log-every", "100", "--warmup", "50",
             "--backend", backend]
    result: dict = {"steps": a.steps, "model": a.model, "cpu": a.cpu, "agents": a.agents,
                    "share_gpu": a.share_gpu, "backend": backend if a.agents > 1 else "none (one rank)"}
    log = (a.out / "platform.log").open("w")

    plat = Platform(work, cpu=a.cpu, agents=a.agents, share_gpu=a.share_gpu, log=log)
    try:
        cmd = [sys.executable, str(EXAMPLE), *train]
        # 1 + 2: by hand and under the platform, alternating (hand, platform, hand, ...) so that
        # warm-up, clocks and temperature drift hit both alike; the platform's server and agents
        # stay up (idle) during the by-hand runs, as an agent does on every node of a cluster.
        hand_sps: list[float] = []
        plat_sps: list[float] = []
        utils: list[float] = []
        busy: dict[str, dict] = {}  # node -> its GPU as reported while the job ran (highest utilisation)
        finals = set()
        for i in range(a.repeat):
            hand = by_hand(train, work / f"hand-{i}", a.cpu, a.agents, a.share_gpu)
            hand_sps.append(float(THROUGHPUT.search(hand).group(1)))
            finals.add(("by hand",) + FINAL.search(hand).groups())
            ref = plat.submit(f"uninterrupted-{i}", cmd)
            deadline = time.monotonic() + 600
            while plat.job(ref)["state"] not in TERMINAL:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {ref} did not finish: {plat.job(ref)}")
                for n in plat.http.get("/api/v1/nodes").json():
                    for g in n["gpu_metrics"]:
                        if g.get("util_pct") is not None and n["running_jobs"]:
                            utils.append(g["util_pct"])
                            if g["util_pct"] >= (busy.get(n["name"]) or {}).get("util_pct", -1):
                                busy[n["name"]] = {"fake": n["fake_gpus"], **g}
                time.sleep(1.0)
            done = plat.job(ref)
            assert done["state"] == "succeeded", done
            ref_logs = plat.logs(ref)
            plat_sps.append(float(THROUGHPUT.search(ref_logs).group(1)))
            finals.add(("platform",) + FINAL.search(ref_logs).groups())
        result["gpus_seen_by_agents"] = busy
        result["by_hand_samples_s"] = hand_sps
        result["platform_samples_s"] = plat_sps
        result["throughput_ratio"] = round(statistics.median(plat_sps) / statistics.median(hand_sps), 4)
        result["throughput_ratio_per_pair"] = [round(p / h, 4) for h, p in zip(hand_sps, plat_sps, strict=True)]
        result["gpu_util_pct_while_training"] = {
            "samples": len(utils), "max": max(utils, default=None),
            "median": sorted(utils)[len(utils) // 2] if utils else None,
        }
        ref_final = FINAL.search(ref_logs).groups()
        result["uninterrupted_final"] = {"step": int(ref_final[0]), "checksum": ref_final[1]}
        result["by_hand_equals_platform"] = len({f[1:] for f in finals}) == 1

        # 3 + 4: suspend mid-run, resume, compare
        job = plat.submit("suspended", cmd)
        wait_for(lambda: ((plat.job(job).get("progress") or {}).get("step") or 0) >= a.suspend_at, 600, "progress")
        t_suspend = time.time()
        plat.http.post(f"/api/v1/jobs/{job}/suspend").raise_for_status()

        def released() -> bool:
            state = plat.job(job)["state"]
            if state in TERMINAL:  # it ended before it saw the request: a longer run is needed
                raise RuntimeError(f"job {job} ended ({state}) before it was suspended; raise --steps")
            return state == "queued" and all(n["free_gpus"] == n["gpus"] for n in plat.http.get("/api/v1/nodes").json())

        wait_for(released, 300, "GPUs released", interval=0.05)
        result["suspend_to_gpus_released_s"] = round(time.time() - t_suspend, 3)
        suspended = plat.job(job)
        result["suspended_at_step"] = (suspended.get("last_checkpoint") or {}).get("step")
        t_resume = time.time()
        plat.http.post(f"/api/v1/jobs/{job}/resume").raise_for_status()
        wait_for(lambda: len(FIRST_STEP.findall(plat.logs(job, attempt=2))) >= 1, 600, "first step after resume",
                 interval=0.05)
        first = float(FIRST_STEP.findall(plat.logs(job, attempt=2))[0])
        result["resume_to_first_step_s"] = round(first - t_resume, 3)
        done = plat.wait_done(job)
        assert done["state"] == "succeeded", done
        final = FINAL.search(plat.logs(job, attempt=2)).groups()
        result["resumed_final"] = {"step": int(final[0]), "checksum": final[1]}
        result["resumed_equals_uninterrupted"] = final == ref_final
        result["lost_gpu_s"] = done["lost_gpu_s"]
        result["suspensions"] = done["suspensions"]
    finally:
        plat.close()
        log.close()
    text = json.dumps(result, indent=2)
    (a.out / "gpu_platform_run.json").write_text(text + "\n")
    print(text)
    ok = result["resumed_equals_uninterrupted"] and result["by_hand_equals_platform"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
