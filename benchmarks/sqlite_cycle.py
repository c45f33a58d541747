"""The scheduler's cycle with a deep queue, on SQLite (``hai dev``) or PostgreSQL: CPU per cycle,
with the queue kept across cycles (services/scheduling.QueueCache, what ``hai dev`` and ``hai
scheduler`` do) and without it (every cycle reads every queued job, as before issue 12's change
marker on SQLite and the xmin horizon on PostgreSQL).

    python benchmarks/sqlite_cycle.py [--queued 10000] [--repeat 20]
    HAI_TEST_DATABASE_URL=postgresql+psycopg://... python benchmarks/sqlite_cycle.py --postgresql
    python benchmarks/sqlite_cycle.py --queued 10000 --arrivals 100 [--postgresql]   # a cycle after 100 submissions

``--postgresql``: the database at HAI_TEST_DATABASE_URL (its public schema is dropped and made
again: a database of your own), the cycle as ``hai scheduler`` runs it there (one fenced
transaction that reads and writes); besides this process's CPU, the CPU of the database server
process that served the cycle (its /proc/<pid>/stat: the server must be on this machine) and
the wall-clock time of the cycle (medians; the server's CPU, counted in clock ticks, as a mean).

The database is api_load.py's: ``--queued`` 1-GPU jobs of 20 users queued, 4 nodes of 8 GPUs with
fresh heartbeats, in a temporary SQLite file. Three cycles settle it (the first starts 32 jobs and
writes every queued job's pending reason; the next reads those rows again), then ``--repeat``
steady cycles each way, alternating, timed with ``time.process_time`` (the SQLite library's work is
in-process; CPU, not wall-clock, because the VM is shared). Prints JSON with the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))

import api_load  # noqa: E402
from sqlalchemy import update  # noqa: E402

from hai.db.base import utcnow  # noqa: E402
from hai.db.models import Node  # noqa: E402
from hai.services import scheduling  # noqa: E402
from hai.services.context import Platform  # noqa: E402
from hai.services.leader import leadership  # noqa: E402
from hai.settings import Settings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queued", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--postgresql", action="store_true", help="the database at HAI_TEST_DATABASE_URL")
    ap.add_argument("--arrivals", type=int, default=0, metavar="K",
                    help="instead of steady cycles: --repeat cycles with the queue cache, K submissions "
                         "(the API's service, not timed) before each")
    args = ap.parse_args()
    out: dict = {"queued": args.queued, "load_before": api_load.loadavg()}
    with tempfile.TemporaryDirectory(prefix="hai-sqlite-cycle-") as tmp:
        if args.postgresql:
            url = os.environ.get("HAI_TEST_DATABASE_URL", "")
            if not url.startswith("postgresql"):
                raise SystemExit("set HAI_TEST_DATABASE_URL to a PostgreSQL database of your own")
            api_load.reset_postgres(url)
            settings = Settings(data_dir=Path(tmp), db={"url": url})
        else:
            settings = Settings(data_dir=Path(tmp))
        out["database"] = "postgresql" if args.postgresql else "sqlite"
        _token, _agent, users = api_load.seed_users(settings)
        api_load.seed_jobs(settings.database_url, users[1:], args.queued)
        api_load.seed_nodes(settings, 4)
        platform = Platform.from_settings(settings)
        queue = scheduling.QueueCache()
        try:
            with leadership(platform, stop=threading.Event()) as lease:

                tick_ms = 1000 / os.sysconf("SC_CLK_TCK")

                def server_cpu_ms(pid: int) -> float:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    return (int(fields[11]) + int(fields[12])) * tick_ms  # utime + stime

                def cycle(cache: scheduling.QueueCache | None) -> tuple[float, float, float, scheduling.CycleResult]:
                    with platform.sessions() as s:  # heartbeats stay fresh (not timed)
                        s.execute(update(Node).values(last_heartbeat_at=utcnow()))
                        s.commit()
                    if args.postgresql:  # as SchedulerLoop.cycle_once: one fenced transaction
                        with platform.sessions() as session:
                            pid = session.connection().connection.driver_connection.info.backend_pid
                            s0, c0, w0 = server_cpu_ms(pid), time.process_time(), time.perf_counter()
                            result = scheduling.run_cycle(session, settings=settings, lease=lease, queue=cache)
                            c1, w1, s1 = time.process_time(), time.perf_counter(), server_cpu_ms(pid)
                        return (c1 - c0) * 1000, s1 - s0, (w1 - w0) * 1000, result
                    c0, w0 = time.process_time(), time.perf_counter()
                    with platform.read_sessions() as reading, platform.sessions() as session:
                        if cache is None:
                            result = scheduling.run_cycle(session, settings=settings, lease=lease, read_session=reading)
                        else:
                            result = scheduling.run_cycle(session, settings=settings, lease=lease,
                                                          read_session=reading, queue=cache)
                    return (time.process_time() - c0) * 1000, 0.0, (time.perf_counter() - w0) * 1000, result

                out["settle_ms"] = [round(cycle(queue)[0], 1) for _ in range(3)]
                if args.arrivals:
                    out.update(_with_arrivals(args, platform, users[1], lambda: cycle(queue), queue))
                    return _print(out, platform)
                with_cache, without = [], []
                for _ in range(args.repeat):
                    *ms, r1 = cycle(queue)
                    with_cache.append(ms)
                    *ms, r2 = cycle(None)
                    without.append(ms)
                    assert r1.considered == r2.considered  # the same queue either way
                out["considered"] = len(r1.considered)
                out["queue_cache_full_reads"] = queue.full_reads
                for name, runs in (("with_queue_cache", with_cache), ("full_read", without)):
                    out[f"steady_cycle_cpu_ms_{name}"] = round(statistics.median(r[0] for r in runs), 1)
                    if args.postgresql:
                        out[f"steady_cycle_server_cpu_ms_{name}_mean"] = round(statistics.fmean(r[1] for r in runs), 1)
                    out[f"steady_cycle_wall_ms_{name}"] = round(statistics.median(r[2] for r in runs), 1)
        finally:
            platform.close()
    _print(out)


def _print(out: dict, platform: Platform | None = None) -> None:
    if platform is not None:
        platform.close()
    out["load_after"] = api_load.loadavg()
    out["cpus"] = os.cpu_count()
    print(json.dumps(out, indent=2))


def _with_arrivals(args, platform: Platform, user: tuple[int, str], cycle, queue: scheduling.QueueCache) -> dict:  # noqa: ANN001
    """``--arrivals K``: ``--repeat`` cycles, each after K submissions of 1-GPU jobs by one user
    through the API's service (``submissions.submit``, one transaction each, as the API writes
    them; not timed), as the scheduler meets a burst: the rows it reads are the new jobs and
    those whose reason the last cycle wrote (2K), the rest of the queue unchanged. The median CPU
    (and, on PostgreSQL, the database's CPU) of a cycle."""
    from hai.db.models import User
    from hai.schemas.jobs import JobCreate
    from hai.services import auth, submissions

    with platform.sessions() as s:
        row = s.get(User, user[0])
        who = auth.Principal(kind="user", user_id=row.id, name=row.name, group=row.group or "")
    limits = platform.settings.limits.model_copy(update={"max_queued_jobs_per_user": 0})
    spec = JobCreate(name="arrival", command=["sleep", "60"])
    runs, rows = [], []
    for _ in range(args.repeat):
        for _ in range(args.arrivals):
            with platform.sessions() as s:
                submissions.submit(session=s, spec=spec, user=who, limits=limits)
        *ms, result = cycle()
        runs.append(ms)
        rows.append(queue.rows_read)
    out = {"arrivals": args.arrivals, "cycles": args.repeat, "considered_last": len(result.considered),
           "rows_read_median": statistics.median(rows), "queue_cache_full_reads": queue.full_reads,
           "arrival_cycle_cpu_ms": round(statistics.median(r[0] for r in runs), 2),
           "arrival_cycle_wall_ms": round(statistics.median(r[2] for r in runs), 2)}
    if args.postgresql:
        out["arrival_cycle_server_cpu_ms_mean"] = round(statistics.fmean(r[1] for r in runs), 2)
    return out


if __name__ == "__main__":
    main()
