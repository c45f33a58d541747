"""A single submission's CPU in process, without HTTP (issue 12): ``submissions.submit_group`` with a
group of one, as the API's writer calls it for one request in flight, on a fresh SQLite file (the
``hai dev`` database) or, with ``--postgresql``, on HAI_TEST_DATABASE_URL (its schema is dropped
and migrated: a database of your own). Four 8-GPU nodes registered, one user; each user's
queued-jobs rows folded every 256 submissions, as the scheduler folds them.

Each measurement is a fresh process: ``--jobs`` submissions timed with ``time.process_time``.
``--before DIR`` measures another checkout's ``backend`` (on PYTHONPATH) too, the two alternated
round by round so both see the same minutes of a shared machine; ``--callgrind`` counts each
side's instructions a submission instead (valgrind: a run of ``--jobs`` and one of five times as
many, the difference divided by the extra jobs: start-up cancels out).

    python benchmarks/submit_inprocess.py [--jobs 1000 --rounds 6] [--before /other/checkout/backend] [--callgrind]
    python benchmarks/submit_inprocess.py --postgresql --loop [--before ...]   # as `hai server` writes one: on the event loop
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def worker(jobs: int, postgresql: bool, key: bool, loop: bool = False, group: int = 1) -> float:
    """CPU milliseconds a submission, measured in this process (``group`` submissions a call)."""
    # ``hai`` first, from the backend PYTHONPATH names: api_load puts this checkout's backend first
    # on sys.path, but a submodule is found through its imported package's own path
    import hai  # noqa: F401
    from api_load import reset_postgres

    from hai.db.migrate import upgrade
    from hai.protocol import AgentHello, GpuInfo
    from hai.schemas.jobs import JobCreate
    from hai.services import agents, auth, queued_counts, submissions
    from hai.services.context import Platform
    from hai.settings import Settings

    tmp = Path(tempfile.mkdtemp(prefix="hai-submit-inprocess-"))
    if postgresql:
        url = os.environ["HAI_TEST_DATABASE_URL"]
        reset_postgres(url)
    else:
        url = f"sqlite:///{tmp / 'hai.db'}"
    upgrade(url)
    platform = Platform.from_settings(Settings(data_dir=tmp, frontend_dist=tmp / "none", db={"url": url}))
    with platform.sessions() as s:
        for n in range(4):
            agents.register(session=s, settings=platform.settings, hello=AgentHello(
                node=f"n{n}", zone="A", leaf="A1", address="127.0.0.1", fake_gpus=True,
                gpus=[GpuInfo(index=i, uuid=f"GPU-{n}-{i}", model="Fake", memory_total_mib=1) for i in range(8)]))
        user, _ = auth.create_user(session=s, name="alice", group="g")
        alice = auth.Principal(kind="user", user_id=user.id, name="alice", group="g")
    spec = JobCreate(name="bench", command=["sleep", "1"], gpus_per_node=1)
    limits = platform.settings.limits
    def items(k: str | None) -> list:  # one call's submissions (with a key each: k-0, k-1, ...)
        return [(spec, alice, None if k is None else f"{k}-{g}") for g in range(group)]

    if loop:  # the API writer's own call for a group, on an event loop (uvloop, as `hai server`)
        import uvloop

        from hai.api.jobs import SubmissionGroups

        async def write(k: str | None) -> list:
            return await SubmissionGroups._written(platform, items(k))
    else:
        async def write(k: str | None) -> list:  # (no await inside: the call as the worker thread makes it)
            return submissions.submit_group(sessions=platform.sessions, items=items(k), limits=limits)

    async def measured() -> float:
        for i in range(50):  # warm: compiled statements, connections
            await write(f"w{i}" if key else None)
        spent = 0.0
        calls = max(1, jobs // group)
        for i in range(calls):
            if i % max(1, 256 // group) == 0:
                with platform.sessions() as s:
                    queued_counts.fold(s)
            t = time.process_time()
            out = await write(f"k{i}" if key else None)
            spent += time.process_time() - t
            for answer in out:
                if isinstance(answer, Exception):
                    raise answer
                assert not answer.replayed
        await platform.close_loop()
        return spent / (calls * group)

    spent = uvloop.run(measured()) if loop else asyncio.run(measured())
    platform.close()
    return spent * 1e3


def run_side(backend: Path, args: argparse.Namespace, jobs: int, callgrind: Path | None = None) -> tuple[dict, str]:
    """One worker on ``backend``: its answer (checked to have measured that backend's code) and
    its standard error (valgrind's summary)."""
    env = dict(os.environ, PYTHONPATH=str(backend))
    cmd = [sys.executable, __file__, "--worker", "--jobs", str(jobs)] + (["--postgresql"] if args.postgresql else []) \
        + (["--key"] if args.key else []) + (["--loop"] if args.loop else []) + ["--group", str(args.group)]
    if callgrind is not None:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={callgrind}"] + cmd
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["measured"].startswith(str(backend)), (str(backend), answer["measured"])
    return answer, done.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--postgresql", action="store_true", help="HAI_TEST_DATABASE_URL instead of a SQLite file")
    ap.add_argument("--key", action="store_true", help="each submission with an Idempotency-Key (as `hai submit` sends)")
    ap.add_argument("--loop", action="store_true", help=(
        "with --postgresql: the API writer's call for one request in flight (SubmissionGroups._written) on "
        "an event loop, as `hai server` writes a submission"))
    ap.add_argument("--group", type=int, default=1, help=(
        "submissions the writer gets at once (SubmissionGroups: those that arrive while a group is written, "
        "as with 8 in flight); the figure is per submission"))
    ap.add_argument("--before", type=Path, help="another checkout's backend directory, measured alternately")
    ap.add_argument("--callgrind", action="store_true", help="instructions a submission (valgrind), not CPU time")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "submit_inprocess.json")
    args = ap.parse_args()
    if args.worker:
        cpu_ms = worker(args.jobs, args.postgresql, args.key, args.loop, args.group)
        print(json.dumps({"cpu_ms": cpu_ms, "measured": sys.modules["hai.services.jobs"].__file__}))
        return
    from api_load import loadavg, write_results
    sides = {"this": REPO / "backend"} | ({"before": args.before.resolve()} if args.before else {})
    if args.loop and not args.postgresql:
        ap.error("--loop writes on PostgreSQL's asyncio connections: add --postgresql")
    results: dict = {"jobs": args.jobs, "postgresql": args.postgresql, "key": args.key, "loop": args.loop, "group": args.group,
                     "load": loadavg(),
                     "sides": {name: str(path) for name, path in sides.items()}}
    if args.callgrind:
        with tempfile.TemporaryDirectory() as tmp:
            for name, backend in sides.items():
                counts = []
                for jobs in (args.jobs, 5 * args.jobs):
                    _, valgrind = run_side(backend, args, jobs, callgrind=Path(tmp) / f"{name}-{jobs}.out")
                    counts.append(int(re.search(r"Collected : (\d+)", valgrind).group(1)))
                per = (counts[1] - counts[0]) / (4 * args.jobs)
                results[name] = {"instructions_per_submission": round(per)}
                print(f"{name:>6}: {per / 1e6:.3f} M instructions a submission")
    else:
        per_side: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                answer, _ = run_side(sides[name], args, args.jobs)
                per_side[name].append(answer["cpu_ms"])
            print(f"round {r + 1}: " + ", ".join(f"{n} {per_side[n][-1]:.3f} ms" for n in sides), flush=True)
        for name, values in per_side.items():
            results[name] = {"cpu_ms_per_submission": values, "median": round(statistics.median(values), 3),
                             "min": round(min(values), 3)}
            print(f"{name:>6}: CPU a submission median {statistics.median(values):.3f} ms, min {min(values):.3f} ms")
    results["at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_results(args.out, results)


if __name__ == "__main__":
    main()
