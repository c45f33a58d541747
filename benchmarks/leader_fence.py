"""What fencing and the GPU holds cost a scheduling transaction (issue 12).

On a fresh PostgreSQL database (created and dropped; server from HAI_BENCH_DATABASE_URL or
HAI_TEST_DATABASE_URL): takes the scheduler lease, then times
  - an empty transaction (SELECT 1; COMMIT) and a fenced one (fence(): lock and renew the lease
    row; COMMIT): the fence's own price per cycle;
  - starting jobs through services.scheduling.apply_decisions, 125 jobs of 8 GPUs a cycle (the
    Fire-Flyer benchmark's starts per cycle), with their gpu_holds rows (1,000 per cycle), and
    the same with the holds' rows not written (what the holds add).

    python benchmarks/leader_fence.py --repeat 200 --out benchmarks/results/leader_fence.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, delete, text
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backend"))

from hai.db.base import utcnow  # noqa: E402
from hai.db.migrate import upgrade  # noqa: E402
from hai.db.models import GpuHold, Job, JobAllocation, JobEvent, Node  # noqa: E402
from hai.domain import scheduler as sched  # noqa: E402
from hai.services.context import Platform  # noqa: E402
from hai.services.leader import fence, leadership  # noqa: E402
from hai.services import auth, scheduling  # noqa: E402
from hai.services.scheduling import apply_decisions  # noqa: E402
from hai.settings import Settings  # noqa: E402


def ms(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median_ms": round(statistics.median(s) * 1000, 3), "p99_ms": round(s[int(len(s) * 0.99) - 1] * 1000, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--cycles", type=int, default=10, help="start cycles of 125 8-GPU jobs, with and without holds")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    server = os.environ.get("HAI_BENCH_DATABASE_URL") or os.environ.get("HAI_TEST_DATABASE_URL") \
        or "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    name = f"hai_bench_fence_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(server).set(database=name).render_as_string(hide_password=False)
    result: dict = {"load_average_before": os.getloadavg()}
    try:
        upgrade(url)
        tmp = Path(f"/tmp/{name}")
        platform = Platform.from_settings(Settings(data_dir=tmp, db={"url": url}, scheduler={"lease_s": 3600}))
        stop = threading.Event()
        with leadership(platform, stop=stop) as lease:
            plain, fenced = [], []
            for i in range(args.repeat * 2):
                with platform.sessions() as s:
                    t0 = time.perf_counter()
                    if i % 2:
                        fence(s, lease)
                    else:
                        s.execute(text("SELECT 1"))
                    s.commit()
                    (fenced if i % 2 else plain).append(time.perf_counter() - t0)
            result["empty_transaction"] = ms(plain)
            result["fenced_transaction"] = ms(fenced)

            nodes = 125
            with platform.sessions() as s:
                s.add_all(Node(name=f"n{i:04d}", gpus=8, last_heartbeat_at=utcnow()) for i in range(nodes))
                s.commit()
                user, _ = auth.create_user(session=s, name="u", group="g")
            timings: dict[str, list[float]] = {"with_holds": [], "without_holds": []}
            with_holds = scheduling.hold_gpus
            for cycle in range(args.cycles * 2):
                kind = "with_holds" if cycle % 2 == 0 else "without_holds"
                with platform.sessions() as s:
                    jobs = [Job(name="b", user_id=user.id, user_name="u", group="g", command=["true"], nodes=1, gpus_per_node=8,
                                queued_at=utcnow()) for _ in range(nodes)]
                    s.add_all(jobs)
                    s.commit()
                    decisions = sched.Decisions(starts=[
                        sched.Start(job_id=j.id, allocations=(sched.Allocation(f"n{k:04d}", tuple(range(8))),), reason="bench")
                        for k, j in enumerate(jobs)])
                with platform.sessions() as s:
                    t0 = time.perf_counter()
                    fence(s, lease)
                    # without: the same allocations, their holds' rows not written
                    scheduling.hold_gpus = (lambda session, allocations: None) if kind == "without_holds" else with_holds
                    apply_decisions(s, decisions, settings=platform.settings, now=utcnow())
                    s.commit()
                    timings[kind].append(time.perf_counter() - t0)
                with platform.sessions() as s:  # free the GPUs for the next cycle
                    s.execute(delete(GpuHold))
                    s.execute(delete(JobEvent))
                    s.execute(delete(JobAllocation))
                    s.execute(delete(Job))
                    s.commit()
            scheduling.hold_gpus = with_holds
            result["start_125_jobs_of_8_gpus"] = {k: ms(v) for k, v in timings.items()}
        platform.close()
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
