"""The server's work for one agent heartbeat: a node holding N running attempts, the agent's
digest current (the steady state of every node every heartbeat interval).

    python benchmarks/agent_heartbeat.py --attempts 8 64 --repeat 200 --json

Registers one node with N GPUs, starts N one-GPU jobs on it with the scheduler, reports them
running, then calls the heartbeat service ``--repeat`` times with the full report and the
current digest (SQLite in a temporary folder, like ``hai dev``; ``--db-url`` for PostgreSQL).
Prints, per N, the SQL statements per heartbeat (deterministic) and the median CPU time of the
process per heartbeat (``time.process_time``: less disturbed by a busy host than wall time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))

from sqlalchemy import event  # noqa: E402

from hai.db.models import Base  # noqa: E402
from hai.protocol import AgentHello, AttemptStatus, GpuInfo, Heartbeat, RankStatus  # noqa: E402
from hai.schemas.jobs import JobCreate  # noqa: E402
from hai.services import agents, auth  # noqa: E402
from hai.services.context import Platform  # noqa: E402
from hai.services.jobs import submit_job  # noqa: E402
from hai.services.scheduling import run_cycle  # noqa: E402
from hai.settings import Settings  # noqa: E402


def measure(n: int, repeat: int, db_url: str | None) -> dict:
    tmp = Path(tempfile.mkdtemp())
    kw = {"db": {"url": db_url}} if db_url else {}
    settings = Settings(data_dir=tmp / "hai", frontend_dist=tmp / "none", **kw)
    platform = Platform.from_settings(settings)
    Base.metadata.drop_all(platform.engine)
    Base.metadata.create_all(platform.engine)
    try:
        with platform.sessions() as s:
            _, secret = auth.create_user(session=s, name="alice", group="g")
        gpus = [GpuInfo(index=i, uuid=f"GPU-{i}", model="Fake", memory_total_mib=81920) for i in range(n)]
        with platform.sessions() as s:
            agents.register(session=s, hello=AgentHello(node="n0", address="127.0.0.1", gpus=gpus), settings=settings)
        with platform.sessions() as s:
            user = auth.authenticate(session=s, secret=secret)
            ids = [submit_job(session=s, spec=JobCreate(name=f"j{i}", command=["true"], gpus_per_node=1), user=user).id
                   for i in range(n)]
        with platform.sessions() as s:
            run_cycle(s, settings=settings)
        report = [AttemptStatus(job_id=j, attempt=1, ranks=[RankStatus(rank=0, local_rank=0, pid=1000 + j)]) for j in ids]
        with platform.sessions() as s:
            reply = agents.heartbeat(session=s, hb=Heartbeat(node="n0", attempts=report), settings=settings)
        assert len(reply.assignments) == n and all(a.action == "run" for a in reply.assignments)
        hb = Heartbeat(node="n0", attempts=report, assignments_digest=reply.assignments_digest)
        statements = 0

        def count(*_a, **_k):
            nonlocal statements
            statements += 1

        event.listen(platform.engine, "before_cursor_execute", count)
        cpu = []
        for _ in range(repeat):
            t = time.process_time()
            with platform.sessions() as s:
                again = agents.heartbeat(session=s, hb=hb, settings=settings)
            cpu.append(time.process_time() - t)
        assert again.assignments_digest == reply.assignments_digest
        return {"attempts": n, "sql_statements_per_heartbeat": statements / repeat,
                "cpu_median_ms": round(statistics.median(cpu) * 1e3, 2)}
    finally:
        platform.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attempts", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--db-url", default=None, help="a throwaway database (default: SQLite in a temp folder)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [measure(n, args.repeat, args.db_url) for n in args.attempts]
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['attempts']:4d} attempts: {r['sql_statements_per_heartbeat']:.1f} SQL statements, "
                  f"{r['cpu_median_ms']:.2f} ms CPU per heartbeat")


if __name__ == "__main__":
    main()
