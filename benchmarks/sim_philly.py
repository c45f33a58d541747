"""Replay the Philly trace through every policy on a contended cluster and compare them.

    python benchmarks/sim_philly.py                      # 64 nodes, 512 GPUs, two zones, full trace
    python benchmarks/sim_philly.py --time-scale 2       # arrivals twice as dense
    python benchmarks/sim_philly.py --limit 20000 --json
    python benchmarks/sim_philly.py --policies hai,las   # a subset

Policies: hai (ours), fifo (public HAI release), las (Tiresias 2D-LAS, ``hai/sim/las.py``),
easy-fs (Slurm-style fair share + EASY backfill with exact durations, ``hai/sim/easy_fs.py``).
It prints hai's ratios to each baseline and the issue-16 targets (avg JCT <= 0.7x las and
<= 0.6x easy-fs, p50 <= 1.2x las, p99 <= 0.5x las, lost GPU-time <= 1.5% of allocated).

The same as running, for each policy,

    hai topology fire-flyer --nodes 64 --zones 2 --nodes-per-leaf 8 --out ff64.csv
    hai sim --topology ff64.csv --trace ../shared/data/philly.csv --policy hai --json
    hai sim --topology ff64.csv --trace ../shared/data/philly.csv --policy fifo --json

(with the default scheduler settings), plus the wall time of each replay and the checks of the
issue's targets: hai avg JCT <= 0.5 x fifo, utilization >= fifo, min_leaves_ratio >= 0.99, no
double allocations, cross-zone jobs or quota violations.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))

from hai.domain.topology import fire_flyer
from hai.settings import get_settings
from hai.sim.engine import SimConfig, Simulation
from hai.sim.policies import make_scheduler
from hai.sim.trace import parse_trace

COLUMNS = [
    "avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_queue_s", "gpu_utilization", "useful_gpu_utilization",
    "makespan_s", "preemptions", "lost_gpu_s", "lost_share", "multi_node_jobs", "min_leaves_ratio", "cross_zone_jobs",
    "double_allocations", "quota_violations", "cycles", "wall_s",
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=ROOT / ".." / "shared" / "data" / "philly.csv")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--zones", type=int, default=2)
    ap.add_argument("--nodes-per-leaf", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--policies", default="hai,las,easy-fs,fifo")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    topo = fire_flyer(nodes=args.nodes, zones=args.zones, nodes_per_leaf=args.nodes_per_leaf)
    jobs, _ = parse_trace(args.trace.read_text(), time_scale=args.time_scale, limit=args.limit)
    policy = get_settings().scheduler.policy()  # = services.scheduling.policy_from_settings()
    rows = {}
    for name in args.policies.split(","):
        scheduler = make_scheduler(name)
        config = SimConfig(cycle_interval_s=get_settings().scheduler.interval_s)
        sim = Simulation(topo, jobs, policy=policy, scheduler=scheduler, policy_name=name, config=config)
        t0 = time.perf_counter()
        m = sim.run().metrics
        m["wall_s"] = round(time.perf_counter() - t0, 1)
        rows[name] = m
        print(f"{name}: {m['wall_s']} s", file=sys.stderr, flush=True)
    checks: dict = {}
    for m in rows.values():
        m["lost_share"] = round(m["lost_gpu_s"] / m["allocated_gpu_s"], 4) if m.get("allocated_gpu_s") else 0.0
    if "hai" in rows:
        h = rows["hai"]
        for b in rows:
            if b == "hai":
                continue
            for k in ("avg_jct_s", "p50_jct_s", "p99_jct_s"):
                if rows[b][k]:
                    checks[f"{k[:-6]}_vs_{b}"] = round(h[k] / rows[b][k], 3)
        if "las" in rows:
            L = rows["las"]
            checks["avg_le_0.7_las"] = h["avg_jct_s"] <= 0.7 * L["avg_jct_s"]
            checks["p50_le_1.2_las"] = h["p50_jct_s"] <= 1.2 * L["p50_jct_s"]
            checks["p99_le_0.5_las"] = h["p99_jct_s"] <= 0.5 * L["p99_jct_s"]
        if "easy-fs" in rows:
            checks["avg_le_0.6_easy_fs"] = h["avg_jct_s"] <= 0.6 * rows["easy-fs"]["avg_jct_s"]
        checks["lost_le_1.5pct"] = h["lost_share"] <= 0.015
    if "hai" in rows and "fifo" in rows:
        h, f = rows["hai"], rows["fifo"]
        checks |= {
            "jct_ratio": round(h["avg_jct_s"] / f["avg_jct_s"], 3) if f["avg_jct_s"] else None,
            "jct_ratio_ok": h["avg_jct_s"] <= 0.5 * f["avg_jct_s"],
            "utilization_ok": h["gpu_utilization"] >= f["gpu_utilization"],
            "min_leaves_ok": h["min_leaves_ratio"] >= 0.99,
            "zero_violations_ok": h["double_allocations"] == h["cross_zone_jobs"] == h["quota_violations"] == 0,
        }
    out = {
        "cluster": {"nodes": args.nodes, "zones": args.zones, "nodes_per_leaf": args.nodes_per_leaf},
        "trace_jobs": len(jobs),
        "time_scale": args.time_scale,
        "rows": rows,
        "checks": checks,
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"{len(jobs)} jobs, {args.nodes} nodes x 8 GPUs, {args.zones} zones, leaves of {args.nodes_per_leaf}")
    names = list(rows)
    print(f"{'':>24}" + "".join(f"{n:>16}" for n in names))
    for c in COLUMNS:
        print(f"{c:>24}" + "".join(f"{rows[n].get(c, ''):>16}" for n in names))
    for k, v in checks.items():
        print(f"{k:>24}  {v}")


if __name__ == "__main__":
    main()
