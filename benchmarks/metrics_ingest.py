"""GPU metric ingestion at Fire-Flyer scale on PostgreSQL (issue 11).

Feeds ``metrics_store.record_heartbeat`` the heartbeats of N nodes x G GPUs at 1 Hz for S seconds
of cluster time (virtual clock; each node's heartbeat is one call, as the heartbeat service makes
it), with the flushes the settings ask for (every ``flush_interval_s``), half the GPUs held by
jobs (one 4-GPU job per half node) so job rollups are written too. Measures:

- CPU: process CPU seconds spent in ingestion (buffering + flushes, client side) per second of
  cluster time, as % of one core; and the flushes' wall time (includes the database's own work)
  per second of cluster time, an upper bound on what the database spends.
- Size: bytes per row (one per node and fine bucket for gpu_samples) of each table on PostgreSQL (pg_total_relation_size, indexes included)
  and from that the bytes written per day and the growth per day that retention keeps.
- Reads: a week of cluster utilisation (coarse rollups of a full week at 1,250 nodes,
  generated in SQL) and the cluster summary, median of repeated calls, through the services the
  routes call.

    python benchmarks/metrics_ingest.py --db postgresql+psycopg://postgres@127.0.0.1:5432/bench
    (default: HAI_BENCH_DATABASE_URL, else HAI_TEST_DATABASE_URL; a fresh database is created
    next to it and dropped afterwards)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))

from sqlalchemy import create_engine, func, select, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402
from sqlalchemy.orm import sessionmaker  # noqa: E402

from hai.db.models import Base, GpuSample, Job, JobAllocation, MetricRollup, Node, User  # noqa: E402
from hai.protocol import GpuMetrics  # noqa: E402
from hai.services import metrics_store  # noqa: E402
from hai.settings import Settings  # noqa: E402


def _fresh_db(server_url: str) -> tuple[str, callable]:
    name = f"hai_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)

    def drop() -> None:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return url, drop


def _seed(sessions, nodes: int, gpus: int) -> list[str]:
    names = [f"n{i:04d}" for i in range(nodes)]
    with sessions() as s:
        s.add(User(id=1, name="bench", group="bench"))
        settings = Settings()
        for i, n in enumerate(names):
            node = Node(name=n, zone="A" if i < nodes // 2 else "B", leaf=f"L{i // 20:02d}", gpus=gpus)
            metrics_store.set_latest_gpus(node, [  # as the heartbeat leaves them
                GpuMetrics(index=g, uuid=f"GPU-{n}-{g}", util_pct=50.0, memory_used_mib=1000, memory_total_mib=40960,
                           temperature_c=50.0, power_w=200.0, ecc_uncorrected=0) for g in range(gpus)], settings)
            s.add(node)
        s.flush()
        jid = 0
        for n in names:  # half of each node's GPUs held, by 4-GPU jobs
            for first in range(0, gpus // 2, 4):
                jid += 1
                s.add(Job(id=jid, name=f"j{jid}", user_id=1, user_name="bench", group="bench", command=["x"],
                          state="running", gpus_per_node=4))
                s.flush()
                s.add(JobAllocation(job_id=jid, attempt=1, node_name=n, node_rank=0,
                                    gpus=list(range(first, min(first + 4, gpus // 2)))))
        s.commit()
    return names


PAGE = ("cluster_week_series_ms", "cluster_summary_ms", "idle_allocations_ms", "cluster_nodes_ms")  # the cluster page's reads


def _sizes(engine) -> dict[str, int]:
    with engine.connect() as c:
        out = {}
        for t in ("gpu_samples", "metric_rollups", "gpu_status"):
            out[t] = int(c.execute(text(f"SELECT pg_total_relation_size('{t}')")).scalar())
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default=os.environ.get("HAI_BENCH_DATABASE_URL") or os.environ.get("HAI_TEST_DATABASE_URL")
                    or "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--nodes", type=int, default=1250)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=180, help="cluster time to simulate at 1 Hz")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()

    settings = Settings()
    cfg = settings.metrics
    url, drop = _fresh_db(args.db)
    engine = create_engine(url, pool_pre_ping=True)
    try:
        Base.metadata.create_all(engine)
        sessions = sessionmaker(engine, expire_on_commit=False)
        names = _seed(sessions, args.nodes, args.gpus)
        gpu_msgs = {}
        import random

        rng = random.Random(7)
        start = datetime(2026, 1, 5, tzinfo=timezone.utc)
        buffer_cpu = flush_cpu = flush_wall = 0.0
        flushes = 0
        with sessions() as s:
            metrics_store.flush(session=s, settings=settings)  # the buffer for this engine exists
            for sec in range(args.seconds):
                now = start + timedelta(seconds=sec)
                for n in names:
                    msgs = gpu_msgs.get(n)
                    if msgs is None or sec % 15 == 0:  # fresh figures now and then (building them is not ingestion)
                        msgs = gpu_msgs[n] = [
                            GpuMetrics(index=i, uuid=f"{n}-{i}", util_pct=rng.uniform(0, 100) if i < args.gpus // 2 else 0.0,
                                       memory_used_mib=rng.randint(0, 40960), memory_total_mib=40960,
                                       temperature_c=rng.uniform(30, 80), power_w=rng.uniform(30, 300))
                            for i in range(args.gpus)
                        ]
                    c0 = time.process_time()
                    metrics_store._buffer(s).add(n, msgs, now.timestamp(), cfg)
                    buffer_cpu += time.process_time() - c0
                if (sec + 1) % max(1, int(cfg.flush_interval_s)) == 0:
                    c0, w0 = time.process_time(), time.perf_counter()
                    metrics_store.flush(session=s, settings=settings, include_open=False)  # closed buckets, as live
                    flush_cpu += time.process_time() - c0
                    flush_wall += time.perf_counter() - w0
                    flushes += 1
            c0, w0 = time.process_time(), time.perf_counter()
            metrics_store.flush(session=s, settings=settings)
            flush_cpu += time.process_time() - c0
            flush_wall += time.perf_counter() - w0

        with engine.connect() as c:
            c.execute(text("ANALYZE"))
        sizes = _sizes(engine)
        with sessions() as s:
            rows = {
                "gpu_samples": s.scalar(select(func.count()).select_from(GpuSample)),
                "metric_rollups": s.scalar(select(func.count()).select_from(MetricRollup)),
            }
            by_grain = dict(s.execute(select(MetricRollup.grain_s, func.count()).group_by(MetricRollup.grain_s)).all())
        per_row = {t: sizes[t] / rows[t] for t in rows}
        jobs = args.nodes * max(1, (args.gpus // 2 + 3) // 4)
        day = 86400
        written = {
            "gpu_samples": args.nodes * day / cfg.fine_s * per_row["gpu_samples"],
            "rollups_fine": (1 + jobs) * day / cfg.fine_s * per_row["metric_rollups"],
            "rollups_coarse": (1 + args.nodes + jobs) * day / cfg.coarse_s * per_row["metric_rollups"],
        }

        # a week of coarse rollups for the cluster and every node, a day of fine ones for the cluster
        now = datetime.now(timezone.utc)
        now_s = int(now.timestamp())
        with engine.begin() as c:
            c.execute(text("DELETE FROM metric_rollups"))
            c.execute(text(
                "INSERT INTO metric_rollups (scope, key, grain_s, bucket, n, busy_n, util_sum, util_max, mem_used_sum_mib,"
                " temp_max_c, power_sum_w) SELECT 'node', 'n' || lpad(k::text, 4, '0'), :g, b, 7200, 3600, 360000, 100,"
                " 1e7, 80, 1e6 FROM generate_series(0, :nodes - 1) k, generate_series(:since, :now, :g) b"),
                {"g": cfg.coarse_s, "nodes": args.nodes, "since": (now_s - 7 * day) // cfg.coarse_s * cfg.coarse_s, "now": now_s})
            for grain, span in ((cfg.coarse_s, 7 * day), (cfg.fine_s, day)):
                c.execute(text(
                    "INSERT INTO metric_rollups (scope, key, grain_s, bucket, n, busy_n, util_sum, util_max, mem_used_sum_mib,"
                    " temp_max_c, power_sum_w) SELECT 'cluster', '', :g, b, 9e6::int, 4e6::int, 4.5e8, 100, 1e10, 80, 1e9"
                    " FROM generate_series(:since, :now, :g) b"),
                    {"g": grain, "since": (now_s - span) // grain * grain, "now": now_s})
        with engine.connect() as c:
            c.execute(text("ANALYZE"))
        load_before_reads = os.getloadavg()[0]
        timings, best, cpu = {}, {}, {}
        with sessions() as s:
            for label, fn in {
                "cluster_week_series_ms": lambda: metrics_store.series(session=s, scope="cluster", key="", window="week",
                                                                       now=now, settings=settings),
                "cluster_day_series_ms": lambda: metrics_store.series(session=s, scope="cluster", key="", window="day",
                                                                      now=now, settings=settings),
                "node_week_series_ms": lambda: metrics_store.series(session=s, scope="node", key="n0042", window="week",
                                                                    now=now, settings=settings),
                "cluster_summary_ms": lambda: metrics_store.cluster_summary(session=s, settings=settings),
                "idle_allocations_ms": lambda: metrics_store.idle_allocations(session=s, now=now, settings=settings),
                "cluster_nodes_ms": lambda: metrics_store.cluster_nodes(session=s, settings=settings),
            }.items():
                fn()
                samples, cpus = [], []
                for _ in range(15):
                    t0, c0 = time.perf_counter(), time.process_time()
                    fn()
                    samples.append((time.perf_counter() - t0) * 1000)
                    cpus.append((time.process_time() - c0) * 1000)
                    s.rollback()
                timings[label] = round(statistics.median(samples), 2)
                best[label] = round(min(samples), 2)
                cpu[label] = round(statistics.median(cpus), 2)  # this process's CPU: what load cannot inflate much
        week_points = len(metrics_store.series(session=sessions(), scope="cluster", key="", window="week", now=now,
                                               settings=settings)[1])

        result = {
            "benchmark": "metrics_ingest",
            "nodes": args.nodes, "gpus_per_node": args.gpus, "cluster_seconds": args.seconds,
            "heartbeats": args.nodes * args.seconds, "flushes": flushes + 1,
            "settings": {"fine_s": cfg.fine_s, "coarse_s": cfg.coarse_s, "flush_interval_s": cfg.flush_interval_s,
                         "fine_retention_h": cfg.fine_retention_h, "coarse_retention_days": cfg.coarse_retention_days},
            "cpu": {
                "buffer_us_per_heartbeat": round(1e6 * buffer_cpu / (args.nodes * args.seconds), 2),
                "buffer_pct_of_one_core": round(100 * buffer_cpu / args.seconds, 2),
                "flush_client_cpu_pct_of_one_core": round(100 * flush_cpu / args.seconds, 2),
                "ingest_client_cpu_pct_of_one_core": round(100 * (buffer_cpu + flush_cpu) / args.seconds, 2),
                "flush_wall_s_mean": round(flush_wall / (flushes + 1), 3),
                "flush_wall_pct_of_cluster_time": round(100 * flush_wall / args.seconds, 2),
            },
            "rows": rows, "rollup_rows_by_grain": {str(k): v for k, v in by_grain.items()},
            "bytes_per_row": {k: round(v, 1) for k, v in per_row.items()},
            "db_bytes_written_per_day_gb": {k: round(v / 1e9, 3) for k, v in written.items()},
            "db_bytes_written_per_day_gb_total": round(sum(written.values()) / 1e9, 3),
            "db_steady_state_fine_gb": round((written["gpu_samples"] + written["rollups_fine"]) / 1e9 * cfg.fine_retention_h / 24, 3),
            "db_growth_per_day_after_retention_gb": round(written["rollups_coarse"] / 1e9, 3),
            "reads": timings, "reads_best": best, "reads_client_cpu": cpu, "cluster_week_points": week_points,
            "cluster_page_week_data_ms": round(sum(timings[k] for k in PAGE), 2),
            "cluster_page_week_data_best_ms": round(sum(best[k] for k in PAGE), 2),
            "cluster_page_week_data_client_cpu_ms": round(sum(cpu[k] for k in PAGE), 2),
            "load_average_before_reads": load_before_reads,
            "load_average": os.getloadavg()[0],
            "postgres": engine.dialect.server_version_info,
        }
    finally:
        engine.dispose()
        drop()
    text_out = json.dumps(result, indent=2, default=str)
    print(text_out)
    if args.out:
        args.out.write_text(text_out + "\n")


if __name__ == "__main__":
    main()
