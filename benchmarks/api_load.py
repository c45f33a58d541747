"""Submissions and reads through the REST API, against Slurm in the same run (issue 12).

Submissions: POST /api/v1/jobs of 1-GPU ``sleep`` jobs with httpx (keep-alive), 1 and 8 requests in
flight, against
  - the production layout: PostgreSQL, Redis, ``hai server --workers <cores>``, a separate
    ``hai scheduler`` and 4 fake-GPU agents (``hai agent --fake-gpus 8``), and
  - ``hai dev --agents 4`` (embedded SQLite, scheduler thread in the server process),
and, with ``--only ... pgbouncer``, the production layout with the API processes through PgBouncer
in transaction mode (``benchmarks/pgbouncer.py``, 8 server connections;
``HAI_DB__PREPARED_STATEMENTS=false``) and the scheduler connected directly, its CPU reported too;
each with 0 and 10,000 jobs already queued (inserted before the processes start). When Slurm is
installed (Debian's slurm-wlm, slurmrestd, munge) the same run starts a private Slurm: its own
munge key and socket, slurmctld on 127.0.0.1 with 1,250 configured nodes of 8 GPUs, slurmrestd on a
unix socket in a temporary directory; jobs are submitted held (``--hold``) through ``sbatch`` (one
submitter) and through slurmrestd with 1 and 8 in flight, once before the platform's cases and
once after them (the ratios are to the mean of the two: a shared VM's speed moves from minute to
minute). Each timed case waits first (up to 60 s) until the cores are quiet (under 25% busy
for two seconds: the previous case's work done). Only the processes this script started are
stopped, by their process ids. Every case
reports the CPU a job of each process on the cores: the platform's server, scheduler and
PostgreSQL, Slurm's daemons, and the benchmark's own client.

Before the first case of a layout the run waits until a cycle has considered a probe job (the
scheduler past its first cycles over the seeded queue: ``settled_s``); after each case it reports
how long after the last submission a cycle considered it (``last_considered_after_s``: does the
scheduler keep up, issue 12's "within 1 s").

Reads (``--reads``): 100,000 jobs in the table and 1,250 nodes on PostgreSQL (VACUUM ANALYZE after the
bulk insert, as autovacuum leaves a settled table), ``hai server --workers <cores>`` alone; GET /api/v1/jobs (no filter, by state, by user, both; 50 a page, first page and a
deep page by offset and by keyset; the exact count asked for) and GET /api/v1/nodes (and with every
GPU's figures, ``include=gpu_metrics``), p50/p99 and the server's CPU per request; with
``--churn RATE`` while the node list changes RATE times a second and every node's heartbeat
figures are written every second (``Churn``).

    python benchmarks/api_load.py [--jobs 1000] [--queued 0 10000] [--only postgresql pgbouncer sqlite slurm]
                                  [--reads] [--churn RATE] [--profile DIR] [--out benchmarks/results/api_load.json]
    python benchmarks/api_load.py --rounds 3 [...]   # Slurm and the platform alternated 3 times: the median ratio

PostgreSQL: HAI_TEST_DATABASE_URL (its schema is dropped and re-created: use a database of your
own); Redis: HAI_TEST_REDIS_URL.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backend"))

import httpx  # noqa: E402
from sqlalchemy import create_engine, insert, select, text  # noqa: E402

from hai.db.base import utcnow  # noqa: E402
from hai.db.migrate import upgrade  # noqa: E402
from hai.db.models import GpuHold, Job, JobAllocation, Node  # noqa: E402
from hai.services import auth  # noqa: E402
from hai.services.context import Platform  # noqa: E402
from hai.settings import Settings  # noqa: E402

HAI = [sys.executable, "-m", "hai.cli.main"]
BODY = {"name": "bench", "command": ["sleep", "3600"], "nodes": 1, "gpus_per_node": 1}
CORES = os.cpu_count() or 1


def free_port() -> int:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def wait_quiet(busy_below: float = 0.25, max_s: float = 60.0) -> dict:
    """Wait until the machine's cores are busy less than ``busy_below`` of the time for two
    seconds running (the previous case's processes gone, PostgreSQL's checkpoint and autovacuum
    after a bulk insert done), at most ``max_s``. A case that starts beside leftover work has its
    CPU a job inflated (Slurm's daemons measured 1.3 and 3.7 ms a job in two runs of one evening
    without it). Returns how long it waited and the last second's busy share."""
    t0, quiet, share = time.perf_counter(), 0, 1.0
    b0, n0 = _cpu_times()
    while time.perf_counter() - t0 < max_s:
        time.sleep(1.0)
        b1, n1 = _cpu_times()
        share = (b1 - b0) / max(1, n1 - n0)
        b0, n0 = b1, n1
        quiet = quiet + 1 if share < busy_below else 0
        if quiet >= 2:
            break
    return {"waited_s": round(time.perf_counter() - t0, 1), "busy_share": round(share, 2)}


