"""The fault harness's cluster (issue 13): every part of the platform as its own real process —
API servers, the scheduler, a Celery worker with beat, fake-GPU agents — on a PostgreSQL and a
Redis of its own (``ThrowawayPostgres`` / ``ThrowawayRedis``: started here, so a test may stop
and restart them; the shared servers are never touched). Each process can be killed with
SIGKILL, frozen (SIGSTOP) and restarted. Used by tests/faults and benchmarks/chaos.py."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.e2e.conftest import free_port, wait_for  # noqa: F401  (re-exported: the suite's one copy)

REPO = Path(__file__).resolve().parents[2]
JOBSCRIPT = str(Path(__file__).with_name("jobscript.py"))


def _as_postgres(cmd: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["su", "postgres", "-s", "/bin/sh", "-c", " ".join(_q(c) for c in cmd)]
    return cmd


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


class ThrowawayPostgres:
    """A PostgreSQL server of our own (initdb in ``root``, a free port): stop and start at will."""

    def __init__(self, root: Path | None = None) -> None:
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
        if not bins:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
        self.bin = bins[-1]
        # a folder the postgres user can reach (pytest's tmp folders are root's, mode 0700)
        self.root = root = root or Path(tempfile.mkdtemp(prefix="hai-faults-pg-"))
        self.data = root / "pgdata"
        self.port = free_port()
        root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(root, "postgres")
        subprocess.run(_as_postgres([str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres"]),
                       check=True, capture_output=True, timeout=300)
        self.start()
        subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-c", "create database hai"],
                       check=True, capture_output=True, timeout=60)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/hai"

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off"
        subprocess.run(_as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts,
                                     "-l", str(self.root / "pg.log"), "-w", "-t", "120", "start"]),
                       check=True, capture_output=True, timeout=180)

    def stop(self, mode: str = "immediate") -> None:
        subprocess.run(_as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"]),
                       check=False, capture_output=True, timeout=180)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class ThrowawayRedis:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.root)], stdout=(self.root / "redis.log").open("ab"), stderr=subprocess.STDOUT)
        import redis

        def up():
            try:
                return redis.Redis.from_url(self.url).ping()
            except redis.RedisError:
                return False
        wait_for(up, timeout=60, what="redis-server")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def close(self) -> None:
        self.stop()


@dataclass
class Proc:
    """One platform process: started, killed (SIGKILL), frozen and restarted by the harness."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    cwd: Path
    popen: subprocess.Popen | None = None
    starts: int = 0
    kills: int = 0

    def start(self) -> None:
        assert not self.alive, f"{self.name} already runs"
        self.starts += 1
        with self.log.open("ab") as out:
            out.write(f"\n===== start {self.starts} of {self.name} at {time.time():.3f}\n".encode())
            out.flush()
            self.popen = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd,
                                          start_new_session=True)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def kill9(self) -> None:
        """SIGKILL the process itself (an agent's ranks are other sessions: they live on)."""
        if self.alive:
            self.kills += 1
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(30)

    def kill9_group(self) -> None:
        """SIGKILL its whole process group (a server with its uvicorn children, a Celery worker
        with its pool) — never an agent's ranks, which run in sessions of their own."""
        if self.alive:
            self.kills += 1
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(30)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def stop(self, timeout: float = 30) -> None:
        if not self.alive:
            return
        try:
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGTERM)
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9_group()
        except ProcessLookupError:
            pass


