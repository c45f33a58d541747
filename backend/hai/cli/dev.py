"""`hai dev`: the whole platform in one process tree on embedded SQLite.

API server (uvicorn, this process), scheduler loop (a thread of this process, guarded by the
same leader lock as `hai scheduler`), and N fake-GPU agents as real child processes, spread
over two zones with two leaves each.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from hai.api.http_protocol import HTTP_PROTOCOL
from hai.db.migrate import upgrade
from hai.main import create_app
from hai.services import auth
from hai.services.context import Platform
from hai.services.runner import SchedulerLoop
from hai.settings import Settings

log = logging.getLogger(__name__)


def _read_or_create_secret(path: Path, prefix: str) -> str:
    if path.exists():
        value = path.read_text().strip()
        if value:
            return value
    value = prefix + secrets.token_urlsafe(32)
    path.write_text(value + "\n")
    path.chmod(0o600)
    return value


def agent_layout(count: int) -> list[tuple[str, str, str]]:
    """(node, zone, leaf) for `count` agents. Four or more: the first half in zone A, the rest in
    zone B, each zone split over two leaf switches (4 agents: A1, A2, B1, B2). Fewer: one zone,
    so that a multi-node job still fits."""
    zones = [("A", (count + 1) // 2), ("B", count // 2)] if count >= 4 else [("A", count)]
    out = []
    for zone, size in zones:
        for j in range(size):
            leaf = f"{zone}{1 if j < (size + 1) // 2 else 2}"
            out.append((f"node-{len(out) + 1:02d}", zone, leaf))
    return out


@dataclass
class DevStack:
    data_dir: Path
    port: int
    host: str = "127.0.0.1"
    agents: int = 4
    gpus_per_agent: int = 8
    settings: Settings | None = None
    platform: Platform | None = None
    admin_token: str = ""
    agent_token: str = ""
    agent_procs: list[subprocess.Popen] = field(default_factory=list)
    scheduler: SchedulerLoop | None = None
    kubernetes: object | None = None  # the Kubernetes backend, when HAI_EXECUTOR=kubernetes

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def prepare(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.settings = self.settings or Settings(data_dir=self.data_dir.resolve())
        upgrade(self.settings.database_url)
        self.admin_token = _read_or_create_secret(self.data_dir / "admin-token", auth.TOKEN_PREFIX)
        self.agent_token = _read_or_create_secret(self.data_dir / "agent-token", auth.AGENT_TOKEN_PREFIX)
        self.platform = Platform.from_settings(self.settings)
        with self.platform.sessions() as session:
            auth.ensure_user_token(session=session, name="admin", group="admin", is_admin=True, secret=self.admin_token)
            auth.ensure_agent_token(session=session, secret=self.agent_token)

    def start_scheduler(self) -> None:
        assert self.platform is not None
        self.scheduler = SchedulerLoop(self.platform)
        self.scheduler.start_thread()

    def start_agents(self) -> None:
        assert self.platform is not None and self.settings is not None
        if self.settings.executor == "kubernetes":  # pods instead of agent processes
            from hai.integrations.kubernetes.backend import start_backend

            self.kubernetes = start_backend(self.platform)
            return
        # the node credential by environment, not argv (where `ps` would show it)
        env = dict(os.environ, HAI_AGENT_TOKEN=self.agent_token)
        for node, zone, leaf in agent_layout(self.agents):
            cmd = [
                sys.executable, "-m", "hai.cli.main", "agent",
                "--server", self.url, "--node", node,
                "--zone", zone, "--leaf", leaf, "--fake-gpus", str(self.gpus_per_agent),
                "--state-dir", str((self.data_dir / "agents" / node).resolve()),
                "--address", "127.0.0.1", "--stop-jobs-on-exit",
                # development: ranks run as this process's user (a user map, if set, still wins)
                "--ranks-as-agent-user",
                # one checkpoint folder for all dev nodes, as a shared filesystem would be
                "--checkpoint-root", str((self.data_dir / "checkpoints").resolve()),
            ]
            self.agent_procs.append(subprocess.Popen(cmd, env=env))

    def stop(self) -> None:
        for p in self.agent_procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.agent_procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.scheduler is not None:
            self.scheduler.stop.set()
        if self.kubernetes is not None:
            self.kubernetes.close()  # type: ignore[attr-defined]
        if self.platform is not None:
            self.platform.close()


class StoppingServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown (Ctrl-C, SIGTERM) first ends the requests that
    wait for a notification: the agents' held long polls answer at once and followed logs end
    with a ``limit`` event, instead of the shutdown waiting for each (a held poll kept ``hai
    dev`` up to 10 s after Ctrl-C). ``hai dev`` and a one-process ``hai server`` run it."""

    def __init__(self, config: uvicorn.Config, platform: Platform):
        super().__init__(config)
        self.platform = platform

    async def shutdown(self, sockets=None) -> None:  # noqa: ANN001
        self.platform.notifier.release_waiters()
        await super().shutdown(sockets)


class _Terminated(BaseException):
    """SIGTERM, as ``run_then`` takes it while the server runs."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


def run_then(server: uvicorn.Server, cleanup: Callable[[], None]) -> None:
    """``server.run()``, then ``cleanup()``, also when a service manager stops the process with
    SIGTERM. uvicorn re-raises the SIGTERM it caught once its graceful shutdown is done, so that
    the process ends by the signal; with Python's default action for SIGTERM the process ended
    right there, before any cleanup after ``run()`` (``hai dev`` left its agent processes
    running, retrying a server that was gone). Here the re-raised signal ends ``run()`` as Ctrl-C
    does, ``cleanup`` runs (a second SIGTERM meanwhile is ignored: the agents' stop is not cut
    short), and the signal is raised again with the handler from before: the process still ends
    by it."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminated) if main else None
    terminated = False
    try:
        server.run()
    except _Terminated:
        terminated = True
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            cleanup()
        finally:
            if main:
                signal.signal(signal.SIGTERM, before)
    if terminated:
        signal.raise_signal(signal.SIGTERM)


def run_dev(*, port: int, agents: int, data_dir: Path, host: str = "127.0.0.1", gpus_per_agent: int = 8) -> None:
    stack = DevStack(data_dir=data_dir, port=port, host=host, agents=agents, gpus_per_agent=gpus_per_agent)
    stack.prepare()
    assert stack.platform is not None
    app = create_app(stack.platform, tune_gc=True)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", http=HTTP_PROTOCOL)
    server = StoppingServer(config, stack.platform)
    started = threading.Event()

    def _after_start() -> None:
        while not server.started:
            if server.should_exit:
                return
            threading.Event().wait(0.05)
        started.set()
        stack.start_scheduler()
        stack.start_agents()
        banner = (
            f"\nHAI platform (dev) at {stack.url}  —  dashboard {stack.url}/  API docs {stack.url}/docs\n"
            # the token itself is never printed (issue 13: no token in any log): it is in the file
            f"admin token: in {(data_dir / 'admin-token').resolve()}\n"
            f"  export HAI_SERVER={stack.url} HAI_TOKEN=$(cat {(data_dir / 'admin-token').resolve()})\n"
            f"{agents} fake-GPU agent(s), {gpus_per_agent} GPUs each; Ctrl-C stops everything\n"
        )
        print(banner, flush=True)

    threading.Thread(target=_after_start, daemon=True).start()
    run_then(server, stack.stop)
