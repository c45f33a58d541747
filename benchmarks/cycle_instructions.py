"""Instructions of one Fire-Flyer-scale scheduling cycle, counted by callgrind (deterministic).

    python benchmarks/cycle_instructions.py            # needs valgrind on the PATH

Wall-clock timing on a shared machine scatters by 10-20%; instruction counts agree to ~0.3%
from run to run, so they judge whether a change made the cycle cheaper or dearer. The snapshot
is the one of ``scheduler_cycle.py`` (1,250 nodes, 2,000 running, 10,000 queued, seed 0). Two
runs under ``valgrind --tool=callgrind``, one building the snapshot and running 1 cycle, one
running 3: the difference over 2 is the count of one cycle (the build, the imports and the
interpreter's start cancel out). Prints one JSON object.

``--nodes/--running/--queued``: another size (the 10k cycle of issue 12: ``--nodes 10000
--running 20000 --queued 100000 --cycles 2``, a few minutes). ``--kept``: the cycles with the
queue kept across them (``KeptQueue``), built by a first cycle in both runs.

``--save-snapshot FILE`` writes the snapshot of the size asked, pickled (outside valgrind: building
the 10k snapshot under callgrind takes longer than its cycles); ``--snapshot FILE`` then counts
cycles of that snapshot instead of building one (the 10k counts of issue 12:
``--save-snapshot /tmp/s10k.pkl --nodes 10000 --running 20000 --queued 100000``, then
``--snapshot /tmp/s10k.pkl --kept --cycles 2``).

``--changing N`` with ``--save-snapshot FILE``: the snapshot and the N that follow it, each as
``scheduler_cycle.next_snapshot`` makes it from the decisions of the one before (``scheduler_cycle.py
--changing``'s defaults: 200 arrivals, 100 ends, 10 s apart), pickled together; ``--snapshot FILE
--kept`` then counts the changing cycles with the queue kept across them (the first snapshot's
cycle builds it in both runs; the second run's cycles are snapshots 1..``--cycles``, so the count
is the mean over snapshots 2..``--cycles``): what a live cluster's cycle costs, the target of issue
12 (``--save-snapshot /tmp/c10k.pkl --changing 4 --nodes 10000 --running 20000 --queued 100000``,
then ``--snapshot /tmp/c10k.pkl --kept --cycles 4``).

``--settings``: as ``scheduler_cycle.py --settings``, the policy from the ``HAI_SCHEDULER__*``
settings and the queued jobs with attained service (e.g. the recommended least-attained-service
classes of issue 16):

    HAI_SCHEDULER__SERVICE_CLASSES_GPU_S='[1000,3250,10000,32500,100000,325000,1000000,3250000]' \
    HAI_SCHEDULER__SERVICE_CHECKPOINT_SLACK_S=30 python benchmarks/cycle_instructions.py --settings
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def _inner(
    cycles: int, settings: bool, size: tuple[int, int, int] = (1250, 2000, 10000), kept: bool = False, snapshot: str = ""
) -> None:
    sys.path.insert(0, str(ROOT.parent / "backend"))
    sys.path.insert(0, str(ROOT))
    from scheduler_cycle import NOW, build_snapshot, with_attained_service

    from hai.domain.scheduler import KeptQueue, Policy, schedule

    changing: list = []  # (snapshot, now) after the first (--changing)
    if snapshot:
        import pickle

        with open(snapshot, "rb") as f:
            snap = pickle.load(f)
        if isinstance(snap, list):
            snap, changing = snap[0][0], snap[1:]  # (the first at NOW)
            assert len(changing) >= cycles, f"{snapshot} holds {len(changing)} changing snapshots, {cycles} asked"
    else:
        snap = build_snapshot(*size, 0)
    policy = Policy()
    if settings:
        from hai.settings import get_settings

        policy = get_settings().scheduler.policy()
        snap = with_attained_service(snap, 0)
    queue = None
    if kept:  # built by a first cycle in both runs: it cancels out
        queue = KeptQueue()
        schedule(snap, policy, NOW, kept=queue)
    if changing:
        for later, now in changing[:cycles]:
            schedule(later, policy, now, kept=queue)
        return
    for _ in range(cycles):
        schedule(snap, policy, NOW, kept=queue)


def _count(cycles: int, settings: bool, extra: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
             "--inner", str(cycles), *(["--settings"] if settings else []), *extra],
            check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": "0"},
        )  # fmt: skip
        text = Path(out).read_text()
    m = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M)
    assert m, "no totals in the callgrind output"
    return int(m.group(1))


def _saved(path: str) -> tuple[list[int], bool]:
    """What a saved snapshot file holds: the size of its (first) snapshot as [nodes, running,
    queued], and whether it is a changing sequence (``--save-snapshot --changing``)."""
    import pickle

    sys.path.insert(0, str(ROOT.parent / "backend"))
    with open(path, "rb") as f:
        got = pickle.load(f)
    seq = isinstance(got, list)
    snap = got[0][0] if seq else got
    return [len(snap.nodes), len(snap.running), len(snap.queued)], seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inner", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--settings", action="store_true", help="the policy from HAI_SCHEDULER__* (default: Policy())")
    ap.add_argument("--nodes", type=int, default=1250)
    ap.add_argument("--running", type=int, default=2000)
    ap.add_argument("--queued", type=int, default=10000)
    ap.add_argument("--kept", action="store_true", help="cycles with the queue kept across them (KeptQueue)")
    ap.add_argument("--cycles", type=int, default=3, help="cycles of the second run (the first runs 1)")
    ap.add_argument("--snapshot", default="", help="count cycles of this pickled snapshot (see --save-snapshot)")
    ap.add_argument("--save-snapshot", default="", metavar="FILE", help="write the snapshot of the size asked, pickled, and stop")
    ap.add_argument("--changing", type=int, default=0, metavar="N",
                    help="(--save-snapshot) also the N snapshots that follow it (scheduler_cycle.next_snapshot)")
    args = ap.parse_args()
    size = (args.nodes, args.running, args.queued)
    if args.save_snapshot:
        import pickle

        sys.path.insert(0, str(ROOT.parent / "backend"))
        from scheduler_cycle import NOW, build_snapshot, next_snapshot

        snap = build_snapshot(*size, 0)
        out: object = snap
        if args.changing:  # as scheduler_cycle.changing_cycles (seed 0)
            import random

            from hai.domain.scheduler import Policy, schedule

            rng, policy, now, next_id = random.Random(7), Policy(), NOW, 10_000_000
            out = [(snap, now)]
            for _ in range(args.changing):
                d = schedule(snap, policy, now)
                snap, next_id = next_snapshot(snap, d, now, 10.0, rng, 200, 100, next_id)
                now += 10.0
                out.append((snap, now))
            sys.setrecursionlimit(100_000)  # (the snapshots share their unchanged jobs: deep pickles)
        with open(args.save_snapshot, "wb") as f:
            pickle.dump(out, f, protocol=5)
        return
    if args.inner is not None:
        _inner(args.inner, args.settings, size, args.kept, args.snapshot)
        return
    extra = ["--nodes", str(args.nodes), "--running", str(args.running), "--queued", str(args.queued)]
    extra += ["--kept"] if args.kept else []
    extra += ["--snapshot", os.path.abspath(args.snapshot)] if args.snapshot else []
    one, many = _count(1, args.settings, extra), _count(args.cycles, args.settings, extra)
    out = {"instructions_per_cycle": (many - one) // (args.cycles - 1), "run_1_cycle": one, f"run_{args.cycles}_cycles": many}
    # the size counted: the saved snapshot's own (its nodes, running and queued jobs; the size
    # flags do not apply to it), else the size asked
    shown, changing = _saved(args.snapshot) if args.snapshot else (list(size), False)
    print(json.dumps({"policy": "settings" if args.settings else "default", "size": shown, "kept": args.kept,
                      **({"changing": True} if changing else {}),
                      **({"snapshot": args.snapshot} if args.snapshot else {}), **out}))  # fmt: skip


if __name__ == "__main__":
    main()
