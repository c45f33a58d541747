"""One scheduling cycle at Fire-Flyer scale, and a burst of small jobs into an empty cluster.

    python benchmarks/scheduler_cycle.py --nodes 1250 --running 2000 --queued 10000 --json

Builds a Fire-Flyer topology (two zones, leaves of 20 nodes, 8 GPUs a node), packs ``--running``
jobs onto it with the scheduler itself (a realistic, nearly full cluster: mixed shapes and
priorities, some past their minimum runtime or quantum, checkpoints of various ages, group
quotas), queues ``--queued`` jobs (mixed shapes, priorities, users, waiting times), then times
``schedule(snapshot, policy, now)`` ``--repeat`` times. The snapshot is pure input, so every
repetition does the full cycle: demotions, placement, preemption planning (up to the per-cycle
cap), time-sharing, and a pending reason for every job that waits.

Also times placing ``--burst`` (5,000) newly submitted 1-GPU jobs into an empty cluster of the
same size (10,000 GPUs at 1,250 nodes). Prints ``median_ms``, ``p99_ms``, ``peak_rss_mb`` and
the burst numbers.

``--hash``: also the sha256 of the cycle's whole output (``decision_hash.digest``: starts,
suspensions, demotions, reservations and every pending reason, in order), to show that a change
of the scheduler's code changed no decision on this snapshot.

``--kept``: the steady cycle with the queue kept across cycles (``KeptQueue``, built by a
first, untimed cycle). ``--changing N``: then N cycles over snapshots that change between
cycles (``next_snapshot``: arrivals, ends, the cycle's own starts, suspensions, reservations
and demotions applied), each timed with the kept queue and from scratch on the same snapshot
(alternating which goes first), with a count of cycles whose decisions differ (must be 0).

``--settings``: the policy from the ``HAI_SCHEDULER__*`` settings instead of the defaults (e.g.
least attained service, issue 16); the queued jobs then carry attained service from earlier
attempts (a seeded draw: 60% none, the rest log-uniform up to 10^7 GPU-seconds), so the queue
spreads over the service classes.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from dataclasses import replace
from operator import is_
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))

from hai.domain.jobs import JobState, Priority
from hai.domain.scheduler import (
    NodeView,
    Policy,
    QueueDelta,
    QueuedJob,
    Quota,
    RunningDelta,
    RunningJob,
    Snapshot,
    schedule,
)
from hai.domain.topology import fire_flyer
from hai.settings import get_settings

HOUR = 3600.0
NOW = 1_000_000_000.0
# (nodes, gpus per node), weight: mostly small jobs, some whole nodes, a few large gangs
# (running: ~4.4 GPUs a job, so 2,000 jobs fill ~88% of 10,000 GPUs)
RUNNING_SHAPES = [((1, 1), 40), ((1, 2), 15), ((1, 4), 20), ((1, 8), 18), ((2, 8), 5), ((4, 8), 2)]
SHAPES = [((1, 1), 30), ((1, 2), 10), ((1, 4), 12), ((1, 8), 25), ((2, 8), 10), ((4, 8), 8), ((8, 8), 4), ((16, 8), 1)]
PRIOS = [(Priority.LOW, 20), (Priority.NORMAL, 55), (Priority.ABOVE_NORMAL, 5), (Priority.HIGH, 15), (Priority.VERY_HIGH, 5)]


def _pick(rng: random.Random, table):
    items, weights = zip(*table)
    return rng.choices(items, weights)[0]


def _empty_nodes(n: int) -> tuple[NodeView, ...]:
    return tuple(NodeView(t.name, t.zone, t.leaf, t.gpus, tuple(range(t.gpus))) for t in fire_flyer(nodes=n))


def build_snapshot(nodes: int, running: int, queued: int, seed: int) -> Snapshot:
    rng = random.Random(seed)
    users = [f"user{i:03d}" for i in range(200)]
    groups = [f"group{i:02d}" for i in range(20)]
    group_of = {u: groups[i % len(groups)] for i, u in enumerate(users)}
    views = _empty_nodes(nodes)

    # pack the running jobs with the scheduler itself (so their placement is realistic)
    want = []
    for i in range(running):
        (n, g), p, u = _pick(rng, RUNNING_SHAPES), _pick(rng, PRIOS), rng.choice(users)
        want.append(QueuedJob(i + 1, u, group_of[u], p, n, g, NOW - 20 * HOUR + i, NOW - 20 * HOUR + i))
    packed = schedule(Snapshot(views, queued=tuple(want)), Policy(preemption=False, time_sharing=False), NOW)
    held: dict[str, set[int]] = {}
    run_jobs = []
    by_id = {q.id: q for q in want}
    for st in packed.starts:
        q = by_id[st.job_id]
        started = NOW - rng.uniform(60, 10 * HOUR)
        ckpt = started + rng.uniform(0, NOW - started) if rng.random() < 0.8 else None
        for a in st.allocations:
            held.setdefault(a.node, set()).update(a.gpus)
        run_jobs.append(
            RunningJob(
                id=q.id,
                user=q.user,
                group=q.group,
                priority=q.priority,
                nodes=q.nodes,
                gpus_per_node=q.gpus_per_node,
                allocations=st.allocations,
                state=JobState.SUSPENDING if rng.random() < 0.01 else JobState.RUNNING,
                started_at=started,
                first_submitted_at=started - rng.uniform(0, 5 * HOUR),
                submitted_priority=q.priority,
                last_checkpoint_at=ckpt,
            )
        )
    node_views = tuple(
        NodeView(v.name, v.zone, v.leaf, v.gpus, tuple(g for g in range(v.gpus) if g not in held.get(v.name, ())))
        for v in views
    )
    # a few drained / unhealthy nodes
    node_views = tuple(
        NodeView(v.name, v.zone, v.leaf, v.gpus, v.free_gpus, schedulable=rng.random() > 0.01) for v in node_views
    )
    queue = []
    for i in range(queued):
        (n, g), p, u = _pick(rng, SHAPES), _pick(rng, PRIOS), rng.choice(users)
        sub = NOW - rng.uniform(0, 6 * HOUR)
        queue.append(QueuedJob(100_000 + i, u, group_of[u], p, n, g, sub - rng.uniform(0, HOUR), sub))
    quotas = [Quota(gr, p, 800) for gr in groups for p in (Priority.HIGH, Priority.VERY_HIGH)]
    quotas += [Quota(gr, Priority.NORMAL, 2000) for gr in groups]
    usage = {u: rng.uniform(0, 5e5) for u in users}
    return Snapshot(node_views, tuple(run_jobs), tuple(queue), tuple(quotas), usage)


def with_attained_service(snap: Snapshot, seed: int) -> Snapshot:
    """The queued jobs with attained service from earlier attempts (``--settings``): a seeded
    draw, 60% none, the rest log-uniform from 100 to 10^7 GPU-seconds."""
    rng = random.Random(seed + 1)
    att = [0.0 if rng.random() < 0.6 else 10 ** rng.uniform(2, 7) for _ in snap.queued]
    return replace(snap, queued=tuple(replace(q, attained_gpu_s=a) for q, a in zip(snap.queued, att)))


def next_snapshot(snap: Snapshot, d, now: float, dt: float, rng: random.Random, arrivals: int, ends: int,
                  next_id: int) -> tuple[Snapshot, int]:
    """The snapshot a service would read ``dt`` seconds after persisting ``d`` (at ``now``), as
    the live service's QueueCache builds it: a queued job whose row did not change is the very
    same object as before (a changed one is a new object). The cycle's starts run (STARTING),
    its suspensions are asked for (SUSPENDING, for their job) and its demotions applied, its
    reservations stored on the queued jobs; half of the jobs already suspending give their GPUs
    back and re-enter the queue (their attained service grown); ``ends`` running jobs (at
    random) end; ``arrivals`` new jobs are submitted. Returns the snapshot and the next job id."""
    by_q = {q.id: q for q in snap.queued}
    taken: dict[str, set[int]] = {}
    freed: dict[str, set[int]] = {}
    later = now + dt
    running: list[RunningJob] = []
    susp = {s.job_id: s.for_job_id for s in d.suspends}
    dem = {m.job_id: m.to for m in d.demotions}
    back: list[QueuedJob] = []
    came: list[RunningJob] = []  # (the RunningDelta) new objects: started, or a row that changed
    left: list[RunningJob] = []  # objects of the last tuple not in the new one
    ending = set(rng.sample(range(len(snap.running)), min(ends, len(snap.running))))
    for k, r in enumerate(snap.running):
        if k in ending or (r.state is JobState.SUSPENDING and rng.random() < 0.5):
            left.append(r)
            for a in r.allocations:
                freed.setdefault(a.node, set()).update(a.gpus)
            if k not in ending:  # suspended: back in the queue
                back.append(QueuedJob(r.id, r.user, r.group, r.submitted_priority or r.priority, r.nodes,
                                      r.gpus_per_node, r.first_submitted_at, later,
                                      submitted_priority=r.submitted_priority, allow_cross_zone=r.allow_cross_zone,
                                      attained_gpu_s=r.attained_gpu_s + (later - r.started_at) * r.gpu_count))
            continue
        was = r
        if r.id in dem:
            r = replace(r, priority=Priority(dem[r.id]))
        if r.id in susp:
            r = replace(r, state=JobState.SUSPENDING, suspend_requested_for=susp[r.id])
        if r is not was:
            left.append(was)
            came.append(r)
        running.append(r)
    for st in d.starts:
        q = by_q[st.job_id]
        for a in st.allocations:
            taken.setdefault(a.node, set()).update(a.gpus)
        running.append(RunningJob(q.id, q.user, q.group, q.priority, q.nodes, q.gpus_per_node, st.allocations,
                                  JobState.STARTING, now, q.first_submitted_at, q.submitted_priority,
                                  allow_cross_zone=q.allow_cross_zone, attained_gpu_s=q.attained_gpu_s))
        came.append(running[-1])
    nodes = tuple(
        n if n.name not in freed and n.name not in taken else
        NodeView(n.name, n.zone, n.leaf, n.gpus,
                 tuple(sorted(g for g in set(n.free_gpus) | freed.get(n.name, set()) if g not in taken.get(n.name, ()))),
                 n.schedulable)
        for n in snap.nodes
    )  # fmt: skip
    started = {s.job_id for s in d.starts}
    queued = []
    changed: list[QueuedJob] = []  # new objects: rows that changed, arrivals, jobs back in the queue
    for q in snap.queued:
        if q.id in started:
            continue
        want = tuple(d.reservations.get(q.id, ()))
        if q.reserved_nodes != want:
            q = replace(q, reserved_nodes=want)
            changed.append(q)
        queued.append(q)
    users = sorted({q.user for q in snap.queued} | {r.user for r in snap.running}) or ["user000"]
    group_of = {q.user: q.group for q in snap.queued}
    for _ in range(arrivals):
        (n, g), p, u = _pick(rng, SHAPES), _pick(rng, PRIOS), rng.choice(users)
        changed.append(QueuedJob(next_id, u, group_of.get(u, "group00"), p, n, g, later, later))
        queued.append(changed[-1])
        next_id += 1
    queued.extend(back)
    changed.extend(back)
    queued.sort(key=lambda q: q.id)  # as the service reads them
    # as the service's ActiveCache does, how the running tuple differs from the last
    now_running = tuple(running)
    rdelta = RunningDelta(snap.running, now_running, tuple(came), tuple(left))
    if len(queued) == len(snap.queued) and all(map(is_, queued, snap.queued)):
        # no queued row changed: the service hands over the same tuple
        return Snapshot(nodes, now_running, snap.queued, snap.quotas, snap.usage, running_delta=rdelta), next_id
    # and, as the service's QueueCache does, how the new tuple differs from the last
    new = tuple(queued)
    delta = QueueDelta(snap.queued, new, tuple(changed), tuple(sorted(started)))
    return Snapshot(nodes, now_running, new, snap.quotas, snap.usage, queue_delta=delta, running_delta=rdelta), next_id


def changing_cycles(args, snap: Snapshot, policy: Policy) -> dict:
    """``--changing N``: N cycles over snapshots that change between cycles (``next_snapshot``),
    each timed with the kept queue (``KeptQueue``) and from scratch on the very same snapshot,
    in alternating order; the decisions must be identical."""
    from decision_hash import canonical

    from hai.domain.scheduler import KeptQueue

    rng = random.Random(args.seed + 7)
    kept = KeptQueue()
    schedule(snap, policy, NOW, kept=kept)  # the first cycle builds the kept order (not timed)
    t_kept, t_scratch, cpu_kept, cpu_scratch = [], [], [], []
    now, next_id = NOW, 10_000_000
    d = schedule(snap, policy, now)
    differ = 0
    for k in range(args.changing):
        snap, next_id = next_snapshot(snap, d, now, args.dt, rng, args.arrivals, args.ends, next_id)
        now += args.dt
        for which in ((0, 1) if k % 2 else (1, 0)):
            c0, t0 = time.process_time(), time.perf_counter()
            got = schedule(snap, policy, now, kept=kept) if which else schedule(snap, policy, now)
            t1, c1 = time.perf_counter(), time.process_time()
            (t_kept if which else t_scratch).append((t1 - t0) * 1000)
            (cpu_kept if which else cpu_scratch).append((c1 - c0) * 1000)
            if which:
                dk = got
            else:
                d = got
        differ += canonical(dk) != canonical(d)
    return {
        "changing_cycles": args.changing,
        "arrivals": args.arrivals,
        "ends": args.ends,
        "dt_s": args.dt,
        "kept_median_ms": round(statistics.median(t_kept), 2),
        "scratch_median_ms": round(statistics.median(t_scratch), 2),
        "kept_cpu_median_ms": round(statistics.median(cpu_kept), 2),
        "scratch_cpu_median_ms": round(statistics.median(cpu_scratch), 2),
        "kept_rebuilds": kept.rebuilds,
        "cycles_with_different_decisions": differ,
        "last_starts": len(d.starts),
        "last_suspends": len(d.suspends),
        "last_queued": len(snap.queued),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1250)
    ap.add_argument("--running", type=int, default=2000)
    ap.add_argument("--queued", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--burst", type=int, default=5000, help="1-GPU jobs placed into an empty cluster")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--settings", action="store_true", help="the policy from HAI_SCHEDULER__* (default: Policy())")
    ap.add_argument("--hash", action="store_true", help="also print the sha256 of the cycle's whole output (decision_hash.digest)")
    ap.add_argument("--kept", action="store_true", help="time the steady cycle with a KeptQueue passed (built by an untimed first cycle)")
    ap.add_argument("--changing", type=int, default=0, metavar="N",
                    help="also N cycles over snapshots that change between cycles, kept queue against from scratch")
    ap.add_argument("--arrivals", type=int, default=200, help="(--changing) jobs submitted between two cycles")
    ap.add_argument("--ends", type=int, default=100, help="(--changing) running jobs that end between two cycles")
    ap.add_argument("--dt", type=float, default=10.0, help="(--changing) seconds between two cycles")
    args = ap.parse_args()

    snap = build_snapshot(args.nodes, args.running, args.queued, args.seed)
    policy = Policy()
    if args.settings:
        policy = get_settings().scheduler.policy()
        snap = with_attained_service(snap, args.seed)
    times = []
    d = None
    kept = None
    if args.kept:
        from hai.domain.scheduler import KeptQueue

        kept = KeptQueue()
        schedule(snap, policy, NOW, kept=kept)
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        d = schedule(snap, policy, NOW, kept=kept)
        times.append((time.perf_counter() - t0) * 1000)
    assert d is not None
    times.sort()
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]

    empty = Snapshot(
        _empty_nodes(args.nodes),
        queued=tuple(QueuedJob(i + 1, f"u{i % 97}", "g", Priority.NORMAL, 1, 1, NOW + i, NOW + i) for i in range(args.burst)),
    )
    burst_times = []
    for _ in range(5):
        t0 = time.perf_counter()
        bd = schedule(empty, policy, NOW + args.burst)
        burst_times.append((time.perf_counter() - t0) * 1000)

    out = {
        "policy": "settings" if args.settings else "default",
        "nodes": args.nodes,
        "gpus": sum(v.gpus for v in snap.nodes),
        "running": len(snap.running),
        "running_gpus": sum(r.gpu_count for r in snap.running),
        "queued": len(snap.queued),
        "repeat": args.repeat,
        "median_ms": round(statistics.median(times), 2),
        "p99_ms": round(p99, 2),
        "starts": len(d.starts),
        "suspends": len(d.suspends),
        "demotions": len(d.demotions),
        "pending_reasons": len(d.pending_reasons),
        "burst_jobs": args.burst,
        "burst_started": len(bd.starts),
        "burst_ms": round(statistics.median(burst_times), 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if args.kept:
        out["kept"] = True
    if args.changing:
        out.update(changing_cycles(args, snap, policy))
    if args.hash:  # starts, suspensions, demotions, reservations, every pending reason, in order
        from decision_hash import digest

        out["decisions_sha256"] = digest(d)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>16}  {v}")


if __name__ == "__main__":
    main()
