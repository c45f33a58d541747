"""`hai topology ...` and `hai sim`: topology files and trace replay through the real scheduler.

Registered by hai/cli/main.py as ``app.add_typer(topology_app, name="topology")`` and
``app.command("sim")(sim)``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from hai.domain.topology import (
    TopologyError,
    fire_flyer,
    format_topology_csv,
    from_crux,
    parse_topology_csv,
    summarize,
)
from hai.services.scheduling import policy_from_settings  # noqa: F401  (`hai sim` runs the server's policy)

topology_app = typer.Typer(help="Write cluster topology files (CSV node,gpus,leaf,zone).", no_args_is_help=True)


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        _fail(f"cannot read {what} {path}: {exc.strerror or exc}")


def _write(text: str, out: Path | None) -> None:
    if out is None:
        sys.stdout.write(text)
        return
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        _fail(f"cannot write {out}: {exc.strerror or exc}", 1)
    typer.echo(f"wrote {out}", err=True)


@topology_app.command("fire-flyer")
def topology_fire_flyer(
    nodes: Annotated[int, typer.Option(min=1, help="GPU nodes in all")] = 1250,
    zones: Annotated[int, typer.Option(min=1, help="network zones (two-layer fat-trees)")] = 2,
    nodes_per_leaf: Annotated[int, typer.Option(min=1, help="nodes under one leaf switch")] = 20,
    gpus_per_node: Annotated[int, typer.Option(min=1)] = 8,
    out: Annotated[Path | None, typer.Option(help="write here instead of stdout")] = None,
) -> None:
    """The Fire-Flyer 2 shape: zones of fat-trees, leaves of 20 nodes, 8 GPUs a node."""
    try:
        topo = fire_flyer(nodes=nodes, zones=zones, nodes_per_leaf=nodes_per_leaf, gpus_per_node=gpus_per_node)
    except TopologyError as exc:
        _fail(str(exc))
    _write(format_topology_csv(topo), out)


@topology_app.command("from-crux")
def topology_from_crux(
    file: Annotated[Path, typer.Argument(help="Crux/Lingjun topology CSV (ip,DSW,PSW,ASW)")],
    gpus_per_node: Annotated[int, typer.Option(min=1)] = 8,
    out: Annotated[Path | None, typer.Option(help="write here instead of stdout")] = None,
) -> None:
    """Convert a Crux 3-tier Clos topology: zone = DSW, leaf = ASW, 8 GPUs a node."""
    import csv
    import io

    text = _read(file, "crux topology")
    try:
        topo = from_crux(csv.DictReader(io.StringIO(text)), gpus_per_node=gpus_per_node)
    except TopologyError as exc:
        _fail(str(exc))
    _write(format_topology_csv(topo), out)


def _human(m: dict, topo_line: str, wall_s: float) -> str:
    rows = [
        ("policy", m["policy"]),
        ("cluster", topo_line),
        ("jobs", f"{m['jobs']} ({m['completed']} completed, {m['rejected']} never fit, {m['unfinished']} unfinished)"),
        ("avg JCT", f"{m['avg_jct_s']:.0f} s"),
        ("p50 / p99 JCT", f"{m['p50_jct_s']:.0f} s / {m['p99_jct_s']:.0f} s"),
        ("avg queueing", f"{m['avg_queue_s']:.0f} s"),
        ("by priority", ", ".join(f"{k} {v:.0f} s" for k, v in m["avg_queue_s_by_priority"].items()) or "-"),
        ("GPU utilization", f"{m['gpu_utilization']:.1%} allocated, {m['useful_gpu_utilization']:.1%} useful"),
        ("makespan", f"{m['makespan_s']:.0f} s"),
        ("preemptions", f"{m['preemptions']} ({m['lost_gpu_s']:.0f} GPU-s lost, {m['overhead_gpu_s']:.0f} GPU-s overhead)"),
        ("multi-node jobs", f"{m['multi_node_jobs']} (fewest leaves: {m['min_leaves_ratio']:.1%} of starts)"),
        ("cross-zone jobs", str(m["cross_zone_jobs"])),
        ("double allocations", str(m["double_allocations"])),
        ("quota violations", str(m["quota_violations"])),
        ("cycles", f"{m['cycles']} in {wall_s:.1f} s wall"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows) + "\n"


def sim(
    topology: Annotated[Path, typer.Option("--topology", help="topology CSV (node,gpus,leaf,zone)")],
    trace: Annotated[Path, typer.Option("--trace", help="trace CSV (timestamp,duration,num_gpus[,priority,user,group])")],
    policy: Annotated[str, typer.Option("--policy", help="hai (this scheduler), fifo (public HAI release), las (Tiresias 2D-LAS) or easy-fs (Slurm fair share + EASY backfill)")] = "hai",
    time_scale: Annotated[
        float, typer.Option("--time-scale", min=0.0001, help="divide arrival times by this (2 = twice the load)")
    ] = 1.0,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="replay only the first N jobs by arrival")] = None,
    checkpoint_interval_s: Annotated[float, typer.Option("--checkpoint-interval-s", min=0.001)] = 300.0,
    checkpoint_cost_s: Annotated[float, typer.Option("--checkpoint-cost-s", min=0.0)] = 10.0,
    restart_cost_s: Annotated[float, typer.Option("--restart-cost-s", min=0.0)] = 30.0,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Replay a job trace with a virtual clock through the scheduler; print JCT, queueing,
    utilization, preemptions and placement checks."""
    from hai.sim.engine import SimConfig, Simulation
    from hai.sim.policies import POLICIES, make_scheduler
    from hai.sim.trace import TraceError, parse_trace

    if policy not in POLICIES:
        _fail(f"--policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    try:
        topo = parse_topology_csv(_read(topology, "topology"))
    except TopologyError as exc:
        _fail(f"{topology}: {exc}")
    try:
        jobs, skipped = parse_trace(_read(trace, "trace"), time_scale=time_scale, limit=limit)
    except TraceError as exc:
        _fail(f"{trace}: {exc}")
    pol = policy_from_settings()
    from hai.settings import get_settings

    interval = get_settings().scheduler.interval_s
    scheduler = make_scheduler(policy)
    engine = Simulation(
        topo,
        jobs,
        policy=pol,
        scheduler=scheduler,
        policy_name=policy,
        config=SimConfig(checkpoint_interval_s, checkpoint_cost_s, restart_cost_s, cycle_interval_s=interval),
    )
    started = time.perf_counter()
    result = engine.run()
    wall = time.perf_counter() - started
    m = dict(result.metrics)
    m["skipped_rows"] = skipped
    m["wall_s"] = round(wall, 2)
    zones = summarize(topo)
    m["cluster"] = {"nodes": len(topo), "gpus": sum(n.gpus for n in topo), "zones": len(zones)}
    if as_json:
        typer.echo(json.dumps(m, sort_keys=False))
        return
    topo_line = f"{len(topo)} nodes, {m['cluster']['gpus']} GPUs, {len(zones)} zone(s)"
    typer.echo(_human(m, topo_line, wall), nl=False)
