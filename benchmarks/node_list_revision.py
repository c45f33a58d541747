"""What the node list's revision costs the writers (issue 12, migration 0016), on PostgreSQL.

The triggers that raise ``node_list_revision.rev`` run in every transaction that writes nodes or
allocations. This measures, alternating trigger on and off (``ALTER TABLE ... ENABLE/DISABLE
TRIGGER``) on a fresh database:
  - a scheduling cycle's starts: one transaction inserting 125 allocations of 8 GPUs, then
    releasing them in a second (``active = false``), each with its commit;
  - a drain: one node's state and reason changed, committed;
  - a heartbeat batch: every node's ``last_heartbeat_at`` / ``gpu_util_pct`` written (what the
    triggers' WHEN clause must let pass without raising anything), committed;
  - a read of the revision (what every kept node-list request adds).

    HAI_BENCH_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test \
      python benchmarks/node_list_revision.py [--repeat 200] [--nodes 1250] [--out FILE]

A database is created beside the URL's and dropped afterwards.
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

from metrics_ingest import _fresh_db  # noqa: E402  (a database of its own, dropped after)
from sqlalchemy import create_engine, text  # noqa: E402

from hai.db.migrate import upgrade  # noqa: E402

TRIGGERS = ("nodes_list_rows", "nodes_list_update", "job_allocations_list_rows", "job_allocations_list_update")


def stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": round(statistics.median(xs) * 1000, 3),
            "p99_ms": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1000, 3),
            "mean_ms": round(statistics.fmean(xs) * 1000, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--nodes", type=int, default=1250)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    base = os.environ.get("HAI_BENCH_DATABASE_URL") or os.environ.get("HAI_TEST_DATABASE_URL") \
        or "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    url, drop = _fresh_db(base)
    out: dict = {"nodes": args.nodes, "repeat": args.repeat, "load_before": os.getloadavg()}
    try:
        upgrade(url)
        eng = create_engine(url)
        with eng.begin() as c:
            c.execute(text("INSERT INTO users (name, \"group\", is_admin, created_at) VALUES ('u', 'g', false, now())"))
            c.execute(text(
                "INSERT INTO nodes (name, zone, leaf, gpus, state, address, fake_gpus, gpu_inventory, gpu_metrics, nics,"
                " agent_version, protocol_version, registered_at, state_reason, labels_from_topology,"
                " heartbeats_since_quick) SELECT 'n' || i, 'A', 'L' || (i / 20), 8, 'ready', '127.0.0.1', true, '[]',"
                " '[]', '[]', '', 1, now(), '', false, 0 FROM generate_series(1, :n) i"), {"n": args.nodes})
            c.execute(text(
                "INSERT INTO jobs (name, user_id, user_name, \"group\", command, env, tags, job_type, nodes, gpus_per_node,"
                " priority, submitted_priority, allow_cross_zone, suspend_grace_s, state, created_at, queued_at, attempt,"
                " suspensions, restarts, reserved_nodes, desired_action, user_suspended, lost_gpu_s, run_s)"
                " SELECT 'j' || i, 1, 'u', 'g', '[]', '{}', '[]', 'command', 1, 8, 'NORMAL', 'NORMAL', false, 60,"
                " 'running', now(), now(), 1, 0, 0, '[]', 'run', false, 0, 0 FROM generate_series(1, 125) i"))
        job_ids = [r[0] for r in eng.connect().execute(text("SELECT id FROM jobs ORDER BY id"))]
        cases: dict[str, dict[str, list[float]]] = {}

        def timed(case: str, side: str, fn) -> None:  # noqa: ANN001
            t = time.perf_counter()
            fn()
            cases.setdefault(case, {"on": [], "off": []})[side].append(time.perf_counter() - t)

        def starts() -> None:
            with eng.begin() as c:
                c.execute(text("INSERT INTO job_allocations (job_id, attempt, node_name, node_rank, gpus, active, created_at)"
                               " VALUES (:j, 1, :n, 0, '[0,1,2,3,4,5,6,7]', true, now())"),
                          [{"j": j, "n": f"n{i + 1}"} for i, j in enumerate(job_ids)])

        def releases() -> None:
            with eng.begin() as c:
                c.execute(text("UPDATE job_allocations SET active = false WHERE active"))
            with eng.begin() as c:
                c.execute(text("DELETE FROM job_allocations"))

        flip = [0]

        def drain() -> None:
            flip[0] += 1
            with eng.begin() as c:
                c.execute(text("UPDATE nodes SET state = :s, state_reason = :r WHERE name = 'n7'"),
                          {"s": "draining" if flip[0] % 2 else "ready", "r": f"bench {flip[0]}"})

        def figures() -> None:
            with eng.begin() as c:
                c.execute(text("UPDATE nodes SET last_heartbeat_at = now(), gpu_util_pct = random() * 100, gpus_busy = 3"))

        def revision() -> None:
            with eng.connect() as c:
                c.execute(text("SELECT rev FROM node_list_revision WHERE id = 1")).scalar_one()

        for i in range(args.repeat):
            for side in (("on", "off") if i % 2 == 0 else ("off", "on")):
                with eng.begin() as c:
                    for t in TRIGGERS:
                        table = t.rsplit("_list_", 1)[0]
                        c.execute(text(f"ALTER TABLE {table} {'ENABLE' if side == 'on' else 'DISABLE'} TRIGGER {t}"))
                timed("cycle_125_starts", side, starts)
                timed("release_125_and_delete", side, releases)
                timed("drain_one_node", side, drain)
                if i % 5 == 0:
                    timed(f"heartbeat_figures_{args.nodes}_nodes", side, figures)
                timed("read_revision", side, revision)
        with eng.connect() as c:
            out["revision_after"] = c.execute(text("SELECT rev FROM node_list_revision")).scalar_one()
        eng.dispose()
        for case, sides in cases.items():
            out[case] = {side: stats(xs) for side, xs in sides.items()}
            on, off = out[case]["on"], out[case]["off"]
            print(f"  {case:32s} triggers on p50 {on['p50_ms']:7.3f} p99 {on['p99_ms']:7.3f} ms | off p50 "
                  f"{off['p50_ms']:7.3f} p99 {off['p99_ms']:7.3f} ms", flush=True)
    finally:
        drop()
    out["load_after"] = os.getloadavg()
    # each 'on' round raised the revision once per writing transaction (starts, release, delete, drain)
    print(f"  revision after the run: {out['revision_after']} (expected {1 + 4 * args.repeat}: the seed, then one per writing "
          "transaction with the triggers on, none for the heartbeat figures)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
