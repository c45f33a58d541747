#!/usr/bin/env python
"""The API process's CPU for one agent heartbeat through the whole app (issue 12): the HTTP body
parsed and validated, middleware, the node credential, the service, the reply serialized.

    python benchmarks/agent_heartbeat_http.py --repeat 600                 # steady (reply cache) and full
    python benchmarks/agent_heartbeat_http.py --profile /tmp/hb.prof       # also cProfile the beats (/tmp/hb.prof.steady, .full)

A node of 8 GPUs holding two running 4-GPU jobs (the fan-in benchmark's node) heartbeats with
8 GPUs' metrics (figures changing every beat) and both attempts' status, echoing the digest
it holds: the steady state of every node every second. The app is called in this process as an
ASGI application (no socket, no HTTP client: what is measured is the server's side; uvicorn's
HTTP parsing is not included). PostgreSQL (a fresh database on HAI_BENCH_DATABASE_URL's /
HAI_TEST_DATABASE_URL's server, dropped afterwards) and Redis (HAI_BENCH_REDIS_URL /
HAI_TEST_REDIS_URL), as in production; ``steady``: the reply cache on; ``full``: off
(``HAI_AGENT__REPLY_CACHE_S=0``), every beat through the heartbeat service. The figure is
``time.process_time`` per heartbeat (median over batches of 50), which a busy host disturbs less
than wall time; the database's own CPU is not in it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))

from sqlalchemy import create_engine, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

GPUS = 8
BATCH = 50


async def call(app, path: str, body: bytes, token: str) -> tuple[int, bytes]:  # noqa: ANN001
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"authorization", f"Bearer {token}".encode()),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    out: list[dict] = []

    async def send(msg: dict) -> None:
        out.append(msg)

    await app(scope, receive, send)
    return out[0]["status"], b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body")


def metrics(rng: random.Random, busy: set[int]) -> list[dict]:
    return [{"index": g, "uuid": f"GPU-n0-{g}", "util_pct": round(rng.uniform(85, 100) if g in busy else 0.0, 1),
             "memory_used_mib": 30000 + rng.randrange(4000) if g in busy else 0, "memory_total_mib": 40960,
             "temperature_c": round(rng.uniform(55, 75) if g in busy else 35.0, 1),
             "power_w": round(rng.uniform(200, 250) if g in busy else 40.0, 1), "ecc_uncorrected": 0}
            for g in range(GPUS)]


def measure(mode: str, *, repeat: int, db_server: str, redis_url: str, profile: str | None) -> dict:
    from hai.db.models import Base
    from hai.main import create_app
    from hai.protocol import AgentHello, GpuInfo
    from hai.schemas.jobs import JobCreate
    from hai.services import auth
    from hai.services.context import Platform
    from hai.services.jobs import submit_job
    from hai.services.scheduling import run_cycle
    from hai.settings import Settings

    server_url = make_url(db_server)
    dbname = f"hai_hbhttp_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{dbname}"'))
    tmp = Path(tempfile.mkdtemp())
    settings = Settings(data_dir=tmp / "hai", frontend_dist=tmp / "none",
                        db={"url": server_url.set(database=dbname).render_as_string(hide_password=False)},
                        redis={"url": redis_url},
                        agent={"reply_cache_s": 10.0 if mode == "steady" else 0.0},
                        validation={"quick_every_heartbeats": 0})
    platform = Platform.from_settings(settings)
    try:
        Base.metadata.create_all(platform.engine)
        with platform.sessions() as s:
            agent_token = auth.create_agent_token(session=s)
            user, _ = auth.create_user(session=s, name="alice", group="g")
            alice = auth.Principal(kind="user", user_id=user.id, name="alice", group="g")
        app = create_app(platform)
        node = f"hb-{uuid.uuid4().hex[:6]}"
        hello = AgentHello(node=node, address="127.0.0.1", zone="A", leaf="A00", fake_gpus=True,
                           gpus=[GpuInfo(index=g, uuid=f"GPU-n0-{g}", model="A100", memory_total_mib=40960)
                                 for g in range(GPUS)])
        rng = random.Random(1)

        async def run() -> dict:
            status, _ = await call(app, "/api/v1/agent/register", hello.model_dump_json().encode(), agent_token)
            assert status == 200
            with platform.sessions() as s:
                for i in range(2):
                    submit_job(session=s, spec=JobCreate(name=f"j{i}", command=["sleep", "inf"], gpus_per_node=4),
                               user=alice)
            with platform.sessions() as s:
                run_cycle(s, settings=settings)
            digest, assignments = None, []

            def body() -> bytes:
                busy = {g for a in assignments for g in a["spec"]["gpus"]}
                return json.dumps({
                    "protocol_version": 1, "node": node, "gpus": metrics(rng, busy), "assignments_digest": digest,
                    "attempts": [{"job_id": a["job_id"], "attempt": a["attempt"], "started_at": 1.7e9,
                                  "ranks": [{"rank": 0, "local_rank": 0, "pid": 1000 + a["job_id"],
                                             "state": "running"}]} for a in assignments],
                    "validations": []}).encode()

            for _ in range(3):  # learn the assignments, then hold them (the cache keeps this one)
                status, out = await call(app, "/api/v1/agent/heartbeat", body(), agent_token)
                assert status == 200, out
                reply = json.loads(out)
                digest, assignments = reply["assignments_digest"], reply["assignments"]
            assert len(assignments) == 2 and all(a["action"] == "run" for a in assignments)
            bodies = [body() for _ in range(repeat)]  # built before the clock runs
            cache = getattr(app.state, "reply_cache", None)
            hits0 = cache.hits if cache is not None else 0
            prof = cProfile.Profile() if profile else None
            per: list[float] = []
            for i in range(0, repeat, BATCH):
                if prof:
                    prof.enable()
                t = time.process_time()
                for b in bodies[i:i + BATCH]:
                    status, out = await call(app, "/api/v1/agent/heartbeat", b, agent_token)
                    if status != 200:
                        raise SystemExit(out)
                per.append((time.process_time() - t) / len(bodies[i:i + BATCH]))
                if prof:
                    prof.disable()
            if prof:
                prof.dump_stats(profile)
            assert json.loads(out)["assignments_digest"] == digest
            if hasattr(cache, "close"):  # what the app's shutdown does (builds with batched liveness)
                cache.close()
            hits = (cache.hits - hits0) if cache is not None else 0
            return {"mode": mode, "heartbeats": repeat, "cache_hits": hits, "body_bytes": len(bodies[0]),
                    "reply_bytes": len(out), "cpu_ms_median": round(statistics.median(per) * 1e3, 3),
                    "cpu_ms_min": round(min(per) * 1e3, 3)}

        return asyncio.run(run())
    finally:
        platform.close()
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'))
        admin.dispose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["steady", "full"], choices=["steady", "full"])
    ap.add_argument("--repeat", type=int, default=600)
    ap.add_argument("--database-url", default=os.environ.get("HAI_BENCH_DATABASE_URL")
                    or os.environ.get("HAI_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"))
    ap.add_argument("--redis-url", default=os.environ.get("HAI_BENCH_REDIS_URL")
                    or os.environ.get("HAI_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--profile", default=None, help="cProfile the measured beats into this file (FILE.MODE with several modes)")
    args = ap.parse_args()
    rows = [measure(m, repeat=args.repeat, db_server=args.database_url, redis_url=args.redis_url,
                    profile=(args.profile if len(args.modes) == 1 else f"{args.profile}.{m}") if args.profile else None)
            for m in args.modes]
    print(json.dumps({"load_avg": [round(x, 2) for x in os.getloadavg()], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
