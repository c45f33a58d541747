"""The scheduler's cycle with a deep queue, on SQLite (``hai dev``) or PostgreSQL: CPU per cycle,
with the queue kept across cycles (services/scheduling.QueueCache, what ``hai dev`` and ``hai
scheduler`` do) and without it (every cycle reads every queued job, as before issue 12's change
marker on SQLite and the xmin horizon on PostgreSQL).

    python benchmarks/sqlite_cycle.py [--queued 10000] [--repeat 20]
    HAI_TEST_DATABASE_URL=postgresql+psycopg://... python benchmarks/sqlite_cycle.py --postgresql
    python benchmarks/sqlite_cycle.py --queued 10000 --arrivals 100 [--postgresql]   # a cycle after 100 submissions
    python benchmarks/sqlite_cycle.py --postgresql --nodes 10000 --running 20000 --queued 100000 --repeat 5

``--postgresql``: the database at HAI_TEST_DATABASE_URL (its public schema is dropped and made
again: a database of your own), the cycle as ``hai scheduler`` runs it there (one fenced
transaction that reads and writes); besides this process's CPU, the CPU of the database server
process that served the cycle (its /proc/<pid>/stat: the server must be on this machine) and
the wall-clock time of the cycle (medians; the server's CPU, counted in clock ticks, as a mean).

The database is api_load.py's: ``--queued`` 1-GPU jobs of 20 users queued, ``--nodes`` (4) nodes of
8 GPUs with fresh heartbeats, in a temporary SQLite file, and ``--running`` jobs running on them
(none by default), spread evenly over the nodes, each of 8 x nodes / running GPUs on one node,
with their allocations and held GPUs (``--nodes 10000 --running 20000 --queued 100000``: the
scheduler cycle benchmark's largest size, a full cluster, as the service meets it). They have run
``--ran-s`` (300 s, under the minimum runtime: no cycle may preempt, the steady full cluster);
past the quantum (``--ran-s 86400``) every cycle plans preemptions up to the per-cycle cap. Three
cycles settle it (the first starts 32 jobs when there are 4 nodes and writes every queued job's
pending reason; the next reads those rows again), then ``--repeat`` steady cycles each way,
alternating, timed with ``time.process_time`` (the SQLite library's work is in-process; CPU, not
wall-clock, because the VM is shared). Prints JSON with the medians, and the
median CPU of the three parts of a steady cycle with the queue cache: the snapshot's read
(``_load``), the domain's cycle (``schedule``) and the decisions' write (``apply_decisions``),
and how many job rows such a cycle read again (``queue_cache_rows_read_median``: the rows written
since the cycle before, mostly by it: pending reasons, reservations, starts).

``--finished N``: N finished jobs in the table as well (a cluster's history: nothing deletes a job
row), with their events and inactive allocations.

``--cache-only`` (with ``--ran-s 86400``): no cycle without the cache in between. Pending reasons
whose numbers alone change are written at each job's refresh moment
(``HAI_SCHEDULER__PENDING_REASON_REFRESH_S``, 30 s; 0: every change at once, as before):

    HAI_TEST_DATABASE_URL=... python benchmarks/sqlite_cycle.py --postgresql --nodes 10000 --running 20000 \
        --queued 100000 --ran-s 86400 --cache-only --repeat 8
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
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))

import api_load  # noqa: E402
from sqlalchemy import update  # noqa: E402

from hai.db.base import utcnow  # noqa: E402
from hai.db.models import Job, Node  # noqa: E402
from hai.services import scheduling  # noqa: E402
from hai.services.context import Platform  # noqa: E402
from hai.services.leader import leadership  # noqa: E402
from hai.settings import Settings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queued", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--postgresql", action="store_true", help="the database at HAI_TEST_DATABASE_URL")
    ap.add_argument("--nodes", type=int, default=4, help="nodes of 8 GPUs with fresh heartbeats (default 4)")
    ap.add_argument("--running", type=int, default=0,
                    help="jobs running on them, spread evenly, each of 8 x nodes / running GPUs (1, 2, 4 or 8)")
    ap.add_argument("--ran-s", type=float, default=300.0,
                    help="how long the running jobs have run (default 300 s: under the minimum runtime, so no "
                         "cycle may preempt: a steady full cluster; e.g. 86400: past the quantum, every cycle "
                         "plans preemptions up to the per-cycle cap)")
    ap.add_argument("--arrivals", type=int, default=0, metavar="K",
                    help="instead of steady cycles: --repeat cycles with the queue cache, K submissions "
                         "(the API's service, not timed) before each")
    ap.add_argument("--finished", type=int, default=0, metavar="N",
                    help="N finished jobs of the past in the table too (succeeded, each with its events and "
                         "an inactive allocation on one of the nodes): the history a cluster accumulates, "
                         "which no job row leaves")
    ap.add_argument("--cache-only", action="store_true",
                    help="only the cycles with the queue cache, none reading the whole queue between them (a "
                         "cycle without the cache keeps no record of the pending reasons it wrote, so it writes "
                         "every changed one: with --ran-s 86400 it would rewrite the queue the cached cycles "
                         "then read back)")
    args = ap.parse_args()
    out: dict = {"queued": args.queued, "nodes": args.nodes, "running": args.running, "load_before": api_load.loadavg()}
    run_gpus = 8 * args.nodes // args.running if args.running else 0
    if args.running and (run_gpus not in (1, 2, 4, 8) or run_gpus * args.running != 8 * args.nodes):
        ap.error("--running: 8 x nodes / running must be 1, 2, 4 or 8 GPUs a job")
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
        names = api_load.seed_nodes(settings, args.nodes)
        api_load.seed_jobs(settings.database_url, users[1:], args.running, states=["running"], nodes=names,
                           gpus=run_gpus, prefix="run")
        api_load.seed_jobs(settings.database_url, users[1:], args.finished, states=["succeeded"], nodes=names,
                           gpus=8, prefix="done")
        api_load.seed_jobs(settings.database_url, users[1:], args.queued)
        out["finished"] = args.finished
        parts = _timed_parts()
        platform = Platform.from_settings(settings)
        if args.running:
            with platform.sessions() as s:
                since = utcnow() - timedelta(seconds=args.ran_s)
                s.execute(update(Job).where(Job.name.like("run-%")).values(started_at=since, attempt_started_at=since))
                s.commit()
            out["ran_s"] = args.ran_s
        queue = scheduling.QueueCache()
        try:
            with leadership(platform, stop=threading.Event()) as lease:

                tick_ms = 1000 / os.sysconf("SC_CLK_TCK")

                def server_cpu_ms(pid: int) -> float:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    return (int(fields[11]) + int(fields[12])) * tick_ms  # utime + stime

                def cycle(cache: scheduling.QueueCache | None) -> tuple[float, float, float, scheduling.CycleResult]:
                    parts.clear()
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
                with_cache, without, split = [], [], []  # split: the parts of each cycle with the cache
                rows_read: list[int] = []  # job rows each cycle with the cache read again (changed since the last)
                for _ in range(args.repeat):
                    *ms, r1 = cycle(queue)
                    with_cache.append(ms)
                    split.append(dict(parts))
                    rows_read.append(queue.rows_read)
                    if args.cache_only:
                        continue
                    *ms, r2 = cycle(None)
                    without.append(ms)
                    assert r1.considered == r2.considered  # the same queue either way
                out["considered"] = len(r1.considered)
                out["running_jobs_in_snapshot"] = r1.snapshot_jobs - len(r1.considered)
                for name in ("load", "schedule", "apply"):
                    out[f"steady_cycle_cpu_ms_with_queue_cache_{name}"] = round(statistics.median(p.get(name, 0.0) for p in split), 1)
                out["queue_cache_full_reads"] = queue.full_reads
                # the rows the cycle before wrote (pending reasons, reservations, starts) come back here
                out["queue_cache_rows_read_median"] = statistics.median(rows_read)
                out["pending_reason_refresh_s"] = settings.scheduler.pending_reason_refresh_s
                for name, runs in (("with_queue_cache", with_cache), ("full_read", without)):
                    if not runs:
                        continue
                    out[f"steady_cycle_cpu_ms_{name}"] = round(statistics.median(r[0] for r in runs), 1)
                    if args.postgresql:
                        out[f"steady_cycle_server_cpu_ms_{name}_mean"] = round(statistics.fmean(r[1] for r in runs), 1)
                    out[f"steady_cycle_wall_ms_{name}"] = round(statistics.median(r[2] for r in runs), 1)
        finally:
            platform.close()
    _print(out)


def _timed_parts() -> dict[str, float]:
    """The CPU of the cycle's three parts, in ms, added up in the returned dict (cleared by the
    caller before each cycle): the snapshot's read (``scheduling._load``), the domain's cycle
    (``schedule``) and the decisions' write (``apply_decisions``)."""
    parts: dict[str, float] = {}

    def timed(name: str, fn):  # noqa: ANN001, ANN202
        def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            c0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                parts[name] = parts.get(name, 0.0) + (time.process_time() - c0) * 1000
        return run

    scheduling._load = timed("load", scheduling._load)
    scheduling.sched.schedule = timed("schedule", scheduling.sched.schedule)
    scheduling.apply_decisions = timed("apply", scheduling.apply_decisions)
    return parts


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
