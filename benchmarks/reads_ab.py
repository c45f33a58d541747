"""Reads of issue 12, two builds interleaved in the same minutes (before / after on a shared VM).

Two ``hai server --workers 2`` on one already-seeded PostgreSQL database (run
``api_load.py --reads-only`` once first: it seeds 100,000 jobs and 1,250 nodes and leaves them), one
with ``--before`` on its PYTHONPATH (another checkout's ``backend``), one with this checkout's. For
each read, ``--rounds`` rounds of ``--block`` requests to A then to B (the order alternates each
round), so both see the same load; p50/p99, each side's server CPU per request (user + system
of its processes, from /proc) and its database CPU per request (the PostgreSQL backends of its
connections, found by ``application_name``: the database must run on this machine). ``me``
(GET /api/v1/me) is the floor every authenticated request pays.

    HAI_TEST_DATABASE_URL=postgresql+psycopg://... HAI_TEST_REDIS_URL=redis://... \
      python benchmarks/reads_ab.py --before /path/to/other/checkout/backend [--rounds 10 --block 10]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from api_load import HAI, READS, REPO, Churn, Procs, children, cpu_s, free_port, loadavg, summarise, wait_for, write_results  # noqa: E402

from sqlalchemy import create_engine, text  # noqa: E402

from hai.services import auth  # noqa: E402
from hai.services.context import Platform  # noqa: E402
from hai.settings import Settings  # noqa: E402


def db_backends(url: str, side: str) -> list[int]:
    """The process ids of the PostgreSQL backends serving this side's connections."""
    eng = create_engine(url)
    try:
        with eng.connect() as c:
            return list(c.execute(text("SELECT pid FROM pg_stat_activity WHERE application_name = :a"),
                                  {"a": f"hai-reads-ab-{side}"}).scalars())
    finally:
        eng.dispose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the 'before' build's backend directory")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--only", nargs="+", help="read names (api_load.READS) to run; default all but the heavy ones")
    ap.add_argument("--churn", type=float, default=0.0, help="node list changes a second while reading (api_load.Churn)")
    ap.add_argument("--after-env", nargs="*", default=[], metavar="NAME=VALUE",
                    help="settings of the 'after' server only (e.g. HAI_HTTP__NODE_LIST_MAX_AGE_S=0)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "reads_ab.json")
    args = ap.parse_args()
    url, redis_url = os.environ["HAI_TEST_DATABASE_URL"], os.environ.get("HAI_TEST_REDIS_URL", "")
    procs = Procs()
    results: dict = {"load_before": loadavg(), "before": str(args.before), "after": str(REPO / "backend")}
    with tempfile.TemporaryDirectory(prefix="hai-reads-ab-") as tmp:
        work = Path(tmp)
        settings = Settings(data_dir=work, db={"url": url}, redis={"url": redis_url})
        platform = Platform.from_settings(settings)
        try:
            with platform.sessions() as s:
                _, token = auth.create_user(session=s, name=f"ab{os.getpid()}", group="bench")
                s.commit()
                n_jobs = s.execute(text("SELECT max(id) FROM jobs")).scalar_one()
        finally:
            platform.close()
        servers = {}
        churn = Churn(url, args.churn)
        try:
            for side, backend in (("before", args.before), ("after", REPO / "backend")):
                port = free_port()
                env = dict(os.environ, HAI_DB__URL=url, HAI_REDIS__URL=redis_url, HAI_DATA_DIR=str(work / side),
                           PYTHONPATH=str(backend), PGAPPNAME=f"hai-reads-ab-{side}")  # libpq's application_name
                if side == "after":
                    env.update(kv.split("=", 1) for kv in args.after_env)
                p = procs.start(HAI + ["server", "--port", str(port), "--workers", "2"], env=env,
                                log=work / f"{side}.log")
                base = f"http://127.0.0.1:{port}"
                wait_for(lambda base=base: httpx.get(base + "/healthz", timeout=2).status_code == 200, 300, side)
                servers[side] = (p, httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"},
                                                 timeout=120))
            pids = {side: [p.pid] + children(p.pid) for side, (p, _) in servers.items()}
            results["churn_per_s"], results["after_env"] = args.churn, args.after_env
            churn.__enter__()
            names = args.only or ["me"] + [n for n, _ in READS if n != "nodes_gpu_metrics"]
            for name, path in [("me", "/api/v1/me")] + READS:
                if name not in names:
                    continue
                path = path.format(keyset=n_jobs - 5000 + 1)
                lat: dict[str, list[float]] = {"before": [], "after": []}
                cpu = {"before": 0.0, "after": 0.0}
                db_cpu = {"before": 0.0, "after": 0.0}
                body = {}
                for side, (_, c) in servers.items():  # warm both
                    for _ in range(3):
                        r = c.get(path)
                        r.raise_for_status()
                    body[side] = r.content
                for rnd in range(args.rounds):
                    order = ("before", "after") if rnd % 2 == 0 else ("after", "before")
                    for side in order:
                        c = servers[side][1]
                        backends = db_backends(url, side)
                        c0, d0 = cpu_s(pids[side]), cpu_s(backends)
                        for _ in range(args.block):
                            s = time.perf_counter()
                            c.get(path).raise_for_status()
                            lat[side].append(time.perf_counter() - s)
                        cpu[side] += cpu_s(pids[side]) - c0
                        db_cpu[side] += cpu_s(backends) - d0
                out = results[name] = {}
                for side in ("before", "after"):
                    r = out[side] = summarise(lat[side], sum(lat[side]))
                    r["server_cpu_ms"] = round(cpu[side] * 1000 / len(lat[side]), 1)
                    r["db_cpu_ms"] = round(db_cpu[side] * 1000 / len(lat[side]), 1)
                    r["bytes"] = len(body[side])
                # (under churn the two were read at different moments of a changing cluster)
                out["same_json"] = json.loads(body["before"]) == json.loads(body["after"]) if not args.churn else None
                b, a = out["before"], out["after"]
                print(f"  {name:22s} before p50 {b['p50_ms']:6.1f} p99 {b['p99_ms']:6.1f} cpu {b['server_cpu_ms']:5.1f}"
                      f" db {b['db_cpu_ms']:5.1f} | after p50 {a['p50_ms']:6.1f} p99 {a['p99_ms']:6.1f} cpu "
                      f"{a['server_cpu_ms']:5.1f} db {a['db_cpu_ms']:5.1f}"
                      f"  same JSON {out['same_json']}  load {loadavg()}", flush=True)
        finally:
            churn.__exit__(None, None, None)
            results["churn_done"] = {"list_changes": churn.changes, "figure_writes": churn.figure_writes}
            for _, c in servers.values():
                c.close()
            procs.stop()
    write_results(args.out, results)


if __name__ == "__main__":
    main()
