"""CPU per submission (issue 12): where a POST /api/v1/jobs spends the API server's time.

One `hai server --workers 1` on PostgreSQL + Redis (no scheduler, no agents: nodes are rows), N
sequential submissions over one keep-alive connection; prints the server's CPU milliseconds per
request (user+system, from /proc: little affected by other load on the machine, unlike wall time)
and the wall rate (also per block of jobs: `blocks_ms_min` and `blocks_ms_median`, which a busy
shared machine sways less). `--profile FILE` records the worker with py-spy (speedscope).

    python benchmarks/submit_cpu.py [--jobs 1000] [--profile /tmp/submit.speedscope.json]
    python benchmarks/submit_cpu.py --jobs 200 --callgrind /tmp/submit.callgrind   # instructions per submission
    python benchmarks/submit_cpu.py --jobs 3000 --in-flight 8   # 8 requests at once: written in groups

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
from api_load import (BODY, HAI, Procs, cpu_s, free_port, loadavg, pg_urls, post_load, reset_postgres,  # noqa: E402
                      seed_nodes, seed_users, wait_for)

from hai.settings import Settings  # noqa: E402

def wakeups(redis_url: str):  # noqa: ANN201
    """Count the messages on the platform's notification channel from now on: returns a function
    that stops counting and returns the count (None without Redis)."""
    if not redis_url:
        return None
    import threading

    import redis

    from hai.services.notify import RedisNotifier

    client = redis.Redis.from_url(redis_url)
    db = client.connection_pool.connection_kwargs.get("db", 0)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(f"{RedisNotifier.CHANNEL}:{db}")
    pubsub.get_message(timeout=1.0)  # the subscription's confirmation
    count, stop = [0], threading.Event()

    def listen() -> None:
        while not stop.is_set():
            if pubsub.get_message(timeout=0.2):
                count[0] += 1

    t = threading.Thread(target=listen, daemon=True)
    t.start()

    def done() -> int:
        time.sleep(0.5)  # the last coalesced wake-up (20 ms) has gone out
        stop.set()
        t.join()
        pubsub.close()
        client.close()
        return count[0]

    return done


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--idempotency", action="store_true", help="send an Idempotency-Key with each submission")
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--profile-rate", type=int, default=200, help="py-spy's samples a second")
    ap.add_argument("--callgrind", type=Path, help="run the server under valgrind's callgrind and print the "
                    "instructions it executed per submission (after the warm-up): a figure other load does not sway")
    ap.add_argument("--blocks", type=int, default=5, help="also the CPU per job of this many blocks of jobs")
    ap.add_argument("--in-flight", type=int, default=1, help=(
        "requests at once (threads, each its own keep-alive connection; without --idempotency): those that "
        "arrive while a group is written are written together"))
    args = ap.parse_args()
    url, redis_url = pg_urls()  # (a clear exit without them)
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
            wrap = []
            if args.callgrind:  # counting starts after the warm-up (callgrind_control -i on)
                wrap = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                        f"--callgrind-out-file={args.callgrind.resolve()}"]
            server = procs.start(wrap + HAI + ["server", "--port", str(port), "--workers", "1"], env=env,
                                 log=work / "server.log")
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
                                            "--rate", str(args.profile_rate), "--gil", "--format", "speedscope", "-o", str(args.profile), "--nonblocking"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(1)
                if args.callgrind:
                    subprocess.run(["callgrind_control", "-i", "on", str(server.pid)], check=True, capture_output=True)
                heard = wakeups(redis_url)  # the notifications the server sends through Redis meanwhile
                load0, c0, t0 = loadavg(), cpu_s([server.pid]), time.perf_counter()
                blocks, per_block = [], max(1, args.jobs // args.blocks)
                if args.in_flight > 1:  # one block, the load's threads in this process
                    per_block = args.jobs
                    cb = cpu_s([server.pid])
                    load = post_load(lambda: httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"},
                                                          timeout=60), "/api/v1/jobs", BODY, args.jobs, args.in_flight,
                                     ok=(201,))
                    assert load["failed"] == 0, load["first_error"]
                    blocks.append(1000 * (cpu_s([server.pid]) - cb) / args.jobs)
                for b in range(0, args.jobs if args.in_flight == 1 else 0, per_block):
                    cb = cpu_s([server.pid])
                    for i in range(b, min(args.jobs, b + per_block)):
                        post(i)
                    blocks.append(1000 * (cpu_s([server.pid]) - cb) / (min(args.jobs, b + per_block) - b))
                wall, cpu = time.perf_counter() - t0, cpu_s([server.pid]) - c0
                messages = heard() if heard else None
                if args.callgrind:
                    subprocess.run(["callgrind_control", "-i", "off", str(server.pid)], check=True, capture_output=True)
                if spy:
                    spy.send_signal(2)
                    spy.wait(60)
            blocks.sort()
            out = {"jobs": args.jobs, "in_flight": args.in_flight, "server_cpu_ms_per_job": round(1000 * cpu / args.jobs, 3),
                   # the same per block of jobs: the least and the median are less swayed by other load
                   "blocks_ms_min": round(blocks[0], 3), "blocks_ms_median": round(blocks[len(blocks) // 2], 3),
                   "jobs_per_s": round(args.jobs / wall, 1), "load": [load0, loadavg()],
                   "redis_messages_per_job": None if messages is None else round(messages / args.jobs, 3)}
        finally:
            procs.stop()
        if args.callgrind:  # the profile is written when the server exits
            events = [line for line in args.callgrind.read_text().splitlines() if line.startswith("totals:")]
            out["instructions_per_job"] = round(int(events[0].split()[1]) / args.jobs)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