@dataclass
class Cluster:
    """Servers, scheduler, Celery worker and agents on ``db_url`` / ``redis_url``."""

    tmp: Path
    db_url: str
    redis_url: str
    nodes: list[tuple[str, int]] = field(default_factory=lambda: [("n0", 4), ("n1", 4)])
    servers: int = 1
    settings: dict[str, str] = field(default_factory=dict)
    agent_args: list[str] = field(default_factory=list)
    agents_root: Path | None = None  # the agents' state folders (default <tmp>/agents): a test's own filesystem
    admin_token: str = field(default_factory=lambda: "hai_" + secrets.token_urlsafe(32))
    agent_token: str = field(default_factory=lambda: "haiagent_" + secrets.token_urlsafe(32))

    def __post_init__(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.agents_root = self.agents_root or self.tmp / "agents"
        self.marks = self.tmp / "marks.jsonl"
        self.marks.touch()
        self.checkpoints = self.tmp / "checkpoints"
        self.ports = [free_port() for _ in range(self.servers)]
        self.accepted: list[int] = []  # every job id a 201 (or an idempotent replay) answered
        self.expected_exit: dict[int, int] = {}  # job id -> the exit code its command ends with
        self.topology = self.tmp / "topology.csv"
        self.topology.write_text("node,gpus,leaf,zone\n" + "".join(
            f"{name},{gpus},L{i // 2},A\n" for i, (name, gpus) in enumerate(self.nodes)))
        env = {k: v for k, v in os.environ.items() if not k.startswith("HAI_")}
        env.update({
            "PYTHONUNBUFFERED": "1",
            "HAI_DB__URL": self.db_url,
            "HAI_REDIS__URL": self.redis_url,
            "HAI_DATA_DIR": str(self.tmp / "data"),
            "HAI_FRONTEND_DIST": str(self.tmp / "no-dashboard"),
            "HAI_AUTH__BOOTSTRAP_ADMIN_TOKEN": self.admin_token,
            "HAI_AUTH__BOOTSTRAP_AGENT_TOKEN": self.agent_token,
            "HAI_SCHEDULER__INTERVAL_S": "0.5",
            **self.settings,
        })
        self.env = env
        py = sys.executable
        self.server_procs = [
            Proc(f"server{i}", [py, "-m", "hai.cli.main", "server", "--port", str(port),
                                *(["--topology", str(self.topology)] if i == 0 else [])],
                 env, self.tmp / f"server{i}.log", self.tmp)
            for i, port in enumerate(self.ports)]
        self.scheduler = Proc("scheduler", [py, "-m", "hai.cli.main", "scheduler"], env, self.tmp / "scheduler.log", self.tmp)
        self.worker = Proc("worker", [py, "-m", "celery", "-A", "hai.tasks", "worker", "--beat", "--pool", "solo",
                                      "--loglevel", "INFO", "-s", str(self.tmp / "celerybeat-schedule")],
                           env, self.tmp / "worker.log", self.tmp)
        self.agents: dict[str, Proc] = {}
        for i, (name, gpus) in enumerate(self.nodes):
            # its own server first, the others after it (the agent moves on when one is down)
            order = [self.ports[(i + k) % len(self.ports)] for k in range(len(self.ports))]
            server = ",".join(f"http://127.0.0.1:{p}" for p in order)
            self.agents[name] = Proc(
                f"agent-{name}",
                [py, "-m", "hai.cli.main", "agent", "--server", server, "--token", self.agent_token, "--node", name,
                 "--zone", "A", "--leaf", f"L{i // 2}", "--fake-gpus", str(gpus),
                 "--state-dir", str(self.agents_root / name), "--checkpoint-root", str(self.checkpoints),
                 "--kill-grace-s", "3", "--ranks-as-agent-user", *self.agent_args],
                env, self.tmp / f"agent-{name}.log", self.tmp)

    # ------------------------------------------------------------------ life cycle

    def url(self, i: int = 0) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def start(self, *, worker: bool = True) -> None:
        subprocess.run([sys.executable, "-m", "hai.cli.main", "migrate"], env=self.env, check=True,
                       capture_output=True, timeout=300)
        for p in self.server_procs:
            p.start()
        for i in range(len(self.server_procs)):
            self.wait_server(i)
        self.scheduler.start()
        if worker:
            self.worker.start()
        for a in self.agents.values():
            a.start()
        self.wait_nodes_ready(list(self.agents))

    def wait_server(self, i: int, timeout: float = 120) -> None:
        def up():
            p = self.server_procs[i]
            if not p.alive:
                raise AssertionError(f"{p.name} exited: {p.log.read_text(errors='replace')[-3000:]}")
            try:
                return httpx.get(self.url(i) + "/healthz", timeout=3).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(up, timeout=timeout, what=f"server {i}")

    def restart_server(self, i: int) -> None:
        self.server_procs[i].start()
        self.wait_server(i)

    def stop(self) -> None:
        for p in [*self.agents.values(), self.scheduler, self.worker, *self.server_procs]:
            try:
                p.stop(timeout=20)
            except Exception:
                pass
        # ranks the agents left (agents keep them running when they exit): end them
        for pid in self.rank_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    def rank_pids(self) -> list[int]:
        """Rank wrappers under this cluster's agents (their sessions' leaders)."""
        root = str(self.agents_root).encode()
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"rankwrap.py" in cmd and root in cmd:
                out.append(int(entry.name))
        return out

    # ------------------------------------------------------------------ API

    def client(self, i: int = 0, timeout: float = 30) -> httpx.Client:
        return httpx.Client(base_url=self.url(i), headers={"Authorization": f"Bearer {self.admin_token}"},
                            timeout=timeout)

    def get(self, path: str, **params):
        """GET from whichever server answers (they may be down: retried)."""
        last = None
        for attempt in range(600):
            i = attempt % len(self.ports)
            try:
                with self.client(i) as c:
                    r = c.get(path, params=params)
                if r.status_code == 200:
                    return r.json()
                last = f"{r.status_code} {r.text[:300]}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.2)
        raise AssertionError(f"GET {path} never answered: {last}")

    def nodes_state(self) -> dict[str, str]:
        return {n["name"]: n["state"] for n in self.get("/api/v1/nodes")}

    def wait_nodes_ready(self, names: list[str], timeout: float = 180) -> None:
        wait_for(lambda: all(self.nodes_state().get(n) == "ready" for n in names), timeout=timeout,
                 what=f"nodes {names} ready")

    def job(self, job_id: int) -> dict:
        return self.get(f"/api/v1/jobs/{job_id}")

    def logs(self, job_id: int) -> str:
        """The job's log text as the API serves it (every rank, every attempt)."""
        with self.client() as c:
            r = c.get(f"/api/v1/jobs/{job_id}/logs")
        r.raise_for_status()
        return r.text

    def submit(self, *, seconds: float = 1.0, exit_code: int = 0, checkpoint_every: float = 0.0,
               nodes: int = 1, gpus_per_node: int = 1, priority: str = "NORMAL", name: str = "fault",
               timeout: float = 300, chatty: bool = False, **extra) -> int:
        """Submit a job running jobscript.py (start/stop marks, checkpoints through the SDK);
        retried with one Idempotency-Key across servers that are down or restarting. Returns
        the id once a server accepted it (201, or 200 for a replay)."""
        command = [sys.executable, JOBSCRIPT, "--seconds", str(seconds), "--exit-code", str(exit_code),
                   "--checkpoint-every", str(checkpoint_every), "--marks", str(self.marks),
                   *(["--chatty"] if chatty else [])]
        body = {"name": name, "command": command, "nodes": nodes, "gpus_per_node": gpus_per_node,
                "priority": priority, **extra}
        key = str(uuid.uuid4())
        deadline = time.monotonic() + timeout
        last = None
        attempt = 0
        while time.monotonic() < deadline:
            i = attempt % len(self.ports)
            attempt += 1
            try:
                with self.client(i, timeout=30) as c:
                    r = c.post("/api/v1/jobs", json=body, headers={"Idempotency-Key": key})
            except httpx.HTTPError as e:
                last = repr(e)
                time.sleep(0.2)
                continue
            if r.status_code in (200, 201):
                job_id = r.json()["id"]
                self.accepted.append(job_id)
                self.expected_exit[job_id] = exit_code
                return job_id
            if r.status_code not in (502, 503, 504):
                raise AssertionError(f"submit answered {r.status_code}: {r.text[:500]}")
            last = f"{r.status_code} {r.text[:200]}"
            time.sleep(0.2)
        raise AssertionError(f"no server accepted the submission: {last}")

    def wait_terminal(self, job_ids: list[int], timeout: float = 300) -> dict[int, dict]:
        done: dict[int, dict] = {}

        def all_done():
            for jid in job_ids:
                if jid not in done:
                    j = self.job(jid)
                    if j["state"] in ("succeeded", "failed", "cancelled"):
                        done[jid] = j
            return len(done) == len(job_ids)
        try:
            wait_for(all_done, timeout=timeout, interval=0.5, what="jobs to end")
        except AssertionError:
            going = {jid: (j := self.job(jid))["state"] + ": " + (j.get("pending_reason") or "")
                     for jid in job_ids if jid not in done}
            raise AssertionError(f"{len(going)} of {len(job_ids)} jobs did not end: {going}") from None
        return done

    def read_marks(self) -> list[dict]:
        out = []
        for line in self.marks.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line cut by a SIGKILL mid-write
        return out

    def rank0_running(self, job_id: int) -> list[dict]:
        """Start marks of rank 0 of the job whose process is still alive."""
        alive = []
        for m in self.read_marks():
            if m["job"] == job_id and m["rank"] == 0 and m["ev"] == "start" and _alive(m["pid"]):
                alive.append(m)
        return alive


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return ") Z " not in stat
