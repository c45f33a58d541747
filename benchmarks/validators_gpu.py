#!/usr/bin/env python
"""The validator suite on real hardware, through a real agent (issue 10), in one command:

    python benchmarks/validators_gpu.py --out gpu-run/              # a GPU host (NVML + torch)
    python benchmarks/validators_gpu.py --cpu --out /tmp/v          # the same flow, fake GPUs

Starts the server + scheduler (`hai dev --agents 0`, embedded SQLite), one `hai agent` with NVML
(`--gpus 0` by default; ``--gpus all`` for every GPU of the host), asks for the full suite with
``POST /api/v1/nodes/{name}/validate`` as an admin would, waits for the run, then runs a quick
round and a drain/undrain cycle (the undrain is gated by a second full run). Prints one JSON
object with every check's status, value, threshold, unit, detail, duration and extras (GEMM
TFLOPS per GPU against the model's expected figure, device and host copy bandwidth, memory test
size and time), the node's events, and the wall time of each step; also written to
OUT/validators_gpu.json.

On a node of one GPU the multi-GPU checks (nccl_allreduce, p2p_bw) must say ``skipped``.
``--load-gpu N`` (a node of several GPUs, issue 15): afterwards, a second process keeps GPU N
busy with back-to-back BF16 matrix products (a slow GPU, injected) while another full run is
asked for; its ``nccl_allreduce`` must fail. NVLink multicast stays off in every process started
here (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1, unless set).
The Xid check reads /dev/kmsg (root or CAP_SYSLOG) or ``journalctl -k``; it says ``skipped``,
with why, when neither can be read.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout: float, what: str, interval: float = 0.25):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


# the injected load: back-to-back 8192^3 BF16 products on one GPU until killed
_HOG = """
import sys, torch
dev = torch.device("cuda", int(sys.argv[1]))
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
c = torch.empty_like(a)
for _ in range(20):
    torch.matmul(a, b, out=c)
torch.cuda.synchronize(dev)
print("busy", flush=True)
while True:
    for _ in range(50):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize(dev)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("validators-run"))
    ap.add_argument("--gpus", default="0", help="NVML indices for the agent (e.g. 0,1), or 'all'")
    ap.add_argument("--cpu", action="store_true", help="fake GPUs (no NVML): checks the flow anywhere")
    ap.add_argument("--burn-s", type=float, default=10.0, help="GEMM burn length per GPU (HAI_VALIDATOR_GEMM_BURN_S)")
    ap.add_argument("--timeout", type=float, default=1500.0, help="give up on a run after this long")
    ap.add_argument("--work", type=Path, default=None, help="server/agent state (default: a new temp folder)")
    ap.add_argument("--load-gpu", type=int, default=None, metavar="N",
                    help="then another full run with GPU N kept busy by a second process (a slow GPU)")
    args = ap.parse_args()

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # state outside OUT: OUT holds only the JSON and the log
    work = (args.work or Path(tempfile.mkdtemp(prefix="hai-validators-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = (out / "platform.log").open("w")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HAI_FRONTEND_DIST": str(work / "none"),
           "HAI_VALIDATION__QUICK_EVERY_HEARTBEATS": "0",  # only the runs this script asks for
           "HAI_VALIDATION__UNDRAIN_TIMEOUT_S": str(args.timeout),
           "HAI_VALIDATOR_GEMM_BURN_S": str(args.burn_s)}
    # NVLink multicast off, in every child too (unless the caller set these)
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        env.setdefault(k, v)
    hai = [sys.executable, "-m", "hai.cli.main"]
    procs: list[subprocess.Popen] = []
    result: dict = {"where": socket.gethostname(), "started_at": time.time(), "mode": "fake GPUs" if args.cpu else "NVML"}
    try:
        procs.append(subprocess.Popen(hai + ["dev", "--agents", "0", "--port", str(port), "--data-dir",
                                             str(work / "server")], env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))

        def healthy() -> bool:
            try:
                return (work / "server" / "agent-token").exists() and httpx.get(f"{url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 120, "the server")
        admin = (work / "server" / "admin-token").read_text().strip()
        agent_token = (work / "server" / "agent-token").read_text().strip()
        node = "gpu-node-0"
        if args.cpu:
            gpu_args = ["--fake-gpus", "1"]
        elif args.gpus == "all":
            gpu_args = []
        else:
            gpu_args = ["--gpus", args.gpus]
        procs.append(subprocess.Popen(
            hai + ["agent", "--server", url, "--token", agent_token, "--node", node, "--zone", "A", "--leaf", "A1",
                   "--state-dir", str(work / "agent"), "--checkpoint-root", str(work / "checkpoints"),
                   "--address", "127.0.0.1", "--stop-jobs-on-exit", "--ranks-as-agent-user", *gpu_args],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=httpx.Timeout(30, read=None))
        wait_for(lambda: any(n["name"] == node and n["state"] == "ready" for n in http.get("/api/v1/nodes").json()),
                 120, "the agent")
        result["inventory"] = [{k: g.get(k) for k in ("index", "model", "memory_total_mib", "uuid")}
                               for g in http.get(f"/api/v1/nodes/{node}").json()["gpu_metrics"]]

        def run(level: str) -> dict:
            t0 = time.monotonic()
            r = http.post(f"/api/v1/nodes/{node}/validate", json={"level": level})
            r.raise_for_status()
            run_id = r.json()["id"]
            done = wait_for(lambda: (x := http.get(f"/api/v1/validations/{run_id}").json())["status"] != "pending" and x,
                            args.timeout, f"validation run {run_id}", interval=1.0)
            done["wall_s"] = round(time.monotonic() - t0, 2)
            return done

        result["full"] = run("full")
        result["quick"] = run("quick")
        state = http.get(f"/api/v1/nodes/{node}").json()["state"]
        if state == "ready":  # drain, then an undrain gated by a second full run
            http.post(f"/api/v1/nodes/{node}/drain", json={"reason": "validator benchmark"}).raise_for_status()
            t0 = time.monotonic()
            r = http.post(f"/api/v1/nodes/{node}/undrain", json={"force": False})
            result["undrain"] = {"status_code": r.status_code, "wall_s": round(time.monotonic() - t0, 2),
                                 "body": r.json()}
        detail = http.get(f"/api/v1/nodes/{node}").json()
        result["node_state"] = detail["state"]
        result["events"] = detail["events"]

        def summary(run_: dict) -> dict:
            return {c["name"]: {k: c[k] for k in ("status", "value", "threshold", "unit", "detail", "duration_s")}
                    for c in run_["checks"]}

        result["summary"] = summary(result["full"])
        if args.load_gpu is not None:  # a slow GPU, injected: a second process keeps it busy
            hog = subprocess.Popen(
                [sys.executable, "-c", _HOG, str(args.load_gpu)], env=env, stdout=subprocess.PIPE, text=True,
                start_new_session=True)
            procs.append(hog)
            assert hog.stdout is not None
            line = hog.stdout.readline().strip()  # "busy" once its first products ran
            if line != "busy":
                raise RuntimeError(f"the GPU load did not start: {line!r}")
            loaded = run("full")
            hog.send_signal(signal.SIGTERM)
            result["loaded"] = {"gpu": args.load_gpu, "run": loaded, "summary": summary(loaded)}
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        log.close()
    result["finished_at"] = time.time()
    text = json.dumps(result, indent=2)
    (out / "validators_gpu.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
