"""The floor of a submission in this stack, against slurmrestd in the same run (issue 12).

How fast can *any* Python service on uvicorn and PostgreSQL take durable submissions on this
machine, with the same client as ``api_load.py`` on the same cores? The floor service is the least
such a service can do, and none of what the platform does besides:

- uvicorn with as many workers as cores, httptools and uvloop (as ``hai server``), no access log;
- a bare ASGI callable (no framework, no middleware): the method and path compared, the bearer
  token looked up in a dict, the JSON body parsed and its ``command`` checked;
- one ``INSERT ... RETURNING`` of the job's row (user, name, the spec as JSONB, state) on a
  psycopg ``AsyncConnection`` of the worker (autocommit: one durable commit a request, as a
  submission is), awaited on the event loop (no worker thread);
- a 201 with ``{"id": ..., "state": "queued"}``.

No scheduler, no admission check, no limits, no idempotency, no wake-up, no validation beyond the
command. Its jobs/s is an upper bound for the platform's: if the floor is short of twice
slurmrestd at some concurrency, so is every service of this kind on this machine. Slurm runs
first and again after the floor (the ratios are to the mean of its two runs, as in api_load.py).

    python benchmarks/submit_floor.py [--jobs 2000] [--out benchmarks/results/submit_floor.json]

PostgreSQL: HAI_TEST_DATABASE_URL (a database of your own: the table ``floor_jobs`` is dropped
and re-created there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TOKEN = "floor-token"
TABLE = """DROP TABLE IF EXISTS floor_jobs;
CREATE TABLE floor_jobs (id bigserial PRIMARY KEY, user_id integer NOT NULL, name text NOT NULL,
    spec jsonb NOT NULL, state text NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"""
INSERT = ("INSERT INTO floor_jobs (user_id, name, spec, state) VALUES (%s, %s, %s, 'queued') "
          "RETURNING id")
CONNECTIONS = 8  # a worker's connections: the most requests in flight at once


def _libpq_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


class Floor:
    """The ASGI application of one uvicorn worker (``uvicorn submit_floor:app --factory``)."""

    def __init__(self) -> None:
        self.url = _libpq_url(os.environ["HAI_FLOOR_DATABASE_URL"])
        self.users = {TOKEN: 1}
        self.free: asyncio.Queue | None = None

    async def _connections(self) -> asyncio.Queue:
        import psycopg

        if self.free is None:
            free: asyncio.Queue = asyncio.Queue()
            for _ in range(CONNECTIONS):
                free.put_nowait(await psycopg.AsyncConnection.connect(self.url, autocommit=True,
                                                                      prepare_threshold=0))
            self.free = free
        return self.free

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        status, answer = await self._answer(scope, receive)
        body = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _answer(self, scope, receive) -> tuple[int, dict]:  # noqa: ANN001
        if scope["method"] == "GET" and scope["path"] == "/healthz":
            return 200, {"status": "ok"}
        if scope["method"] != "POST" or scope["path"] != "/api/v1/jobs":
            return 404, {"detail": "not found"}
        auth = dict(scope["headers"]).get(b"authorization", b"")
        user = self.users.get(auth[7:].decode("latin-1")) if auth[:7].lower() == b"bearer " else None
        if user is None:
            return 401, {"detail": "not authenticated"}
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        try:
            spec = json.loads(b"".join(chunks))
        except ValueError:
            return 422, {"detail": "the body is not JSON"}
        if not isinstance(spec, dict) or not isinstance(spec.get("command"), list) or not spec["command"]:
            return 422, {"detail": "command: a non-empty list"}
        free = await self._connections()
        conn = await free.get()
        try:
            from psycopg.types.json import Jsonb

            cur = await conn.execute(INSERT, (user, str(spec.get("name", "job")), Jsonb(spec)))
            (job_id,) = await cur.fetchone()
        finally:
            free.put_nowait(conn)
        return 201, {"id": job_id, "state": "queued"}


def app() -> Floor:
    return Floor()


def floor_case(n: int) -> dict:
    import httpx
    import psycopg
    from api_load import (BODY, CORES, Procs, cpu_s, free_port, pg_urls, post_load, postgresql_cpu_s, wait_for,
                          wait_quiet)

    url, _redis = pg_urls()
    with psycopg.connect(_libpq_url(url), autocommit=True) as conn:
        for statement in TABLE.split(";"):
            conn.execute(statement)
    procs = Procs()
    out: dict = {"workers": CORES}
    with tempfile.TemporaryDirectory(prefix="hai-floor-") as tmp:
        try:
            port = free_port()
            env = dict(os.environ, HAI_FLOOR_DATABASE_URL=url,
                       PYTHONPATH=str(Path(__file__).resolve().parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            server = procs.start([sys.executable, "-m", "uvicorn", "submit_floor:app", "--factory", "--port", str(port),
                                  "--workers", str(CORES), "--no-access-log", "--log-level", "warning",
                                  "--http", "httptools", "--loop", "uvloop"], env=env, log=Path(tmp) / "floor.log")
            base = f"http://127.0.0.1:{port}"
            wait_for(lambda: httpx.get(base + "/healthz", timeout=2).status_code == 200, 120, "the floor service")

            def client() -> httpx.Client:
                return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)

            post_load(client, "/api/v1/jobs", BODY, 200, 8)  # warm-up: every worker's connections
            serving = [server.pid] + [int(c) for c in
                                      Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()]
            for in_flight in (1, 8):
                quiet = wait_quiet()
                c0, pg0 = cpu_s(serving), postgresql_cpu_s()
                out[f"in_flight_{in_flight}"] = r = post_load(client, "/api/v1/jobs", BODY, n, in_flight)
                r["server_cpu_ms_per_job"] = round((cpu_s(serving) - c0) * 1000 / n, 3)
                r["postgresql_cpu_ms_per_job"] = round((postgresql_cpu_s() - pg0) * 1000 / n, 3)
                r["quiet_before"] = quiet
                print(f"  floor      in_flight={in_flight}: {r['jobs_per_s']:7.1f} jobs/s p50 {r['p50_ms']:6.1f} ms "
                      f"p99 {r['p99_ms']:7.1f} ms  failed {r['failed']}  CPU/job: server {r['server_cpu_ms_per_job']} "
                      f"ms, PostgreSQL {r['postgresql_cpu_ms_per_job']} ms, client {r['client_cpu_ms_per_job']} ms"
                      f"  load {r['load']}", flush=True)
            with psycopg.connect(_libpq_url(url), autocommit=True) as conn:
                out["rows"] = conn.execute("SELECT count(*) FROM floor_jobs").fetchone()[0]
        finally:
            procs.stop()
    return out


def main() -> None:
    from api_load import REPO, loadavg, slurm_case, slurm_installed, slurm_mean, write_results

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=2000, help="submissions per case")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "submit_floor.json")
    args = ap.parse_args()
    print(f"submit_floor: {args.jobs} submissions per case, load {loadavg()}", flush=True)
    results: dict = {"jobs_per_case": args.jobs, "load_before": loadavg()}
    if not slurm_installed():
        raise SystemExit("Slurm is not installed (apt-get install slurm-wlm slurmrestd munge): no peer to compare")
    results["slurm"] = slurm_case(args.jobs)
    results["floor"] = floor_case(args.jobs)
    print("  slurm      again, after the floor:", flush=True)
    results["slurm_again"] = slurm_case(args.jobs)
    mean = slurm_mean(results["slurm"], results["slurm_again"])
    results["ratio_to_slurmrestd"] = ratios = {}
    for c in (1, 8):
        ratios[f"floor_c{c}"] = round(results["floor"][f"in_flight_{c}"]["jobs_per_s"]
                                      / mean[f"slurmrestd_in_flight_{c}"]["jobs_per_s"], 2)
        print(f"  ratio to slurmrestd (same in-flight; the mean of its two runs) floor_c{c}: {ratios[f'floor_c{c}']:.2f}x")
    write_results(args.out, results)


if __name__ == "__main__":
    main()
