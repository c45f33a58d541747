"""Fault harness (issue 13): real `hai server` processes on real PostgreSQL, killed and
restarted by the tests. Each test gets a fresh database (pg_url from tests/integration)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import free_port, wait_for
from tests.integration.conftest import pg_url, redis_url, server_db_url  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[2]


@dataclass
class LiveServer:
    """One `hai server` on a port, restartable; its output is kept in log files."""

    db_url: str
    tmp: Path
    admin_token: str = field(default_factory=lambda: "hai_" + secrets.token_urlsafe(32))
    agent_token: str = field(default_factory=lambda: "haiagent_" + secrets.token_urlsafe(32))
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HAI_")}
        env.update(
            HAI_DB__URL=self.db_url,
            HAI_DATA_DIR=str(self.tmp / "data"),
            HAI_FRONTEND_DIST=str(self.tmp / "no-dashboard"),
            HAI_AUTH__BOOTSTRAP_ADMIN_TOKEN=self.admin_token,
            HAI_AUTH__BOOTSTRAP_AGENT_TOKEN=self.agent_token,
        )
        env.update(extra)
        return env

    def migrate(self) -> None:
        subprocess.run([sys.executable, "-m", "hai.cli.main", "migrate"], env=self.env(), check=True,
                       capture_output=True, timeout=120)

    def start(self, *, topology: Path | None = None, **extra_env: str) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        log = (self.tmp / f"server-{self.starts}.log").open("wb")
        cmd = [sys.executable, "-m", "hai.cli.main", "server", "--port", str(self.port)]
        if topology is not None:
            cmd += ["--topology", str(topology)]
        self.proc = subprocess.Popen(cmd, env=self.env(**extra_env), stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp)
        wait_for(self.healthy, timeout=60, what="the server to answer")

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited with {self.proc.returncode}: {self.logs()[-2000:]}")
        try:
            return httpx.get(self.url + "/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob("server-*.log")))

    def client(self, token: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token or self.admin_token}"}, timeout=30)


@pytest.fixture
def topology(tmp_path: Path) -> Path:
    path = tmp_path / "topology.csv"
    path.write_text("node,gpus,leaf,zone\nn0,8,A1,A\nn1,8,A1,A\n")
    return path


@pytest.fixture
def live_server(pg_url: str, tmp_path: Path):  # noqa: F811
    server = LiveServer(db_url=pg_url, tmp=tmp_path)
    server.migrate()
    yield server
    server.kill()


# ---------------------------------------------------------------------- issue 13: fault cluster
# PostgreSQL and Redis of this module's own (started here; a test may stop them), one fresh
# database and Redis db per test, and a Cluster of real processes on them (tests/faults/cluster.py).

from tests.faults.cluster import Cluster, ThrowawayPostgres, ThrowawayRedis  # noqa: E402
from tests.faults.monitor import InvariantMonitor  # noqa: E402

_redis_dbs = iter(range(1, 16))


@pytest.fixture(scope="session")
def throwaway_services(tmp_path_factory):
    root = tmp_path_factory.mktemp("services")
    pg = ThrowawayPostgres()
    rd = ThrowawayRedis(root / "redis")
    yield pg, rd
    pg.close()
    rd.close()


@pytest.fixture
def make_cluster(throwaway_services, tmp_path):
    """``make_cluster(**kw)``: a started Cluster on a fresh database of the throwaway server."""
    pg, rd = throwaway_services
    made = []

    def make(**kw) -> Cluster:
        import psycopg

        name = f"f{secrets.token_hex(4)}"
        with psycopg.connect(f"host=127.0.0.1 port={pg.port} user=postgres dbname=hai", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        db_url = pg.url.rsplit("/", 1)[0] + "/" + name
        redis_url = rd.url.rsplit("/", 1)[0] + f"/{next(_redis_dbs)}"
        cluster = Cluster(tmp=tmp_path / f"cluster{len(made)}", db_url=db_url, redis_url=redis_url, **kw)
        made.append(cluster)
        cluster.start()
        return cluster

    yield make
    for c in made:
        c.stop()


@pytest.fixture
def monitor_for():
    made = []

    def make(cluster: Cluster) -> InvariantMonitor:
        m = InvariantMonitor(cluster.db_url).__enter__()
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop()
