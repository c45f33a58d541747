"""CPU per submission (issue 12): where a POST /api/v1/jobs spends the API server's time.

One `hai server --workers 1` on PostgreSQL + Redis (no scheduler, no agents: nodes are rows), N
sequential submissions over one keep-alive connection; prints the server's CPU milliseconds per
request (user+system, from /proc: little affected by other load on the machine, unlike wall time)
and the wall rate. `--profile FILE` records the worker with py-spy (speedscope).

    python benchmarks/submit_cpu.py [--jobs 1000] [--profile /tmp/submit.speedscope.json]

PostgreSQL: HAI_TEST_DATABASE_URL (its schema is dropped: a database of your own); Redis: HAI_TEST_REDIS_URL.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from api_load import BODY, HAI, Procs, free_port, loadavg, reset_postgres, seed_nodes, seed_users, wait_for  # noqa: E402

from hai.settings import Settings  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--idempotency", action="store_true", help="send an Idempotency-Key with each submission")
    ap.add_argument("--profile", type=Path)
    args = ap.parse_args()
    url, redis_url = os.environ["HAI_TEST_DATABASE_URL"], os.environ.get("HAI_TEST_REDIS_URL", "")
    procs = Procs()
    with tempfile.TemporaryDirectory(prefix="hai-submit-cpu-") as tmp:
        work = Path(tmp)
        reset_postgres(url)
        settings = Settings(data_dir=work, db={"url": url}, redis={"url": redis_url})
        token, _agent, _users = seed_users(settings)
        seed_nodes(settings, 4)
        port = free_port()
        env = dict(os.environ, HAI_DB__URL=url, HAI_REDIS__URL=redis_url, HAI_DATA_DIR=str(work))
        try:
            server = procs.start(HAI + ["server", "--port", str(port), "--workers", "1"], env=env, log=work / "server.log")
            base = f"http://127.0.0.1:{port}"
            wait_for(lambda: httpx.get(base + "/healthz", timeout=2).status_code == 200, 300, "hai server")
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=60) as c:
                def post(i: int) -> None:
                    h = {"Idempotency-Key": f"k-{i}-{time.monotonic_ns()}"} if args.idempotency else {}
                    r = c.post("/api/v1/jobs", json=BODY, headers=h)
                    assert r.status_code == 201, r.text
                for i in range(50):
                    post(i)
                spy = None
                if args.profile:
                    spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(server.pid),
                                            "--rate", "200", "--gil", "--format", "speedscope", "-o", str(args.profile), "--nonblocking"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(1)
                load0, c0, t0 = loadavg(), cpu_s(server.pid), time.perf_counter()
                for i in range(args.jobs):
                    post(i)
                wall, cpu = time.perf_counter() - t0, cpu_s(server.pid) - c0
                if spy:
                    spy.send_signal(2)
                    spy.wait(60)
            out = {"jobs": args.jobs, "server_cpu_ms_per_job": round(1000 * cpu / args.jobs, 3),
                   "jobs_per_s": round(args.jobs / wall, 1), "load": [load0, loadavg()]}
            print(json.dumps(out))
        finally:
            procs.stop()


if __name__ == "__main__":
    main()
