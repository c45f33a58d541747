"""CPU time of one scheduling cycle, an earlier commit's scheduler against this tree's, alternated
in one process (issue 12): on a shared machine only runs interleaved this closely compare.

    python benchmarks/cycle_ab.py --before 02ec89c --nodes 10000 --running 20000 --queued 100000 --rounds 6 --changing 8

The earlier commit's ``hai/domain/scheduler`` is extracted (``git archive``) into a temporary
package ``hai_before`` whose modules import each other there; ``model.py`` (the snapshot and
decision records) stays this tree's, so both read the same snapshot objects (the script refuses a
commit whose ``model.py`` differs). One snapshot (``scheduler_cycle.build_snapshot``) is timed
``--rounds`` times in each of four ways, in an order that alternates: before and after, each
with a kept queue (``KeptQueue``, built by an untimed first cycle) and from scratch. Then
``--changing N`` cycles over changing snapshots (``scheduler_cycle.next_snapshot``: arrivals,
ends, the cycle's own decisions applied), each snapshot given to the four in rotated order. Every
cycle's decisions must be the same in all four (``decision_hash.canonical``). Prints one JSON
object: CPU ms (``time.process_time``) min and median per way, the load average before and after.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))
sys.path.insert(0, str(ROOT / "benchmarks"))

_SUBMODULES = "core|explain|kept|placement|preemption|quota|reservations|victim_table|victims"


def load_before(rev: str, into: Path):
    """The scheduler package of ``rev`` as ``hai_before.domain.scheduler``."""
    blob = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "backend/hai/domain/scheduler"], check=True, capture_output=True
    ).stdout
    model_then = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:backend/hai/domain/scheduler/model.py"], check=True, capture_output=True
    ).stdout
    if model_then != (ROOT / "backend/hai/domain/scheduler/model.py").read_bytes():
        raise SystemExit(f"{rev}'s model.py differs from this tree's: the two cannot share snapshot objects")
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    pkg = into / "hai_before"
    pkg.mkdir()
    (into / "backend/hai/domain").rename(pkg / "domain")
    for p in (pkg, pkg / "domain"):
        (p / "__init__.py").touch()
    for f in (pkg / "domain/scheduler").glob("*.py"):
        text = re.sub(rf"hai\.domain\.scheduler\.({_SUBMODULES})\b", r"hai_before.domain.scheduler.\1", f.read_text())
        f.write_text(text)
    sys.path.insert(0, str(into))
    return importlib.import_module("hai_before.domain.scheduler")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the earlier commit (git revision)")
    ap.add_argument("--nodes", type=int, default=1250)
    ap.add_argument("--running", type=int, default=2000)
    ap.add_argument("--queued", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=6, help="steady cycles timed in each of the four ways")
    ap.add_argument("--changing", type=int, default=0, metavar="N", help="then N cycles over changing snapshots")
    args = ap.parse_args()

    from decision_hash import canonical
    from scheduler_cycle import NOW, build_snapshot, next_snapshot

    import hai.domain.scheduler as after

    with tempfile.TemporaryDirectory() as tmp:
        before = load_before(args.before, Path(tmp))
        assert before.Policy is after.Policy  # the same records
        snap = build_snapshot(args.nodes, args.running, args.queued, args.seed)
        pol = after.Policy()
        kb, ka = before.KeptQueue(), after.KeptQueue()
        ways = {"before_kept": (before, kb), "after_kept": (after, ka), "before_scratch": (before, None), "after_scratch": (after, None)}
        ref = canonical(after.schedule(snap, pol, NOW))
        for mod, kq in ways.values():
            assert canonical(mod.schedule(snap, pol, NOW, kept=kq)) == ref  # (builds the kept queues)
        out: dict = {"before": args.before, "size": [args.nodes, args.running, args.queued], "load_before": os.getloadavg()}
        steady: dict[str, list[float]] = {k: [] for k in ways}
        names = list(ways)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                mod, kq = ways[name]
                c = time.process_time()
                d = mod.schedule(snap, pol, NOW, kept=kq)
                steady[name].append((time.process_time() - c) * 1000)
                assert canonical(d) == ref
        out["steady_cpu_ms"] = {k: {"min": round(min(v), 1), "median": round(statistics.median(v), 1)} for k, v in steady.items()}
        if args.changing:
            rng = random.Random(args.seed + 7)
            changing: dict[str, list[float]] = {k: [] for k in ways}
            now, next_id, d, differ = NOW, 10_000_000, after.schedule(snap, pol, NOW), 0
            for k in range(args.changing):
                snap, next_id = next_snapshot(snap, d, now, 10.0, rng, 200, 100, next_id)
                now += 10.0
                got = {}
                for name in names[k % 4 :] + names[: k % 4]:
                    mod, kq = ways[name]
                    c = time.process_time()
                    got[name] = mod.schedule(snap, pol, now, kept=kq)
                    changing[name].append((time.process_time() - c) * 1000)
                d = got["after_scratch"]
                ref = canonical(d)
                differ += any(canonical(x) != ref for x in got.values())
            out["changing_cycles"] = args.changing
            out["changing_cpu_ms"] = {k: {"min": round(min(v), 1), "median": round(statistics.median(v), 1)} for k, v in changing.items()}
            out["cycles_with_different_decisions"] = differ
        out["load_after"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
