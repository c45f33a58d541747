"""A cycle's write of queued jobs' pending reasons and reservations on PostgreSQL (issue 12):
one UPDATE a job (the executemany SQLite still uses, ``scheduling._WRITE_QUEUED``) against a
SELECT that locks them in id order and one UPDATE over arrays for all of them
(``scheduling.write_queued_pg``, what a PostgreSQL cycle runs), alternated in one process on
the same rows.

    HAI_TEST_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/scratch \
      python benchmarks/write_queued.py [--jobs 100 1000 10000] [--rounds 5] [--fillfactor 100]

The database at the URL is emptied (its ``public`` schema dropped) and migrated; one user's
``max(--jobs)`` queued jobs are inserted. Each write gives the first N jobs a new reason and a
reservation, committed; the table is vacuumed (untimed) before the next write, as autovacuum keeps up.
Per write: the wall time and this process's CPU (medians over the rounds), and the CPU of the
PostgreSQL backend that ran it (from /proc, 10 ms clock ticks: the mean over the rounds; the
database must run on this machine); at the end, how many of all the updates
were HOT (the new version in the row's own page, no index touched: ``pg_stat_user_tables``).
``--fillfactor 100`` rewrites the table as it was before migration 0021. Prints one JSON object
and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from api_load import REPO, cpu_s, loadavg, reset_postgres, write_results  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402

from hai.db.migrate import upgrade  # noqa: E402
from hai.services import scheduling  # noqa: E402

def seed(url: str, n: int, fillfactor: int | None = None) -> None:
    reset_postgres(url)
    upgrade(url)
    engine = create_engine(url)
    with engine.begin() as conn:
        user = conn.execute(text(
            "INSERT INTO users (name, \"group\", is_admin, created_at) VALUES ('bench', 'bench', false, now()) "
            "RETURNING id")).scalar_one()
        conn.execute(text(
            "INSERT INTO jobs (name, user_id, user_name, \"group\", command, env, tags, job_type, nodes, gpus_per_node, "
            "priority, submitted_priority, allow_cross_zone, suspend_grace_s, state, created_at, queued_at, attempt, "
            "suspensions, restarts, pending_reason, reserved_nodes, desired_action, user_suspended, lost_gpu_s, run_s) "
            "SELECT 'j' || g, :u, 'bench', 'bench', '[\"sleep\", \"60\"]', '{}', '[]', 'command', 1, 1, 'NORMAL', "
            "'NORMAL', false, 60, 'queued', now(), now(), 0, 0, 0, 'waiting', '[]', 'run', false, 0, 0 "
            "FROM generate_series(1, :n) g"), {"u": user, "n": n})
    with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        if fillfactor is not None:  # the table rewritten with another fill factor (100: before migration 0021)
            conn.execute(text(f"ALTER TABLE jobs SET (fillfactor = {int(fillfactor)})"))
            conn.execute(text("VACUUM FULL jobs"))
        conn.execute(text("VACUUM ANALYZE jobs"))  # settled, as autovacuum leaves a queue (not mid-run)
    engine.dispose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fillfactor", type=int, choices=range(10, 101), metavar="10-100",
                    help="rewrite the jobs table with this fill factor first (100: as before migration 0021)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "write_queued.json")
    args = ap.parse_args()
    url = os.environ["HAI_TEST_DATABASE_URL"]
    seed(url, max(args.jobs), args.fillfactor)
    engine = create_engine(url)
    results: dict = {"load_before": loadavg(), "fillfactor": args.fillfactor, "cases": []}
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")

    def vacuum() -> None:
        with autocommit.connect() as c:
            c.execute(text("VACUUM jobs"))

    with engine.connect() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        ids = list(conn.execute(text("SELECT id FROM jobs ORDER BY id")).scalars())
        conn.rollback()

        def write(way: str, n: int, round_: int) -> dict:
            writes = [(i, [f"n{i % 7}"], f"Resources: round {round_} job {i}") for i in ids[:n]]
            db0, cpu0, t0 = cpu_s([pid]), time.process_time(), time.perf_counter()
            if way == "one statement":
                scheduling.write_queued_pg(conn, writes)
            else:
                conn.execute(scheduling._WRITE_QUEUED, [{"i": i, "n": r, "r": p} for i, r, p in writes])
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            db = cpu_s([pid]) - db0
            conn.commit()
            vacuum()  # the dead versions gone before the next write, as autovacuum keeps up with a queue
            return {"wall_ms": wall * 1e3, "client_cpu_ms": cpu * 1e3, "db_cpu_ms": db * 1e3}

        ways = ("executemany", "one statement")
        for n in args.jobs:
            write(ways[0], n, -1), write(ways[1], n, -1)  # warm: plans, caches
            runs: dict[str, list[dict]] = {w: [] for w in ways}
            for r in range(args.rounds):
                for way in (ways if r % 2 == 0 else ways[::-1]):
                    runs[way].append(write(way, n, r))
            case = {"jobs": n}
            for way, got in runs.items():
                # medians; the backend's CPU (10 ms clock ticks) as the mean over the rounds
                case[way] = {k: round(statistics.median(g[k] for g in got), 2) for k in got[0]}
                case[way]["db_cpu_ms"] = round(statistics.fmean(g["db_cpu_ms"] for g in got), 1)
            case["wall_ratio"] = round(case["executemany"]["wall_ms"] / case["one statement"]["wall_ms"], 1)
            results["cases"].append(case)
            conn.commit()
            print(json.dumps(case), flush=True)
        # PostgreSQL's count of the updates that stayed in their page, over every write above
        conn.execute(text("SELECT pg_stat_force_next_flush()"))
        conn.commit()
        results["updates"], results["hot_updates"] = conn.execute(text(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'jobs'")).one()
        print(json.dumps({"updates": results["updates"], "hot_updates": results["hot_updates"]}))
    engine.dispose()
    write_results(args.out, results)


if __name__ == "__main__":
    main()