def wait_for(pred, timeout: float, what: str, interval: float = 0.2, procs: Procs | None = None):  # noqa: ANN001, ANN201
    """Poll ``pred`` until it holds. ``procs``: stop at once, with the log's last lines, when one of
    the processes it started has exited (a server that refused its settings is not waited for)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if procs is not None:
            procs.check(what)
        try:
            value = pred()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - the process is still starting
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what} (last error: {last!r})")


class Procs:
    """The processes this script started; each leads its own process group (its children with it)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[int, Path | None] = {}  # pid of a watched process -> the log it writes
        self.stops: list = []  # other things to stop after the processes (a PgBouncer), last first

    def start(self, cmd: list[str], *, env: dict | None = None, log: Path | None = None,
              watched: bool = True) -> subprocess.Popen:
        """``watched``: ``check`` fails when it has exited (not for a profiler, stopped mid-run)."""
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             cwd=str(REPO))
        self.procs.append(p)
        if watched:
            self.logs[p.pid] = log
        return p

    def check(self, what: str) -> None:
        """Raise when a process started here has exited, with the last lines of its log."""
        for p in self.procs:
            if p.pid in self.logs and p.poll() is not None:
                log = self.logs[p.pid]
                tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log and log.exists() else []
                raise RuntimeError(f"waiting for {what}: {' '.join(map(str, p.args[-4:]))!r} exited with code "
                                   f"{p.returncode}" + (":\n  " + "\n  ".join(tail) if tail else ""))

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in reversed(self.procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        self.procs.clear()
        while self.stops:
            self.stops.pop()()


# -- load --------------------------------------------------------------------------------------
def post_load(make_client, path: str, body: dict, n: int, in_flight: int, ok=(200, 201),  # noqa: ANN001
              per_request: int = 1) -> dict:
    """``n`` POSTs of ``body`` with ``in_flight`` threads, each its own keep-alive client;
    ``per_request``: the jobs each POST submits (a batch, a job array)."""
    lat: list[float] = []
    lock = threading.Lock()
    counter = iter(range(n))
    errors: list[str] = []

    def worker() -> None:
        with make_client() as c:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                t0 = time.perf_counter()
                try:
                    r = c.post(path, json=body)
                    if r.status_code not in ok:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:  # a reset connection: counted, the client reconnects
                    errors.append(repr(exc))
                dt = time.perf_counter() - t0
                with lock:
                    lat.append(dt)

    threads = [threading.Thread(target=worker) for _ in range(in_flight)]
    t0, cpu0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    out = summarise(lat, wall)
    # the benchmark's own client (httpx in threads) shares the cores with what it measures
    out["client_cpu_ms_per_job"] = round(cpu * 1000 / max(1, len(lat) * per_request), 2)
    out["failed"] = len(errors)  # counted in the latencies, not in jobs/s
    out["jobs_per_s"] = round((len(lat) - len(errors)) * per_request / wall, 1)
    if per_request > 1:
        out["requests_per_s"] = round(len(lat) / wall, 1)
        out["jobs_per_request"] = per_request
    if errors:
        out["first_error"] = errors[0]
    return out


def summarise(lat: list[float], wall: float) -> dict:
    lat = sorted(lat)
    q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else lat * 99
    return {"n": len(lat), "jobs_per_s": round(len(lat) / wall, 1), "p50_ms": round(q[49] * 1000, 1),
            "p99_ms": round(q[98] * 1000, 1), "max_ms": round(lat[-1] * 1000, 1), "wall_s": round(wall, 2),
            "load": loadavg()}


def get_load(client: httpx.Client, path: str, n: int) -> dict:
    client.get(path).raise_for_status()  # warm
    lat = []
    t0 = time.perf_counter()
    for _ in range(n):
        s = time.perf_counter()
        r = client.get(path)
        lat.append(time.perf_counter() - s)
        r.raise_for_status()
    out = summarise(lat, time.perf_counter() - t0)
    out["bytes"] = len(r.content)
    return out


# -- seeding -----------------------------------------------------------------------------------
def reset_postgres(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()


def seed_users(settings: Settings) -> tuple[str, str, list[tuple[int, str]]]:
    """(user token, agent token, [(user id, name)])."""
    upgrade(settings.database_url)
    platform = Platform.from_settings(settings)
    try:
        with platform.sessions() as s:
            user, token = auth.create_user(session=s, name="bench", group="bench")
            others = [auth.create_user(session=s, name=f"user{i}", group=f"group{i % 5}")[0] for i in range(20)]
            agent = auth.create_agent_token(session=s)
            return token, agent, [(user.id, user.name)] + [(u.id, u.name) for u in others]
    finally:
        platform.close()


def seed_jobs(url: str, users: list[tuple[int, str]], n: int, *, states: list[str] | None = None,
              nodes: list[str] | None = None, seed: int = 12, gpus: int = 1, prefix: str = "pre") -> None:
    """``n`` jobs of ``gpus`` GPUs on one node inserted in bulk, named ``<prefix>-<i>`` (states
    cycle through ``states``; default all queued), one 'submitted' event each, and for every job
    that started a second event and an allocation on one of ``nodes`` (with its held GPUs'
    rows, ``gpu_holds``, while it holds them)."""
    if n <= 0:
        return
    rng = random.Random(seed)
    now = utcnow()
    states = states or ["queued"]
    engine = create_engine(url)
    rows = []
    for i in range(n):
        uid, uname = users[i % len(users)]
        state = states[i % len(states)]
        created = now - timedelta(seconds=n - i)
        started = created + timedelta(seconds=1) if state != "queued" else None
        rows.append(dict(
            name=f"{prefix}-{i}", user_id=uid, user_name=uname, group="bench", command=["sleep", "3600"], env={},
            tags=[], job_type="command", nodes=1, gpus_per_node=gpus,
            priority=rng.choice(["LOW", "NORMAL", "NORMAL", "HIGH"]),
            submitted_priority="NORMAL", allow_cross_zone=False, suspend_grace_s=60.0, state=state, created_at=created,
            queued_at=created, started_at=started, attempt_started_at=started, attempt=1 if started else 0,
            finished_at=started + timedelta(seconds=60) if state in ("succeeded", "failed", "cancelled") else None,
            pending_reason="waiting for the scheduler" if state == "queued" else None, reserved_nodes=[],
            desired_action="run", user_suspended=False, suspensions=0, restarts=0, lost_gpu_s=0.0, run_s=0.0,
        ))
    mine = {"p": f"{prefix}-%"}
    with engine.begin() as conn:
        for k in range(0, n, 5000):
            conn.execute(insert(Job), rows[k:k + 5000])
        conn.execute(text(
            "INSERT INTO job_events (job_id, at, from_state, to_state, reason) "
            "SELECT id, created_at, NULL, 'queued', 'submitted' FROM jobs WHERE name LIKE :p"), mine)
        conn.execute(text(
            "INSERT INTO job_events (job_id, at, from_state, to_state, reason) "
            "SELECT id, started_at, 'queued', 'starting', 'placed' FROM jobs "
            "WHERE started_at IS NOT NULL AND name LIKE :p"), mine)
        if nodes:
            # the jobs that hold GPUs now spread over every node, no GPU twice (the k-th of them:
            # node k mod n, the (k div n)-th group of ``gpus`` GPUs of its 8; 10,000 running jobs
            # of 1 GPU fill 1,250 nodes of 8); the finished ones likewise, among themselves
            per = 8 // gpus
            seen = {True: 0, False: 0}
            allocs = []
            for jid, state, started in conn.execute(select(Job.id, Job.state, Job.started_at).where(
                    Job.started_at.is_not(None), Job.name.like(mine["p"])).order_by(Job.id)):
                holds = state in ("running", "starting")
                rn = seen[holds]
                seen[holds] += 1
                first = (rn // len(nodes)) % per * gpus
                allocs.append(dict(job_id=jid, attempt=1, node_name=nodes[rn % len(nodes)], node_rank=0,
                                   gpus=list(range(first, first + gpus)), active=holds, created_at=started))
            for k in range(0, len(allocs), 5000):
                chunk = allocs[k:k + 5000]
                ids = conn.execute(insert(JobAllocation).returning(JobAllocation.id, sort_by_parameter_order=True),
                                   chunk).scalars().all()
                held = [dict(allocation_id=aid, node_name=a["node_name"], gpu=g)
                        for aid, a in zip(ids, chunk) if a["active"] for g in a["gpus"]]
                if held:
                    conn.execute(insert(GpuHold), held)
        # the planner's statistics for what was just loaded, as autovacuum would gather them within
        # a minute or so: a run's first cycles must not depend on whether it has yet (one run's
        # first write of 100,000 pending reasons ran for minutes, the next run's in 1.4 s)
        conn.execute(text("ANALYZE jobs"))
        conn.execute(text("ANALYZE job_allocations"))
    engine.dispose()


def seed_nodes(settings: Settings, n: int) -> list[str]:
    rng = random.Random(7)
    now = utcnow()
    platform = Platform.from_settings(settings)
    names = []
    with platform.sessions() as s:
        for i in range(n):
            zone = "A" if i < n // 2 else "B"
            name = f"node-{i + 1:04d}"
            names.append(name)
            s.add(Node(
                name=name, zone=zone, leaf=f"{zone}-leaf{(i % (n // 2)) // 20 + 1:02d}", gpus=8, state="ready",
                last_heartbeat_at=now, fake_gpus=True,
                gpu_inventory=[{"index": g, "uuid": f"G{i}-{g}", "model": "A100", "memory_total_mib": 40960}
                               for g in range(8)],
                gpu_metrics=[{"index": g, "uuid": f"G{i}-{g}", "util_pct": round(rng.uniform(0, 100), 1),
                              "memory_used_mib": 1000, "memory_total_mib": 40960, "temperature_c": 50.0,
                              "power_w": 200.0} for g in range(8)],
            ))
        s.commit()
    platform.close()
    return names


# -- the two layouts ---------------------------------------------------------------------------
PROFILE_RATE = 50  # samples a second (--profile-rate)


def profile_pids(pids: list[int], out: Path, procs: Procs, name: str) -> list[subprocess.Popen]:
    """py-spy record each pid until stop_profiles (SIGINT: py-spy writes its file then); ``--gil``:
    only samples holding the interpreter, i.e. where the CPU goes, not where threads wait."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return [procs.start([spy, "record", "--pid", str(pid), "--rate", str(PROFILE_RATE), "--gil", "--format", "speedscope",
                         "-o", str(out / f"{name}-{pid}.speedscope.json"), "--nonblocking"],
                        log=out / f"{name}-{pid}.log", watched=False) for pid in pids]


def stop_profiles(spies: list[subprocess.Popen]) -> None:
    for p in spies:
        p.send_signal(signal.SIGINT)
    for p in spies:
        p.wait(timeout=60)


def is_agent(pid: int) -> bool:
    try:
        return b"agent" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def pg_urls() -> tuple[str, str]:
    """(PostgreSQL URL, Redis URL) of the production layout's cases, or a clear exit."""
    url = os.environ.get("HAI_TEST_DATABASE_URL", "")
    if not url.startswith("postgresql"):
        raise SystemExit("set HAI_TEST_DATABASE_URL to a PostgreSQL database of your own (its schema is dropped)")
    redis_url = os.environ.get("HAI_TEST_REDIS_URL", "")
    if not redis_url.startswith(("redis://", "rediss://", "unix://")):
        # (``hai server --workers 2`` refuses to start without Redis: its workers wake each other through it)
        raise SystemExit("set HAI_TEST_REDIS_URL to a Redis database of your own, e.g. redis://127.0.0.1:6379/12 "
                         "(the production layout's workers wake each other through it)")
    return url, redis_url


# the submitter's queued jobs stay counted against a limit (the check is part of every submission's
# cost, as with the default 10,000), set above what a run with --batch queues (4 cases of --jobs)
QUEUE_LIMIT = {"HAI_LIMITS__MAX_QUEUED_JOBS_PER_USER": "1000000"}


KINDS = ("postgresql", "pgbouncer", "sqlite")  # the platform's layouts, in the order they run
# ``--only pgbouncer``: PgBouncer's server connections to the database (transaction mode)
PGBOUNCER_POOL = 8


@contextmanager
def production(work: Path, queued: int, workers: int, procs: Procs, pgbouncer: bool = False):
    url, redis_url = pg_urls()
    reset_postgres(url)
    settings = Settings(data_dir=work, db={"url": url}, redis={"url": redis_url})
    token, agent_token, users = seed_users(settings)
    seed_jobs(url, users[1:], queued)  # other users' jobs: the submitter stays under its queue limit
    port = free_port()
    env = dict(os.environ, HAI_DB__URL=url, HAI_REDIS__URL=redis_url, HAI_DATA_DIR=str(work), **QUEUE_LIMIT)
    bouncer = None
    server_env = env
    if pgbouncer:  # the API through PgBouncer in transaction mode; the scheduler connects directly
        from pgbouncer import PgBouncer

        bouncer = PgBouncer(url, pool_size=PGBOUNCER_POOL)
        procs.stops.append(bouncer.stop)
        server_env = dict(env, HAI_DB__URL=bouncer.url, HAI_DB__PREPARED_STATEMENTS="false")
    server = procs.start(HAI + ["server", "--port", str(port), "--workers", str(workers)], env=server_env,
                         log=work / "server.log")
    sched = procs.start(HAI + ["scheduler"], env=env, log=work / "scheduler.log")
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: httpx.get(base + "/healthz", timeout=2).status_code == 200, 300, "hai server", procs=procs)
    layout = [("node-01", "A", "A1"), ("node-02", "A", "A2"), ("node-03", "B", "B1"), ("node-04", "B", "B2")]
    for node, zone, leaf in layout:
        procs.start(HAI + ["agent", "--server", base, "--token", agent_token, "--node", node, "--zone", zone,
                           "--leaf", leaf, "--fake-gpus", "8", "--state-dir", str(work / "agents" / node),
                           "--address", "127.0.0.1", "--stop-jobs-on-exit", "--ranks-as-agent-user"], env=env, log=work / f"{node}.log")
    yield base, token, {"server": [server.pid], "scheduler": [sched.pid],
                        "pgbouncer": [bouncer.proc.pid] if bouncer is not None else []}


@contextmanager
def embedded(work: Path, queued: int, procs: Procs):
    settings = Settings(data_dir=work.resolve())
    token, _agent, users = seed_users(settings)
    seed_jobs(settings.database_url, users[1:], queued)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAI_")} | QUEUE_LIMIT
    dev = procs.start(HAI + ["dev", "--port", str(port), "--agents", "4", "--data-dir", str(work)], env=env,
                      log=work / "dev.log")
    base = f"http://127.0.0.1:{port}"
    yield base, token, {"server": [dev.pid], "scheduler": []}


def nodes_ready(base: str, token: str, n: int) -> bool:
    r = httpx.get(base + "/api/v1/nodes", headers={"Authorization": f"Bearer {token}"}, timeout=5)
    return r.status_code == 200 and sum(1 for x in r.json() if x["state"] == "ready") >= n


def considered_after(client: httpx.Client, job_id: int, timeout: float = 300) -> float:
    """Seconds from now until a scheduling cycle has considered the job (it started, or its
    pending reason is no longer the submission's)."""
    t0 = time.perf_counter()

    def seen() -> bool:
        j = client.get(f"/api/v1/jobs/{job_id}").json()
        return j["state"] != "queued" or j["pending_reason"] != "waiting for the scheduler"

    wait_for(seen, timeout, f"a cycle to consider job {job_id}", interval=0.02)
    return round(time.perf_counter() - t0, 2)


def hai_case(kind: str, queued: int, n: int, profile: Path | None, batch: int = 0) -> dict:
    procs = Procs()
    out: dict = {"layout": kind, "queued_before": queued}
    with tempfile.TemporaryDirectory(prefix=f"hai-api-load-{kind}-") as tmp:
        work = Path(tmp)
        try:
            ctx = (production(work, queued, CORES, procs, pgbouncer=kind == "pgbouncer")
                   if kind in ("postgresql", "pgbouncer") else embedded(work, queued, procs))
            with ctx as (base, token, pids):
                wait_for(lambda: nodes_ready(base, token, 4), 180, "4 ready nodes", procs=procs)
                headers = {"Authorization": f"Bearer {token}"}

                def client() -> httpx.Client:
                    return httpx.Client(base_url=base, headers=headers, timeout=120)

                post_load(client, "/api/v1/jobs", BODY, 20, 1)  # warm-up: imports, caches, connections
                with client() as c:  # the scheduler past its first cycles over the seeded queue
                    out["settled_s"] = considered_after(c, c.post("/api/v1/jobs", json=BODY).json()["id"])
                cases = [(c, 1) for c in (1, 8)] + ([(c, batch) for c in (1, 8)] if batch > 1 else [])
                for in_flight, per in cases:
                    spies = []
                    if profile is not None:  # the server's workers (children of uvicorn's supervisor) too
                        targets = pids["server"] + [c for p in pids["server"] for c in children(p)] + pids["scheduler"]
                        spies = profile_pids(targets, profile, procs,
                                             f"{kind}-q{queued}-c{in_flight}" + (f"-b{per}" if per > 1 else ""))
                    # the platform's CPU per submission (user + system, from /proc): less noisy than
                    # jobs/s on a shared VM; on SQLite the scheduler is a thread of the server process
                    serving = pids["server"] + [c for p in pids["server"] for c in children(p) if not is_agent(c)]
                    quiet = wait_quiet()  # the previous case's work (and the seeding's) done
                    c0, s0 = cpu_s(serving), cpu_s(pids["scheduler"])
                    b0 = cpu_s(pids.get("pgbouncer", []))
                    pg = kind in ("postgresql", "pgbouncer")
                    pg0 = postgresql_cpu_s() if pg else 0.0  # its backends (those that exit too), WAL writer
                    if per > 1:  # POST /api/v1/jobs/batch: n jobs in n / per requests of per jobs
                        out[f"batch_{per}_in_flight_{in_flight}"] = r = post_load(
                            client, "/api/v1/jobs/batch", {"jobs": [BODY] * per}, max(1, n // per), in_flight,
                            per_request=per)
                    else:
                        out[f"in_flight_{in_flight}"] = r = post_load(client, "/api/v1/jobs", BODY, n, in_flight)
                    jobs_sent = max(1, n // per) * per
                    r["server_cpu_ms_per_job"] = round((cpu_s(serving) - c0) * 1000 / jobs_sent, 2)
                    r["scheduler_cpu_ms_per_job"] = round((cpu_s(pids["scheduler"]) - s0) * 1000 / jobs_sent, 2)
                    r["quiet_before"] = quiet
                    if pg:
                        r["postgresql_cpu_ms_per_job"] = round((postgresql_cpu_s() - pg0) * 1000 / jobs_sent, 2)
                    if pids.get("pgbouncer"):
                        r["pgbouncer_cpu_ms_per_job"] = round((cpu_s(pids["pgbouncer"]) - b0) * 1000 / jobs_sent, 2)
                    stop_profiles(spies)
                    with client() as c:  # does the scheduler keep up: its last job considered how late
                        last = c.get("/api/v1/jobs", params={"limit": 1, "user": "bench"}).json()["items"][0]["id"]
                        r["last_considered_after_s"] = considered_after(c, last)
                    print(f"  {kind:10s} queued={queued:<6d} in_flight={in_flight}"
                          f"{f' batch={per}' if per > 1 else ''}: {r['jobs_per_s']:7.1f} jobs/s "
                          f"p50 {r['p50_ms']:6.1f} ms p99 {r['p99_ms']:7.1f} ms  failed {r['failed']}"
                          f"  last job considered +{r['last_considered_after_s']:.2f} s"
                          f"  CPU/job: server {r['server_cpu_ms_per_job']} ms, scheduler {r['scheduler_cpu_ms_per_job']} ms"
                          f"{', PostgreSQL ' + str(r['postgresql_cpu_ms_per_job']) + ' ms' if pg else ''}"
                          f"{', PgBouncer ' + str(r['pgbouncer_cpu_ms_per_job']) + ' ms' if 'pgbouncer_cpu_ms_per_job' in r else ''}"
                          f", client {r['client_cpu_ms_per_job']} ms"
                          f"{' (' + r['first_error'][:120] + ')' if r['failed'] else ''}  load {r['load']}", flush=True)
        finally:
            procs.stop()
            keep = Path(tempfile.gettempdir()) / f"hai-api-load-logs-{kind}-q{queued}"
            shutil.rmtree(keep, ignore_errors=True)
            keep.mkdir()
            for log in work.glob("*.log"):
                shutil.copy(log, keep / log.name)
    return out


# -- Slurm -------------------------------------------------------------------------------------
SLURM_CONF = """ClusterName=haibench
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
StateSaveLocation={d}/state
SlurmctldPidFile={d}/slurmctld.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdSpoolDir={d}/spool
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
MaxJobCount=200000
MpiDefault=none
ReturnToService=2
GresTypes=gpu
NodeName=n[0001-{nodes:04d}] NodeAddr=127.0.0.1 CPUs=64 RealMemory=512000 Gres=gpu:8 State=UNKNOWN
PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def slurm_installed() -> bool:
    return all(shutil.which(x) for x in ("slurmctld", "slurmrestd", "sbatch", "munged", "mungekey"))


def slurm_case(n: int, n_nodes: int = 1250, batch: int = 0) -> dict:
    procs = Procs()
    d = Path(tempfile.mkdtemp(prefix="hai-slurm-"))
    d.chmod(0o755)  # munged wants its socket's directory reachable
    (d / "state").mkdir(mode=0o700)
    out: dict = {"nodes": n_nodes}
    try:
        subprocess.run(["mungekey", "-c", "-k", str(d / "munge.key")], check=True, capture_output=True)
        (d / "munge.key").chmod(0o600)
        procs.start(["munged", "-F", "-f", "-S", str(d / "munge.sock"), f"--key-file={d}/munge.key",
                     f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed", f"--log-file={d}/munged.log"],
                    log=d / "munged.out")
        wait_for(lambda: (d / "munge.sock").exists(), 30, "munged")
        conf = d / "slurm.conf"
        conf.write_text(SLURM_CONF.format(d=d, ctld_port=free_port(), slurmd_port=free_port(), nodes=n_nodes))
        env = dict(os.environ, SLURM_CONF=str(conf))
        procs.start(["slurmctld", "-D", "-c", "-f", str(conf)], env=env, log=d / "slurmctld.out")
        wait_for(lambda: subprocess.run(["sinfo", "-h"], env=env, capture_output=True, timeout=10).returncode == 0,
                 120, "slurmctld")
        rest_env = dict(env, SLURMRESTD_SECURITY="disable_user_check")  # we run as root; local auth, unix socket
        sock = d / "rest.sock"
        procs.start(["slurmrestd", "-f", str(conf), "-a", "rest_auth/local", "-s", "openapi/v0.0.38",
                     f"unix:{sock}"], env=rest_env, log=d / "slurmrestd.out")
        wait_for(lambda: sock.exists(), 30, "slurmrestd")

        # sbatch, one submitter
        lat = []
        t0 = time.perf_counter()
        for _ in range(n // 2):
            s = time.perf_counter()
            subprocess.run(["sbatch", "--hold", "-p", "batch", "-N1", "-n1", "--gres=gpu:1", "-o", "/dev/null",
                            "--wrap", "sleep 3600"], env=env, check=True, capture_output=True, cwd=str(d))
            lat.append(time.perf_counter() - s)
        out["sbatch"] = r = summarise(lat, time.perf_counter() - t0)
        print(f"  slurm      sbatch (one submitter): {r['jobs_per_s']:7.1f} jobs/s p50 {r['p50_ms']:6.1f} ms "
              f"p99 {r['p99_ms']:7.1f} ms  load {r['load']}", flush=True)

        body = {"job": {"name": "bench", "partition": "batch", "hold": True, "nodes": 1, "tasks": 1,
                        "gpus_per_node": "1", "current_working_directory": str(d), "environment": {"PATH": "/bin"},
                        "standard_output": "/dev/null"}, "script": "#!/bin/sh\nsleep 3600\n"}

        def client() -> httpx.Client:
            return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://slurmrestd",
                                timeout=120)

        post_load(client, "/slurm/v0.0.38/job/submit", body, 20, 1, ok=(200,))
        daemons = [p.pid for p in procs.procs]  # munged, slurmctld, slurmrestd
        for in_flight in (1, 8):
            quiet = wait_quiet()
            d0 = [cpu_s([pid]) for pid in daemons]
            out[f"slurmrestd_in_flight_{in_flight}"] = r = post_load(client, "/slurm/v0.0.38/job/submit", body, n,
                                                                     in_flight, ok=(200,))
            each = [round((cpu_s([pid]) - before) * 1000 / n, 2) for pid, before in zip(daemons, d0)]
            r["slurm_cpu_ms_per_job"] = round(sum(each), 2)
            r["slurm_cpu_ms_per_job_each"] = dict(zip(("munged", "slurmctld", "slurmrestd"), each))
            r["quiet_before"] = quiet
            print(f"  slurm      slurmrestd in_flight={in_flight}: {r['jobs_per_s']:7.1f} jobs/s p50 "
                  f"{r['p50_ms']:6.1f} ms p99 {r['p99_ms']:7.1f} ms  CPU/job: munged+slurmctld+slurmrestd "
                  f"{r['slurm_cpu_ms_per_job']} ms ({'+'.join(str(e) for e in each)}), client "
                  f"{r['client_cpu_ms_per_job']} ms  load {r['load']}", flush=True)
        if batch > 1:
            # job arrays: sbatch --array and slurmrestd's "array" field, ``batch`` tasks each (a held
            # array is one job record in slurmctld until its tasks are split off to start)
            lat = []
            t0 = time.perf_counter()
            for _ in range(max(1, n // batch)):
                s = time.perf_counter()
                subprocess.run(["sbatch", "--hold", f"--array=0-{batch - 1}", "-p", "batch", "-N1", "-n1",
                                "--gres=gpu:1", "-o", "/dev/null", "--wrap", "sleep 3600"],
                               env=env, check=True, capture_output=True, cwd=str(d))
                lat.append(time.perf_counter() - s)
            out[f"sbatch_array_{batch}"] = r = summarise(lat, time.perf_counter() - t0)
            r["jobs_per_s"] = round(r["jobs_per_s"] * batch, 1)
            r["jobs_per_request"] = batch
            print(f"  slurm      sbatch --array 0-{batch - 1} (one submitter): {r['jobs_per_s']:7.1f} jobs/s p50 "
                  f"{r['p50_ms']:6.1f} ms p99 {r['p99_ms']:7.1f} ms  load {r['load']}", flush=True)
            array = {"job": body["job"] | {"array": f"0-{batch - 1}"}, "script": body["script"]}
            for in_flight in (1, 8):
                out[f"slurmrestd_array_{batch}_in_flight_{in_flight}"] = r = post_load(
                    client, "/slurm/v0.0.38/job/submit", array, max(1, n // batch), in_flight, ok=(200,),
                    per_request=batch)
                print(f"  slurm      slurmrestd array 0-{batch - 1} in_flight={in_flight}: {r['jobs_per_s']:7.1f} "
                      f"jobs/s p50 {r['p50_ms']:6.1f} ms p99 {r['p99_ms']:7.1f} ms  load {r['load']}", flush=True)
    finally:
        procs.stop()
        shutil.rmtree(d, ignore_errors=True)
    return out


def slurm_mean(first: dict, again: dict) -> dict:
    """Two runs of ``slurm_case`` as one: each case's jobs/s the mean of its two runs (a shared
    VM's speed moves by minutes), everything else the first run's."""
    return {k: (dict(v, jobs_per_s=round((v["jobs_per_s"] + again[k]["jobs_per_s"]) / 2, 1))
                if isinstance(v, dict) and "jobs_per_s" in v else v) for k, v in first.items()}


# -- reads -------------------------------------------------------------------------------------
READS = [
    ("jobs", "/api/v1/jobs?limit=50"),
    ("jobs_queued", "/api/v1/jobs?limit=50&state=queued"),
    ("jobs_running", "/api/v1/jobs?limit=50&state=running"),
    ("jobs_user", "/api/v1/jobs?limit=50&user=user3"),
    ("jobs_user_succeeded", "/api/v1/jobs?limit=50&user=user3&state=succeeded"),
    ("jobs_page_100", "/api/v1/jobs?limit=50&offset=5000"),
    ("jobs_keyset_page_100", "/api/v1/jobs?limit=50&before_id={keyset}"),  # the same page by keyset
    ("jobs_count_exact", "/api/v1/jobs?limit=50&count=exact"),  # the exact total, asked for
    ("nodes", "/api/v1/nodes"),
    ("nodes_gpu_metrics", "/api/v1/nodes?include=gpu_metrics"),  # every GPU's figures (2 MB), asked for
]
# the heavy opt-in forms: fewer requests (a tenth of --repeat, at least 10)
FEW = {"nodes_gpu_metrics"}


def pids_named(*names: str) -> list[int]:
    """Every process whose command name is one of ``names`` (PostgreSQL's backends, Slurm's daemons)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() in names:
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def write_results(out: Path, results: dict) -> None:
    """A benchmark's results, with the load average at its end, as JSON at ``out``."""
    results["load_after"] = loadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


def postgresql_cpu_s() -> float:
    """User + system CPU seconds PostgreSQL's processes have spent so far, those that have exited
    included: every live postgres process's own, and each postmaster's reaped children's (a
    backend that exits moves its CPU there; a connection opened and closed during a case, such as
    a pool's overflow, counts). The difference over a case is what PostgreSQL spent in it."""
    total = 0
    for pid in pids_named("postgres"):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            parent = int(fields[1])
            parent_is_postgres = Path(f"/proc/{parent}/comm").read_text().strip() == "postgres"
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
        if not parent_is_postgres:  # a postmaster: its reaped backends' CPU
            total += int(fields[13]) + int(fields[14])
    return total / os.sysconf("SC_CLK_TCK")


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (the server's workers)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


class Churn:
    """What a live cluster does to the node list while it is read (``--churn RATE``): every second
    one statement writes every node's heartbeat figures (``last_heartbeat_at``, ``gpu_util_pct``,
    ``gpus_busy``: what the API processes' liveness batches write), and RATE times a second one
    transaction changes what the list shows (a node's state flipped between ready and draining:
    a drain, a start or a release each raise the list's revision the same way). Its own thread
    and connection; started and stopped around the reads."""

    def __init__(self, url: str, rate: float) -> None:
        self.url, self.rate = url, rate
        self.stop = threading.Event()
        self.changes = self.figure_writes = 0
        self.thread = threading.Thread(target=self.run, name="churn", daemon=True)

    def __enter__(self) -> "Churn":
        if self.rate > 0:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)

    def run(self) -> None:
        rng = random.Random(11)
        eng = create_engine(self.url)
        try:
            names = None
            next_figures = time.monotonic()
            while not self.stop.is_set():
                with eng.begin() as c:
                    if names is None:
                        names = list(c.execute(text("SELECT name FROM nodes")).scalars())
                    if time.monotonic() >= next_figures:
                        c.execute(text("UPDATE nodes SET last_heartbeat_at = now(), gpu_util_pct = round((random() * 100)::numeric, 1),"
                                       " gpus_busy = floor(random() * 9)::int"))
                        self.figure_writes += 1
                        next_figures += 1.0
                with eng.begin() as c:
                    c.execute(text("UPDATE nodes SET state = CASE WHEN state = 'ready' THEN 'draining' ELSE 'ready' END"
                                   " WHERE name = :n"), {"n": rng.choice(names)})
                    self.changes += 1
                self.stop.wait(1.0 / self.rate)
        finally:
            eng.dispose()


def reads_case(n_jobs: int, n_nodes: int, repeat: int, profile: Path | None, churn: float = 0.0) -> dict:
    url, redis_url = pg_urls()
    procs = Procs()
    out: dict = {"jobs_in_table": n_jobs, "nodes_in_table": n_nodes}
    with tempfile.TemporaryDirectory(prefix="hai-api-reads-") as tmp:
        work = Path(tmp)
        try:
            reset_postgres(url)
            settings = Settings(data_dir=work, db={"url": url}, redis={"url": redis_url})
            token, _agent, users = seed_users(settings)
            names = seed_nodes(settings, n_nodes)
            t0 = time.perf_counter()
            seed_jobs(url, users, n_jobs, nodes=names,
                      states=["succeeded"] * 6 + ["failed", "cancelled", "queued", "running"])
            print(f"  seeded {n_jobs} jobs in {time.perf_counter() - t0:.1f} s", flush=True)
            eng = create_engine(url, isolation_level="AUTOCOMMIT")
            with eng.connect() as c:  # what autovacuum does to a table that has settled
                c.execute(text("VACUUM ANALYZE"))
            eng.dispose()
            port = free_port()
            env = dict(os.environ, HAI_DB__URL=url, HAI_REDIS__URL=redis_url, HAI_DATA_DIR=str(work))
            server = procs.start(HAI + ["server", "--port", str(port), "--workers", str(CORES)], env=env,
                                 log=work / "server.log")
            # no scheduler and no agents: the seeded nodes would go 'lost' after 30 s without
            # heartbeats and the reaper would requeue their 10,000 running jobs mid-measurement
            base = f"http://127.0.0.1:{port}"
            wait_for(lambda: httpx.get(base + "/healthz", timeout=2).status_code == 200, 300, "hai server",
                     procs=procs)
            spies = []
            if profile is not None:
                spies = profile_pids([server.pid] + children(server.pid), profile, procs, "reads")
            workers = [server.pid] + children(server.pid)
            out["churn_per_s"] = churn
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=120) as c, \
                    Churn(url, churn) as ch:
                for name, path in READS:
                    n = max(10, repeat // 10) if name in FEW else repeat
                    c0 = cpu_s(workers)
                    out[name] = r = get_load(c, path.format(keyset=n_jobs - 5000 + 1), n)
                    # the server's CPU per request: less noisy than latency on a shared VM
                    r["server_cpu_ms"] = round((cpu_s(workers) - c0) * 1000 / (n + 1), 1)
                    print(f"  reads {name:22s} p50 {r['p50_ms']:6.1f} ms p99 {r['p99_ms']:7.1f} ms "
                          f"server CPU {r['server_cpu_ms']:6.1f} ms/request ({r['bytes']} bytes)  load {r['load']}",
                          flush=True)
            out["churn_done"] = {"list_changes": ch.changes, "figure_writes": ch.figure_writes}
            stop_profiles(spies)
        finally:
            procs.stop()
    return out


def ratios_to(slurm: dict, cases_by_kind: dict[str, list[dict]]) -> dict[str, float]:
    """Each platform case's jobs/s over slurmrestd's at the same number in flight (1 and 8), keyed
    ``<kind>_q<queued before>_c<in flight>``."""
    return {f"{kind}_q{case['queued_before']}_c{c}": round(
                case[f"in_flight_{c}"]["jobs_per_s"] / slurm[f"slurmrestd_in_flight_{c}"]["jobs_per_s"], 2)
            for kind, cases in cases_by_kind.items() for case in cases for c in (1, 8)}


def alternated(args: argparse.Namespace) -> dict:
    """``--rounds N``: Slurm's submission cases, then the platform's, N times, then Slurm's once
    more. A shared VM's speed moves by minutes (slurmrestd's rate moved 2x between two runs three
    minutes apart), so each round's platform case is compared with the mean of the Slurm runs
    just before and just after it, and the median of the N rounds' ratios is reported."""
    slurms = [slurm_case(args.jobs)]
    rounds: list[dict] = []
    for r in range(args.rounds):
        print(f"  round {r + 1} of {args.rounds}", flush=True)
        rounds.append({kind: [hai_case(kind, q, args.jobs, args.profile) for q in args.queued]
                       for kind in KINDS if kind in args.only})
        print("  slurm      again:", flush=True)
        slurms.append(slurm_case(args.jobs))
    per_round: dict[str, list[float]] = {}
    for r, got in enumerate(rounds):
        for k, v in ratios_to(slurm_mean(slurms[r], slurms[r + 1]), got).items():
            per_round.setdefault(k, []).append(v)
    medians = {k: round(statistics.median(v), 2) for k, v in per_round.items()}
    for k, v in per_round.items():
        print(f"  ratio to slurmrestd (same in-flight; each round to the Slurm runs either side) {k}: "
              f"median {medians[k]:.2f}x, rounds {', '.join(f'{x:.2f}' for x in v)}")
    return {"rounds": args.rounds, "slurm_runs": slurms, "platform_rounds": rounds,
            "ratio_rounds": per_round, "ratio_to_slurmrestd": medians}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=1000, help="submissions per case")
    ap.add_argument("--queued", type=int, nargs="+", default=[0, 10_000])
    ap.add_argument("--only", nargs="+", default=["postgresql", "sqlite", "slurm"],
                    choices=["postgresql", "pgbouncer", "sqlite", "slurm"], help=(
                        "pgbouncer: the production layout with the API through PgBouncer in transaction mode "
                        f"({PGBOUNCER_POOL} server connections; benchmarks/pgbouncer.py), the scheduler direct"))
    ap.add_argument("--batch", type=int, default=0, help=(
        "also submit the same number of jobs B at a time (POST /api/v1/jobs/batch; Slurm: job arrays of B "
        "tasks by sbatch --array and slurmrestd) at 1 and 8 in flight"))
    ap.add_argument("--reads", action="store_true", help="also the read benchmark (100,000 jobs, 1,250 nodes)")
    ap.add_argument("--reads-only", action="store_true")
    ap.add_argument("--read-jobs", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=200, help="requests per read")
    ap.add_argument("--churn", type=float, default=0.0, help=(
        "reads: changes of the node list per second while reading (and every node's heartbeat figures "
        "written every second); 0: a still cluster"))
    ap.add_argument("--profile", type=Path, help="py-spy record the server workers and the scheduler into DIR")
    ap.add_argument("--profile-rate", type=int, default=PROFILE_RATE, help="py-spy's samples a second")
    ap.add_argument("--rounds", type=int, default=1, help=(
        "N > 1: Slurm's cases and the platform's alternated N times (Slurm, the platform, Slurm, ..., Slurm), "
        "each round's ratio to the mean of the Slurm runs on either side of it; the median ratio reported"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "api_load.json")
    args = ap.parse_args()
    if args.rounds > 1 and not ("slurm" in args.only and slurm_installed() and any(k in args.only for k in KINDS)):
        ap.error("--rounds N > 1 alternates Slurm with the platform: it needs Slurm installed and both in --only")
    if args.rounds > 1 and (args.batch or args.reads or args.reads_only):
        ap.error("--rounds N > 1 alternates single submissions only: not with --batch, --reads or --reads-only")
    if args.profile:
        globals()["PROFILE_RATE"] = args.profile_rate
        args.profile.mkdir(parents=True, exist_ok=True)
    results: dict = {"cores": CORES, "load_before": loadavg(), "jobs_per_case": args.jobs,
                     "note": "shared VM: 2 cores, 8 engineers; load average next to every figure"}
    print(f"api_load: {args.jobs} submissions per case, {CORES} cores, load {loadavg()} (shared VM)", flush=True)
    if not args.reads_only and args.rounds > 1:
        results.update(alternated(args))
    elif not args.reads_only:
        if "slurm" in args.only:
            results["slurm"] = slurm_case(args.jobs, batch=args.batch) if slurm_installed() else None
        for kind in KINDS:
            if kind in args.only:
                results[kind] = [hai_case(kind, q, args.jobs, args.profile, args.batch) for q in args.queued]
        slurm = results.get("slurm")
        if slurm and any(k in args.only for k in KINDS):
            # the peer again after the platform's cases: a shared VM's speed moves by minutes (Slurm's
            # own CPU a job ranged 1.3-3.7 ms in one evening), so the ratios are to the mean of a
            # run before and a run after them
            print("  slurm      again, after the platform's cases:", flush=True)
            results["slurm_again"] = again = slurm_case(args.jobs, batch=args.batch)
            slurm = slurm_mean(slurm, again)
            results["slurm_mean"] = {k: v["jobs_per_s"] for k, v in slurm.items() if isinstance(v, dict)}
        if slurm:
            results["ratio_to_slurmrestd"] = ratios = ratios_to(slurm, {k: results[k] for k in KINDS if k in results})
            for k, v in ratios.items():
                print(f"  ratio to slurmrestd (same in-flight; the mean of its two runs) {k}: {v:.2f}x")
            if args.batch > 1:  # a batch of B against a Slurm job array of B tasks, same in-flight
                b = args.batch
                arrays = {}
                for kind in KINDS:
                    for case in results.get(kind, []):
                        for c in (1, 8):
                            arrays[f"{kind}_q{case['queued_before']}_c{c}_batch{b}"] = round(
                                case[f"batch_{b}_in_flight_{c}"]["jobs_per_s"]
                                / slurm[f"slurmrestd_array_{b}_in_flight_{c}"]["jobs_per_s"], 2)
                results["batch_ratio_to_slurmrestd_arrays"] = arrays
                for k, v in arrays.items():
                    print(f"  ratio to slurmrestd job arrays (same in-flight, {b} jobs a request) {k}: {v:.2f}x")
    if args.reads or args.reads_only:
        results["reads"] = reads_case(args.read_jobs, 1250, args.repeat, args.profile, args.churn)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
