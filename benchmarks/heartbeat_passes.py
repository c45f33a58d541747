"""What a full heartbeat pass costs the API process, by what the heartbeat carries (issue 12, fan-in).

Heartbeats that the reply cache cannot answer go through ``services.agents.heartbeat``: the Core
pass (``_quiet_heartbeat``) when they change nothing but liveness, ask for a quick validation
round, or deliver validation runs that passed; the ORM pass otherwise. This drives the same
cluster twice on PostgreSQL, in two fresh databases, round by round alternately: once as the
server does and once with the Core pass turned off (every heartbeat the ORM way). Every node
holds a running 1-node job and reports it; quick rounds fall due every ``--every`` heartbeats and
each node answers its run in its next heartbeat with a passing report of ``--checks`` checks.

Per kind of heartbeat (``steady``: nothing but liveness; ``asks``: a quick round falls due;
``results``: delivers a passed run) and per side, the CPU time of this process (the server's share:
SQLAlchemy, psycopg, the protocol models; PostgreSQL's own CPU is not in it) and the wall time,
median and mean. The replies of the two sides must be equal, heartbeat by heartbeat.

    HAI_BENCH_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test \
      python benchmarks/heartbeat_passes.py [--nodes 40] [--rounds 30] [--every 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))

from metrics_ingest import _fresh_db  # noqa: E402  (a database of its own, dropped after)

from hai.schemas.jobs import JobCreate  # noqa: E402
from hai.db.migrate import upgrade  # noqa: E402
from hai.protocol import AgentHello, AttemptStatus, GpuInfo, GpuMetrics, Heartbeat, RankStatus  # noqa: E402
from hai.services import agents, auth  # noqa: E402
from hai.services import jobs as job_service  # noqa: E402
from hai.services.context import Platform  # noqa: E402
from hai.services.scheduling import run_cycle  # noqa: E402
from hai.settings import Settings  # noqa: E402


def report(run: dict, checks: int) -> dict:
    return {"run_id": run["run_id"], "level": run["level"], "started_at": 1.0, "finished_at": 2.0,
            "checks": [{"name": f"check_{k}", "level": run["level"], "critical": k == 0, "status": "passed",
                        "value": 8, "threshold": 8, "unit": "GPUs", "detail": "as registered", "duration_s": 0.1,
                        "data": {"k": k}} for k in range(checks)]}


def setup(url: str, tmp: Path, nodes: int, every: int) -> tuple[Platform, dict[str, tuple[int, int]]]:
    upgrade(url)
    p = Platform.from_settings(Settings(data_dir=tmp, frontend_dist=tmp / "none", db={"url": url},
                                        validation={"quick_every_heartbeats": every}))
    names = [f"n{i:04d}" for i in range(nodes)]
    with p.sessions() as s:
        for n in names:
            agents.register(session=s, settings=p.settings, hello=AgentHello(
                node=n, zone="A", leaf="L1", address="127.0.0.1", fake_gpus=True,
                gpus=[GpuInfo(index=i, uuid=f"GPU-{n}-{i}", model="Fake", memory_total_mib=1) for i in range(8)]))
        user, _ = auth.create_user(session=s, name="bench", group="g")
        who = auth.Principal(kind="user", user_id=user.id, name="bench", group="g")
        for i in range(nodes):
            job_service.submit_job(session=s, user=who, spec=JobCreate(name=f"j{i}", command=["true"], nodes=1,
                                                                         gpus_per_node=8))
    with p.sessions() as s:
        assert len(run_cycle(s, settings=p.settings).started) == nodes
    from sqlalchemy import select

    from hai.db.models import JobAllocation

    with p.sessions() as s:
        held = {a.node_name: (a.job_id, a.attempt) for a in s.scalars(select(JobAllocation))}
    return p, held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--every", type=int, default=5, help="a quick round every N heartbeats of a node")
    ap.add_argument("--checks", type=int, default=6, help="checks in each passing report")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    base = os.environ.get("HAI_BENCH_DATABASE_URL") or os.environ.get("HAI_TEST_DATABASE_URL") \
        or "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    real = agents._quiet_heartbeat
    sides = {"core": real, "orm": lambda *a, **kw: None}
    dbs = {side: _fresh_db(base) for side in sides}
    out: dict = {"nodes": args.nodes, "rounds": args.rounds, "every": args.every, "checks": args.checks,
                 "load_before": os.getloadavg()}
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            plat = {side: setup(dbs[side][0], Path(tmp) / side, args.nodes, args.every) for side in sides}
            held = plat["core"][1]
            assert held == plat["orm"][1]
            state = {side: {n: (None, []) for n in held} for side in sides}  # node -> (digest, runs asked)
            for r in range(args.rounds):
                replies: dict[str, list] = {}
                for side in (("core", "orm") if r % 2 else ("orm", "core")):
                    p = plat[side][0]
                    agents._quiet_heartbeat = sides[side]
                    try:
                        for n, (job_id, attempt) in held.items():
                            dig, asked = state[side][n]
                            hb = Heartbeat(node=n, assignments_digest=dig, validations=[report(v, args.checks) for v in asked],
                                           attempts=[AttemptStatus(job_id=job_id, attempt=attempt,
                                                                   ranks=[RankStatus(rank=0, local_rank=0, pid=7)])],
                                           gpus=[GpuMetrics(index=g, uuid=f"GPU-{n}-{g}", util_pct=50.0) for g in range(8)])
                            c0, t0 = time.process_time(), time.perf_counter()
                            with p.sessions() as s:
                                reply = agents.heartbeat(session=s, hb=hb, settings=p.settings)
                            t1, c1 = time.perf_counter(), time.process_time()
                            kind = "results" if asked else ("asks" if reply.validations else "steady")
                            if r >= 2:  # the first rounds store each attempt's first report
                                times.setdefault((kind, side), []).append((c1 - c0, t1 - t0))
                            state[side][n] = (reply.assignments_digest,
                                              [v.model_dump(mode="json") for v in reply.validations])
                            replies.setdefault(side, []).append(
                                reply.model_dump(mode="json", exclude={"validations": {"__all__": {"run_id"}}}))
                    finally:
                        agents._quiet_heartbeat = real
                assert replies["core"] == replies["orm"], f"round {r}: the replies differ"
            for p, _ in plat.values():
                p.close()
    finally:
        for _, drop in dbs.values():
            drop()
    out["load_after"] = os.getloadavg()
    res: dict = {}
    for (kind, side), xs in sorted(times.items()):
        cpu, wall = [x[0] * 1000 for x in xs], [x[1] * 1000 for x in xs]
        res.setdefault(kind, {})[side] = {"n": len(xs), "cpu_ms_p50": round(statistics.median(cpu), 3),
                                          "cpu_ms_mean": round(statistics.fmean(cpu), 3),
                                          "wall_ms_p50": round(statistics.median(wall), 3)}
    out["kinds"] = res
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
