#!/usr/bin/env python
"""Agent fan-in (issue 12): N simulated agents heartbeating at 1 Hz against the production layout.

One process (this one) speaks the real agent protocol over HTTP for every node (httpx, asyncio,
keep-alive): it registers each node with 8 GPUs, then heartbeats every ``--interval-s`` with 8
GPUs' metrics and the full status of every attempt the node holds (ranks running, as an agent
reports them), answers the validator runs the server asks for with a passing report, and echoes
the assignments digest of the reply it applied. Against:

- a fresh PostgreSQL database (created on HAI_BENCH_DATABASE_URL's / HAI_TEST_DATABASE_URL's
  server, dropped afterwards) and Redis (HAI_BENCH_REDIS_URL / HAI_TEST_REDIS_URL);
- ``hai server --workers <cores>`` and a separate ``hai scheduler``, as processes.

Half of the GPUs are held by running 4-GPU jobs (submitted before the measurement). During the
measurement a probe job (1 GPU) is submitted over REST every ``--probe-every-s``; the time until
a scheduling cycle placed it shows whether the scheduler's cycles stay on time under the load.

Reported: heartbeat latency p50/p99 (request sent -> reply parsed) and how late sends were
against their 1 Hz schedule (the generator's own lag), nodes marked lost, probe placement
latency, and CPU seconds per second of the server's processes (psutil, the master and its
workers), the scheduler, this generator, and the PostgreSQL backends serving the benchmark's
database, each also per agent.

    python benchmarks/agent_fanin.py --agents 1250 --seconds 60 --out benchmarks/results/agent_fanin.json
    python benchmarks/agent_fanin.py --agents 200 --seconds 20          # a quick look
    python benchmarks/agent_fanin.py ... --py-spy /tmp/fanin            # also profile each server worker
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backend"))

from hai.protocol import round_phase  # noqa: E402 - the agent's own rule for spreading quick rounds

GPUS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


class SimAgent:
    """One simulated agent. ``protocol`` 2 (the default, as ``hai agent``): the agent runs its
    periodic quick rounds itself by the reply's ``quick_every_heartbeats`` (``Agent._count_round``'s
    rule) and reports each without a run id until a reply to a heartbeat that carried it came;
    1: the server asks for each round in a reply."""

    protocol = 2
    """One node's agent: what it holds (from the last reply) and what it reports."""

    def __init__(self, i: int, zones: int = 2) -> None:
        self.name = f"fan-{i:04d}"
        self.index = i
        zone = "A" if i % zones == 0 else "B"
        self.zone, self.leaf = zone, f"{zone}{(i // zones) // 20:02d}"
        self.rng = random.Random(i)
        self.digest: str | None = None
        self.assignments: list[dict] = []
        self.started: dict[tuple[int, int], float] = {}
        self.validations: dict[int, dict] = {}  # run id -> finished report (repeated until unlisted)
        self.own: dict[float, dict] = {}  # own rounds' reports by their start (protocol 2)
        self.sent_own: list[float] = []  # the own reports the heartbeat in flight carries
        self.since_round: int | None = None
        self.own_rounds = 0
        self.reregisters = 0
        self.client: httpx.AsyncClient | None = None

    def hello(self) -> dict:
        return {
            "protocol_version": self.protocol, "node": self.name, "zone": self.zone, "leaf": self.leaf, "address": "127.0.0.1",
            "gpus": [{"index": g, "uuid": f"GPU-{self.name}-{g}", "model": "NVIDIA A100-PCIE-40GB",
                      "memory_total_mib": 40960, "numa_node": g // 4} for g in range(GPUS)],
            "nics": [{"name": "mlx5_0", "numa_node": 0}], "fake_gpus": True, "agent_version": "fanin-sim",
            "attempts": self.attempts(),
        }

    def metrics(self) -> list[dict]:
        busy = {g for a in self.assignments for g in a["spec"]["gpus"]}
        r = self.rng
        return [{"index": g, "uuid": f"GPU-{self.name}-{g}",
                 "util_pct": round(r.uniform(85, 100) if g in busy else 0.0, 1),
                 "memory_used_mib": 30000 + r.randrange(4000) if g in busy else 0, "memory_total_mib": 40960,
                 "temperature_c": round(r.uniform(55, 75) if g in busy else 35.0, 1),
                 "power_w": round(r.uniform(200, 250) if g in busy else 40.0, 1), "ecc_uncorrected": 0}
                for g in range(GPUS)]

    def attempts(self) -> list[dict]:
        out = []
        for a in self.assignments:
            key = (a["job_id"], a["attempt"])
            t0 = self.started.setdefault(key, time.time())
            st = {"job_id": key[0], "attempt": key[1], "started_at": t0,
                  "ranks": [{"rank": a["spec"]["node_rank"], "local_rank": 0, "pid": 1000 + key[0],
                             "state": "running"}]}
            if a["action"] != "run":  # stop / suspend: the ranks are gone at once (never in steady state)
                st.update(ranks=[{"rank": a["spec"]["node_rank"], "local_rank": 0, "state": "exited",
                                  "exit_code": 143}], finished=True, finished_at=time.time(),
                          stop_cause="requested" if a["action"] == "stop" else "suspend",
                          suspend_ready=a["action"] == "suspend", stopped_reason="asked to " + a["action"])
            out.append(st)
        return out

    def heartbeat(self) -> dict:
        self.sent_own = list(self.own)
        return {"protocol_version": self.protocol, "node": self.name, "gpus": self.metrics(),
                "attempts": self.attempts(), "assignments_digest": self.digest,
                "validations": list(self.validations.values()) + list(self.own.values())}

    def _count_round(self, reply: dict, carried: bool) -> None:
        every = reply.get("quick_every_heartbeats") or 0
        if every <= 0 or carried:
            return
        if self.since_round is None:
            self.since_round = -round_phase(self.name, every)
        if reply.get("validations"):
            return
        self.since_round += 1
        if self.since_round >= every:  # the round runs at once (fake GPUs) and goes in the next heartbeat
            self.since_round = 0
            self.own_rounds += 1
            now = time.time()
            self.own[now] = {"run_id": None, "level": "quick", "started_at": now, "finished_at": now,
                             "checks": [{"name": "gpu_inventory", "level": "quick", "critical": True,
                                         "status": "passed", "value": GPUS, "threshold": GPUS,
                                         "detail": f"{GPUS} GPUs as registered"}]}

    def apply(self, reply: dict) -> None:
        carried = bool(self.sent_own) or bool(self.validations)
        for started in self.sent_own:  # a reply came: the server has them
            self.own.pop(started, None)
        self.sent_own = []
        if not reply.get("reregister"):
            self._count_round(reply, carried)
        self.assignments = reply.get("assignments") or []
        self.digest = reply.get("assignments_digest")
        keys = {(a["job_id"], a["attempt"]) for a in self.assignments}
        for k in [k for k in self.started if k not in keys]:
            del self.started[k]
        listed = {v["run_id"]: v for v in reply.get("validations") or []}
        for run_id in [r for r in self.validations if r not in listed]:
            del self.validations[run_id]  # the server has it
        now = time.time()
        for run_id, req in listed.items():
            if run_id not in self.validations:
                self.validations[run_id] = {
                    "run_id": run_id, "level": req["level"], "started_at": now, "finished_at": now,
                    "checks": [{"name": "gpu_inventory", "level": "quick", "critical": True, "status": "passed",
                                "value": GPUS, "threshold": GPUS, "detail": f"{GPUS} GPUs as registered"}]}


class RawConnection:
    """One agent's keep-alive HTTP/1.1 connection without a client library (``--client raw``, the
    default): the generator must carry 1,250 agents at 1 Hz beside the server on the same cores,
    and httpx's per-request machinery cost ~3 ms of CPU per heartbeat there (more than the
    server's side). The bytes on the wire are an ordinary POST with a JSON body; the reply is
    read by its Content-Length (uvicorn sends one for every JSON reply)."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port = host, port
        self.head = (f"Host: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
                     "Content-Type: application/json\r\n").encode()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        for attempt in (0, 1):  # a keep-alive connection the server closed meanwhile: once more on a new one
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            try:
                self.writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\n" + self.head
                                  + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                head = await self.reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                status = int(lines[0].split(b" ", 2)[1])
                length, close = 0, False
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"connection" and value.strip().lower() == b"close":
                        close = True
                data = await self.reader.readexactly(length) if length else b""
                if close:
                    await self.close()
                return status, data
            except (asyncio.IncompleteReadError, ConnectionError):
                await self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
        self.reader = self.writer = None


class Stats:
    def __init__(self) -> None:
        self.measuring = False
        self.lat: list[float] = []
        self.starts: list[float] = []  # each measured beat's start (perf_counter), for --trace
        self.who: list[int] = []  # and its agent
        self.lag: list[float] = []
        self.errors: dict[str, int] = {}
        self.sent = 0
        self.skipped = 0  # a beat whose slot passed while the previous one was still in flight

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


async def agent_loop(a: SimAgent, client: httpx.AsyncClient, stats: Stats, interval: float, t0: float,
                     stop: asyncio.Event, raw: RawConnection | None = None) -> None:
    phase = (hash(a.name) % 1000) / 1000 * interval
    k = 0
    while not stop.is_set():
        due = t0 + phase + k * interval
        delay = due - time.perf_counter()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
                return
            except asyncio.TimeoutError:
                pass
        start = time.perf_counter()
        body = json.dumps(a.heartbeat())
        try:
            if raw is not None:
                status, data = await raw.post("/api/v1/agent/heartbeat", body.encode())
            else:
                r = await client.post("/api/v1/agent/heartbeat", content=body,
                                      headers={"Content-Type": "application/json"})
                status, data = r.status_code, r.content
            if status != 200:
                stats.error(f"http {status}")
            else:
                reply = json.loads(data)
                if reply.get("reregister"):
                    a.reregisters += 1
                    r2 = await client.post("/api/v1/agent/register", json=a.hello())
                    reply = r2.json()
                a.apply(reply)
        except (httpx.HTTPError, OSError, asyncio.IncompleteReadError) as e:
            stats.error(type(e).__name__)
        end = time.perf_counter()
        if stats.measuring:
            stats.sent += 1
            stats.lat.append(end - start)
            stats.starts.append(start)
            stats.who.append(a.index)
            stats.lag.append(start - due)
        # next slot: the one after now (a beat never queues behind a late one); the slots passed
        # meanwhile are skipped beats
        after = int((end - t0 - phase) // interval) + 1
        if after > k + 1 and stats.measuring:
            stats.skipped += after - (k + 1)
        k = max(k + 1, after)


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return []


async def run(args) -> dict:  # noqa: ANN001, C901
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    server_url = make_url(args.database_url)
    dbname = f"hai_fanin_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{dbname}"'))
    db_url = server_url.set(database=dbname).render_as_string(hide_password=False)
    tmp = Path(tempfile.mkdtemp(prefix="fanin-"))
    admin_token = "hai_" + secrets.token_urlsafe(24)
    agent_token = "haiagent_" + secrets.token_urlsafe(24)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAI_")}
    env.update(HAI_DB__URL=db_url, HAI_REDIS__URL=args.redis_url, HAI_DATA_DIR=str(tmp / "data"),
               HAI_FRONTEND_DIST=str(tmp / "no-dashboard"), HAI_AUTH__BOOTSTRAP_ADMIN_TOKEN=admin_token,
               HAI_AUTH__BOOTSTRAP_AGENT_TOKEN=agent_token, HAI_DB__POOL_SIZE=str(args.pool),
               PYTHONPATH=str(REPO / "backend"))
    env.update(dict(kv.split("=", 1) for kv in args.env))
    port = free_port()
    procs: dict[str, subprocess.Popen] = {}
    spies: list[subprocess.Popen] = []
    result: dict = {}
    try:
        subprocess.run([sys.executable, "-m", "hai.cli.main", "migrate"], env=env, check=True, capture_output=True,
                       timeout=300)
        logs = {n: (tmp / f"{n}.log").open("wb") for n in ("server", "scheduler")}
        procs["server"] = subprocess.Popen(
            [sys.executable, "-m", "hai.cli.main", "server", "--port", str(port), "--workers", str(args.workers)],
            env=env, stdout=logs["server"], stderr=subprocess.STDOUT, cwd=tmp)
        procs["scheduler"] = subprocess.Popen([sys.executable, "-m", "hai.cli.main", "scheduler"], env=env,
                                              stdout=logs["scheduler"], stderr=subprocess.STDOUT, cwd=tmp)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if procs["server"].poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start:\n" + (tmp / "server.log").read_text()[-3000:])
            time.sleep(0.5)

        SimAgent.protocol = args.protocol
        agents = [SimAgent(i) for i in range(args.agents)]
        stats = Stats()
        # httpcore's pool matches every queued request against every connection: one pool of
        # 1,250 agents spends the generator's CPU there. Agents are independent anyway. By default
        # each agent has its own client of one keep-alive connection, as a real agent does
        # (AgentClient: one httpx.Client per server), so its heartbeats reach the API process that
        # accepted its connection; ``--agents-per-client N`` shares one pool among N agents
        # (their heartbeats then land on any worker: each worker's reply cache misses them).
        if args.agents_per_client > 1:
            shards = max(1, -(-args.agents // args.agents_per_client))
            per = max(2, args.connections // shards)
        else:
            shards, per = args.agents, 1
        limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
        clients = [httpx.AsyncClient(base_url=base, limits=limits, timeout=30,
                                     headers={"Authorization": f"Bearer {agent_token}"}) for _ in range(shards)]
        for i, a in enumerate(agents):
            a.client = clients[i % shards]
        async with contextlib.AsyncExitStack() as stack, \
                httpx.AsyncClient(base_url=base, timeout=30,
                                  headers={"Authorization": f"Bearer {admin_token}"}) as user:
            for c in clients:
                await stack.enter_async_context(c)
            sem = asyncio.Semaphore(32)

            async def register(a: SimAgent) -> None:
                async with sem:
                    for attempt in range(5):  # as an agent does: retry with backoff
                        try:
                            r = await a.client.post("/api/v1/agent/register", json=a.hello())
                            r.raise_for_status()
                            a.apply(r.json())
                            return
                        except httpx.HTTPError:
                            if attempt == 4:
                                raise
                            await asyncio.sleep(0.5 * 2 ** attempt)

            t_reg = time.perf_counter()
            await asyncio.gather(*(register(a) for a in agents))
            result["register_s"] = round(time.perf_counter() - t_reg, 2)

            stop = asyncio.Event()
            t0 = time.perf_counter()
            raws = [RawConnection("127.0.0.1", port, agent_token) if args.client == "raw" else None for _ in agents]
            loops = [asyncio.create_task(agent_loop(a, a.client, stats, args.interval_s, t0, stop, raw))
                     for a, raw in zip(agents, raws)]

            # half the GPUs busy: 4-GPU jobs, 2 per node
            njobs = args.agents * GPUS // 2 // 4 if args.jobs is None else args.jobs
            t_sub = time.perf_counter()
            jsem = asyncio.Semaphore(8)

            async def submit(i: int) -> None:
                async with jsem:
                    for attempt in range(5):
                        try:
                            r = await user.post("/api/v1/jobs", headers={"Idempotency-Key": f"load-{i}"},
                                                json={"name": f"load-{i}", "command": ["sleep", "infinity"],
                                                      "gpus_per_node": 4})
                            r.raise_for_status()
                            return
                        except httpx.HTTPError:
                            if attempt == 4:
                                raise
                            await asyncio.sleep(0.5 * 2 ** attempt)

            await asyncio.gather(*(submit(i) for i in range(njobs)))
            result["jobs_submitted"] = njobs
            result["submit_s"] = round(time.perf_counter() - t_sub, 2)
            eng = create_engine(db_url)

            def running() -> int:
                with eng.connect() as c:
                    return c.execute(text("select count(*) from jobs where state = 'running'")).scalar()

            t_run = time.perf_counter()
            while (n := await asyncio.to_thread(running)) < njobs:
                if time.perf_counter() - t_run > args.timeout_s:
                    raise SystemExit(f"only {n} of {njobs} jobs running after {args.timeout_s} s")
                await asyncio.sleep(1.0)
            result["all_running_s"] = round(time.perf_counter() - t_run, 2)
            await asyncio.sleep(args.warmup_s)

            def lost_nodes() -> int:
                with eng.connect() as c:
                    return c.execute(text("select count(*) from node_events where to_state = 'lost'")).scalar()

            lost_before = await asyncio.to_thread(lost_nodes)

            def pg_backends() -> list[psutil.Process]:
                with eng.connect() as c:
                    pids = [r[0] for r in c.execute(text("select pid from pg_stat_activity where datname = :d"),
                                                    {"d": dbname})]
                out = []
                for pid in pids:
                    try:
                        out.append(psutil.Process(pid))
                    except psutil.Error:
                        pass
                return out

            server_procs = tree(procs["server"].pid)
            sched_procs = tree(procs["scheduler"].pid)
            me = [psutil.Process()]
            pg = await asyncio.to_thread(pg_backends)
            if args.py_spy:
                out = Path(args.py_spy)
                out.mkdir(parents=True, exist_ok=True)
                for p in server_procs[1:] or server_procs:
                    spies.append(subprocess.Popen(
                        [str(Path(sys.executable).with_name("py-spy")), "record", "--nonblocking", "-r", "100",
                         *(["--gil"] if args.py_spy_gil else []), "-f",
                         "raw", "-d", str(int(args.seconds)), "-p", str(p.pid), "-o", str(out / f"server-{p.pid}.txt")],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            c0 = {"server": cpu_s(server_procs), "scheduler": cpu_s(sched_procs), "generator": cpu_s(me),
                  "postgres": cpu_s(pg)}
            load0 = os.getloadavg()
            stats.measuring = True
            t_meas = time.perf_counter()
            probes: list[float] = []
            unplaced = 0
            while time.perf_counter() - t_meas < args.seconds:
                ts = time.perf_counter()
                r = await user.post("/api/v1/jobs", json={"name": "probe", "command": ["sleep", "infinity"],
                                                          "gpus_per_node": 1})
                r.raise_for_status()
                jid = r.json()["id"]
                placed = None
                while time.perf_counter() - ts < args.probe_every_s * 4:
                    j = (await user.get(f"/api/v1/jobs/{jid}")).json()
                    if j["state"] != "queued":
                        placed = time.perf_counter() - ts
                        break
                    await asyncio.sleep(0.05)
                if placed is None:
                    unplaced += 1
                else:
                    probes.append(placed)
                rest = args.probe_every_s - (time.perf_counter() - ts)
                if rest > 0:
                    await asyncio.sleep(rest)
            stats.measuring = False
            elapsed = time.perf_counter() - t_meas
            pg_now = pg + [p for p in await asyncio.to_thread(pg_backends) if p.pid not in {q.pid for q in pg}]
            c1 = {"server": cpu_s(server_procs), "scheduler": cpu_s(sched_procs), "generator": cpu_s(me),
                  "postgres": cpu_s(pg_now)}
            load1 = os.getloadavg()
            lost = await asyncio.to_thread(lost_nodes) - lost_before
            stop.set()
            await asyncio.gather(*loops, return_exceptions=True)
            for raw in raws:
                if raw is not None:
                    await raw.close()

            def states() -> dict:
                with eng.connect() as c:
                    return dict(c.execute(text("select state, count(*) from nodes group by state")).all())

            def runs() -> dict:  # the quick rounds stored (those of the last second may still be in a batch)
                with eng.connect() as c:
                    return {f"{by or 'server'}:{trigger}:{status}": n for by, trigger, status, n in c.execute(text(
                        "select case when requested_by = 'agent' then 'agent' else 'server' end, trigger, status,"
                        " count(*) from validation_runs group by 1, 2, 3")).all()}

            node_states = await asyncio.to_thread(states)
            validation_runs = await asyncio.to_thread(runs)
            eng.dispose()
        cpu = {k: round((c1[k] - c0[k]) / elapsed, 3) for k in c0}
        if args.trace:
            t_first = min(stats.starts, default=0.0)
            Path(args.trace).write_text(json.dumps({
                "first_start_unix": round(time.time() - time.perf_counter() + t_first, 4),  # to align with logs
                "beats": [[round(t - t_first, 4), round(lat * 1000, 2), who]
                          for t, lat, who in zip(stats.starts, stats.lat, stats.who)]}))
        result.update({
            "agents": args.agents, "gpus_per_agent": GPUS, "interval_s": args.interval_s,
            "protocol": args.protocol, "own_quick_rounds": sum(a.own_rounds for a in agents),
            "validation_runs": validation_runs,
            "server_workers": args.workers, "client": args.client, "agents_per_client": args.agents_per_client, "cpu_count": os.cpu_count(), "measured_s": round(elapsed, 1),
            "heartbeats": stats.sent, "heartbeats_per_s": round(stats.sent / elapsed, 1),
            "expected_per_s": round(args.agents / args.interval_s, 1),
            "latency_ms": {"p50": round(pct(stats.lat, 50) * 1000, 1), "p90": round(pct(stats.lat, 90) * 1000, 1),
                           "p99": round(pct(stats.lat, 99) * 1000, 1), "max": round(max(stats.lat) * 1000, 1)
                           if stats.lat else None},
            "send_lag_ms": {"p50": round(pct(stats.lag, 50) * 1000, 1), "p99": round(pct(stats.lag, 99) * 1000, 1)},
            "beats_skipped": stats.skipped, "errors": stats.errors,
            "reregisters": sum(a.reregisters for a in agents),
            "nodes_marked_lost": lost, "node_states_at_end": node_states,
            "probe_placement_s": {"n": len(probes), "p50": round(pct(probes, 50), 3),
                                  "max": round(max(probes), 3) if probes else None, "not_placed": unplaced},
            "cpu_cores_used": cpu,
            "server_cpu_ms_per_agent_per_s": round(cpu["server"] * 1000 / args.agents * args.interval_s, 3),
            "server_cpu_ms_per_heartbeat": round((c1["server"] - c0["server"]) * 1000 / max(stats.sent, 1), 3),
            "load_avg_before": [round(x, 2) for x in load0], "load_avg_after": [round(x, 2) for x in load1],
            "targets": {"p99_ms": 100, "nodes_marked_lost": 0},
        })
        result["met"] = {"p99": result["latency_ms"]["p99"] <= 100, "no_lost": lost == 0,
                         "all_beats_sent": stats.sent >= 0.98 * args.agents / args.interval_s * elapsed}
        return result
    finally:
        for s in spies:
            try:
                s.wait(timeout=60)
            except subprocess.TimeoutExpired:
                s.kill()
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'))
        admin.dispose()
        # what each worker's reply cache did over the whole run (its line at shutdown), summed
        cache: dict = {"answered": 0, "full_passes": {}}
        log_path = tmp / "server.log"
        for line in (log_path.read_text(errors="replace").splitlines() if log_path.exists() else []):
            if "heartbeat reply cache: " in line:
                c = json.loads(line.split("heartbeat reply cache: ", 1)[1])
                cache["answered"] += c["answered"]
                for why, n in c["full_passes"].items():
                    cache["full_passes"][why] = cache["full_passes"].get(why, 0) + n
        if cache["answered"] or cache["full_passes"]:
            result["reply_cache_whole_run"] = cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=1250)
    ap.add_argument("--seconds", type=float, default=60, help="measured window")
    ap.add_argument("--warmup-s", type=float, default=10)
    ap.add_argument("--interval-s", type=float, default=1.0)
    ap.add_argument("--jobs", type=int, default=None, help="running 4-GPU jobs (default: half the GPUs)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="hai server worker processes")
    ap.add_argument("--pool", type=int, default=10, help="database pool size per process")
    ap.add_argument("--agents-per-client", type=int, default=1,
                    help="agents sharing one keep-alive pool (1: one connection per agent, as real agents)")
    ap.add_argument("--connections", type=int, default=256,
                    help="with --agents-per-client > 1: the generator's keep-alive connections in all")
    ap.add_argument("--client", choices=("raw", "httpx"), default="raw",
                    help="heartbeats over a bare keep-alive connection per agent (raw) or httpx")
    ap.add_argument("--probe-every-s", type=float, default=2.0)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--database-url", default=os.environ.get("HAI_BENCH_DATABASE_URL")
                    or os.environ.get("HAI_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"))
    ap.add_argument("--redis-url", default=os.environ.get("HAI_BENCH_REDIS_URL")
                    or os.environ.get("HAI_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server and scheduler")
    ap.add_argument("--py-spy", default="", help="folder: profile each server worker over the window")
    ap.add_argument("--py-spy-gil", action="store_true", help="with --py-spy: sample only the thread holding the GIL")
    ap.add_argument("--protocol", type=int, choices=(1, 2), default=2,
                    help="agent protocol version: 2 runs the periodic quick rounds in the agents (as hai agent), "
                         "1 has the server ask for each")
    ap.add_argument("--trace", default="", help="file: every measured beat as [start s, latency ms, agent] "
                                                 "(JSON; with the first start's Unix time)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.client == "raw":
        try:  # uvicorn[standard]'s event loop: the generator's own share of the cores matters here
            import uvloop
            uvloop.install()
        except ImportError:
            pass
    result = asyncio.run(run(args))
    text_ = json.dumps(result, indent=2)
    print(text_)
    if args.out:
        Path(args.out).write_text(text_ + "\n")



if __name__ == "__main__":
    main()
