"""What the queued-jobs limit costs a submission as the submitter's own queue grows (issue 12).

    python benchmarks/queue_limit.py [--depths 0 1000 10000 50000] [--jobs 300] [--only postgresql sqlite] [--nodes 2]

For each depth: a fresh database (migrated), ``--nodes`` 8-GPU nodes as rows (2; 1,250 for
Fire-Flyer's count, which the admission check's figures cover), the submitting user given that
many queued jobs of their own, then ``--jobs`` submissions through the service the API calls
(``jobs.submit_admitted`` with the limit on, at 1,000,000 so none is refused), one after another
in this process. Reports the wall time per submission (median of blocks of 50) and, on
PostgreSQL, the CPU its processes spent per submission (every ``postgres`` process, from /proc:
the backend's statements, the WAL writer). Where the build folds the kept counts
(``hai.services.queued_counts``), it folds as the scheduler's loop does (after every 256 rows,
looked at after every 32 submissions, as after a cycle), inside the timed loop. PostgreSQL: HAI_TEST_DATABASE_URL (its schema is dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from api_load import loadavg, postgresql_cpu_s, reset_postgres, seed_jobs, seed_nodes, seed_users  # noqa: E402
from sqlalchemy import text  # noqa: E402

from hai.schemas.jobs import JobCreate  # noqa: E402
from hai.services import jobs as job_service  # noqa: E402
from hai.services.auth import Principal  # noqa: E402
from hai.services.context import Platform  # noqa: E402
from hai.settings import Settings  # noqa: E402

try:  # the build with the kept counts
    from hai.services import queued_counts
except ImportError:  # the build before them
    queued_counts = None

LIMIT = 1_000_000
SPEC = JobCreate.model_validate({"name": "bench", "command": ["sleep", "3600"], "gpus_per_node": 1})


def seed(url: str, depth: int, work: Path, nodes: int = 2) -> Principal:
    """``nodes`` 8-GPU nodes, the users, and ``depth`` queued jobs of the submitting user's own (with
    api_load's seeding)."""
    settings = Settings(data_dir=work, db={"url": url})
    _token, _agent, users = seed_users(settings)  # migrates the database
    seed_nodes(settings, nodes)
    seed_jobs(url, users[:1], depth)
    uid, name = users[0]
    return Principal(kind="user", name=name, user_id=uid, group="bench", is_admin=False)


def case(url: str, depth: int, n: int, work: Path, nodes: int = 2) -> dict:
    user = seed(url, depth, work, nodes)
    platform = Platform.from_settings(Settings(data_dir=work, db={"url": url}))
    folding = queued_counts.Folding() if queued_counts else None
    scheduler = Platform.from_settings(Settings(data_dir=work, db={"url": url}))  # its own pool, as its process
    try:
        if folding:  # the scheduler's first fold, before the timed submissions
            folding.maybe(scheduler.sessions, scheduler.read_sessions)
        if url.startswith("postgresql"):  # as autovacuum would have by then (the seeded rows, the fold's)
            with platform.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
                c.execute(text("VACUUM ANALYZE"))
        for _ in range(20):  # warm-up: statements compiled, the pool's connection made
            with platform.sessions() as s:
                job_service.submit_admitted(session=s, spec=SPEC, user=user, limit=LIMIT)
        blocks, block = [], 50
        pg = url.startswith("postgresql")
        c0, t0 = postgresql_cpu_s() if pg else 0.0, time.perf_counter()  # its backends, those that exit too
        for i in range(n):
            if i % block == 0:
                b0 = time.perf_counter()
            with platform.sessions() as s:
                job_service.submit_admitted(session=s, spec=SPEC, user=user, limit=LIMIT)
            if folding and i % 32 == 31:  # as after a scheduling cycle (one per ~32 submissions here)
                folding.maybe(scheduler.sessions, scheduler.read_sessions)
            if i % block == block - 1:
                blocks.append((time.perf_counter() - b0) * 1000 / block)
        wall = time.perf_counter() - t0
        out = {"own_queued": depth, "nodes": nodes, "jobs": n, "ms_per_submission": round(wall * 1000 / n, 3),
               "ms_per_submission_blocks_median": round(statistics.median(blocks), 3), "load": loadavg()}
        if pg:
            out["postgresql_cpu_ms_per_submission"] = round((postgresql_cpu_s() - c0) * 1000 / n, 3)
        with platform.read_sessions() as s:
            queued = s.execute(text("SELECT count(*) FROM jobs WHERE state = 'queued'")).scalar()
        assert queued == depth + 20 + n, queued
    finally:
        platform.close()
        scheduler.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 1000, 10_000, 50_000])
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--only", nargs="+", default=["postgresql", "sqlite"])
    ap.add_argument("--nodes", type=int, default=2, help="8-GPU nodes in the table")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results: dict = {"kept_counts": queued_counts is not None, "cases": []}
    for kind in args.only:
        for depth in args.depths:
            with tempfile.TemporaryDirectory(prefix="hai-queue-limit-") as tmp:
                if kind == "postgresql":
                    url = os.environ.get("HAI_TEST_DATABASE_URL", "")
                    if not url.startswith("postgresql"):
                        raise SystemExit("set HAI_TEST_DATABASE_URL to a PostgreSQL database of your own")
                    reset_postgres(url)
                else:
                    url = f"sqlite:///{Path(tmp) / 'hai.db'}"
                r = case(url, depth, args.jobs, Path(tmp), args.nodes)
            r["database"] = kind
            results["cases"].append(r)
            print(f"  {kind:10s} nodes {args.nodes:5d} own queued {depth:6d}: {r['ms_per_submission']:7.3f} ms a submission "
                  f"(blocks median {r['ms_per_submission_blocks_median']:.3f})"
                  + (f", PostgreSQL CPU {r['postgresql_cpu_ms_per_submission']:.3f} ms" if kind == "postgresql" else "")
                  + f"  load {r['load']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
