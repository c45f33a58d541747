"""Hash the full output of scheduling cycles on generated snapshots: the guard rail of a refactor.

    python benchmarks/decision_hash.py            # print {case: sha256} as JSON
    python benchmarks/decision_hash.py --check    # compare with benchmarks/results/decision_hashes.json
    python benchmarks/decision_hash.py --record   # (re)write that file

A refactor of the scheduler must not change a decision. Each case is one cycle on a snapshot
from ``scheduler_cycle.build_snapshot`` (4 seeds x 2 queue lengths, on a 320-node Fire-Flyer
cluster packed by the scheduler itself), under the default policy and with time-sharing off,
plus two variants per seed (preemption off; a per-cycle cap of 3 with cross-zone jobs in the
queue and per-job minimum runtimes), plus a *second* cycle after each default one (the first
cycle's starts running, its suspensions in progress, its reservations stored on the queued
jobs, its demotions applied, half of its victims and 5% of the other running jobs gone, 90 s
later): that is where reservations, jobs suspending for a
waiting job and reserved-node rules decide. The hash covers everything ``Decisions`` carries:
starts (allocations and reason), suspensions (job, reason, for whom), demotions, reservations
and every pending reason, in order.

``tests/unit/test_decision_hash.py`` keeps the recorded hashes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "backend"))
sys.path.insert(0, str(ROOT))

from scheduler_cycle import NOW, build_snapshot  # noqa: E402

from hai.domain.jobs import JobState, Priority  # noqa: E402
from hai.domain.scheduler import Decisions, NodeView, Policy, RunningJob, Snapshot, schedule  # noqa: E402

RECORD = ROOT / "results" / "decision_hashes.json"
NODES, RUNNING = 320, 520
QUEUES = (300, 2500)
SEEDS = (0, 1, 2, 3)


def canonical(d: Decisions) -> list:
    """Everything the cycle decided, as plain data (order kept: it is part of the output)."""
    return [
        [(s.job_id, [(a.node, list(a.gpus)) for a in s.allocations], s.reason) for s in d.starts],
        [(s.job_id, s.reason, s.for_job_id) for s in d.suspends],
        [(m.job_id, m.to.value, m.reason) for m in d.demotions],
        [(k, list(v)) for k, v in d.reservations.items()],
        [(k, v) for k, v in d.pending_reasons.items()],
    ]


def digest(d: Decisions) -> str:
    return hashlib.sha256(json.dumps(canonical(d)).encode()).hexdigest()


def _twist(snap: Snapshot, seed: int) -> Snapshot:
    """Cross-zone multi-node jobs in the queue, per-job minimum runtimes on some running jobs."""
    rng = random.Random(seed + 100)
    queued = tuple(
        replace(q, allow_cross_zone=True) if q.nodes > 1 and rng.random() < 0.3 else q for q in snap.queued
    )
    running = tuple(
        replace(r, min_runtime_s=rng.choice((60.0, 7200.0))) if rng.random() < 0.2 else r for r in snap.running
    )
    return replace(snap, queued=queued, running=running)


def next_snapshot(snap: Snapshot, d: Decisions, now: float, seed: int) -> Snapshot:
    """The snapshot a service would read after persisting ``d`` (at ``now``) and a while later:
    half of the suspended jobs have checkpointed and given their GPUs back, 5% of the other
    running jobs have ended (both chosen by a seeded RNG)."""
    rng = random.Random(seed + 200)
    by_q = {q.id: q for q in snap.queued}
    taken: dict[str, set[int]] = {}
    freed: dict[str, set[int]] = {}
    started = []
    for s in d.starts:
        q = by_q[s.job_id]
        for a in s.allocations:
            taken.setdefault(a.node, set()).update(a.gpus)
        started.append(
            RunningJob(
                q.id, q.user, q.group, q.priority, q.nodes, q.gpus_per_node, s.allocations, JobState.STARTING,
                now, q.first_submitted_at, q.submitted_priority, allow_cross_zone=q.allow_cross_zone,
            )
        )  # fmt: skip
    susp = {s.job_id: s.for_job_id for s in d.suspends}
    dem = {m.job_id: m.to for m in d.demotions}
    running = []
    for r in snap.running:
        if rng.random() < (0.5 if r.id in susp else 0.05):
            for a in r.allocations:
                freed.setdefault(a.node, set()).update(a.gpus)
            continue
        if r.id in dem:
            r = replace(r, priority=Priority(dem[r.id]))
        if r.id in susp:
            r = replace(r, state=JobState.SUSPENDING, suspend_requested_for=susp[r.id])
        running.append(r)
    nodes = tuple(
        NodeView(n.name, n.zone, n.leaf, n.gpus,
                 tuple(sorted(g for g in set(n.free_gpus) | freed.get(n.name, set()) if g not in taken.get(n.name, ()))),
                 n.schedulable)
        for n in snap.nodes
    )  # fmt: skip
    started_ids = {s.job_id for s in d.starts}
    queued = tuple(
        replace(q, reserved_nodes=tuple(d.reservations.get(q.id, ()))) for q in snap.queued if q.id not in started_ids
    )
    return Snapshot(nodes, tuple(running) + tuple(started), queued, snap.quotas, snap.usage)


def cases():
    """(name, snapshot, policy, now) for every case, built deterministically."""
    for seed in SEEDS:
        for queued in QUEUES:
            snap = build_snapshot(NODES, RUNNING, queued, seed)
            for label, pol in (("default", Policy()), ("no-ts", Policy(time_sharing=False))):
                yield f"s{seed}-q{queued}-{label}", snap, pol, NOW
                if label == "default":
                    d = schedule(snap, pol, NOW)
                    yield f"s{seed}-q{queued}-{label}-cycle2", next_snapshot(snap, d, NOW, seed), pol, NOW + 90.0
        snap = build_snapshot(NODES, RUNNING, QUEUES[0], seed)
        yield f"s{seed}-no-preemption", snap, Policy(preemption=False), NOW
        capped = Policy(max_preemptions_per_cycle=3, min_runtime_s=1800.0, quantum_s=2 * 3600.0)
        yield f"s{seed}-capped-cross-zone", _twist(snap, seed), capped, NOW


def hashes() -> dict[str, str]:
    return {name: digest(schedule(snap, pol, now)) for name, snap, pol, now in cases()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help=f"compare with {RECORD.relative_to(ROOT.parent)}")
    ap.add_argument("--record", action="store_true", help="write the hashes to that file")
    args = ap.parse_args()
    got = hashes()
    if args.record:
        RECORD.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    if args.check:
        want = json.loads(RECORD.read_text())
        bad = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        print(json.dumps({"cases": len(got), "changed": bad}))
        sys.exit(1 if bad else 0)
    print(json.dumps(got, indent=1))


if __name__ == "__main__":
    main()
