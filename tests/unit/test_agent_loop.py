"""The agent loop end to end against a small in-test server that plays the server's part of the
protocol (register, long-poll heartbeats, logs), on a loopback port."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse

from hai.agent.main import run_agent
from hai.agent.procs import group_members, is_alive
from hai.agent.testing import assignment, wait_for
from hai.protocol import (
    SUPPORTED_VERSIONS,
    AgentHello,
    Assignment,
    AttemptStatus,
    DesiredAction,
    Heartbeat,
    LogAck,
    LogBatch,
    ServerReply,
)

PY = sys.executable
TOKEN = "agent-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """The server's side of the protocol, in memory."""

    def __init__(self, port: int | None = None, *, refuse_version: bool = False):
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.refuse_version = refuse_version
        self.lock = threading.Lock()
        self.assignments: dict[str, list[Assignment]] = {}
        self.version = 0
        self.hellos: list[AgentHello] = []
        self.heartbeats = 0
        self.holding = 0  # long polls held now (waiting for a change)
        self.statuses: dict[tuple[int, int], AttemptStatus] = {}
        self.status_log: list[tuple[float, AttemptStatus]] = []
        self.logs: dict[tuple[int, int, int, int], object] = {}
        self.known: set[str] = set()
        self.app = self._app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    # -- control from the test
    def assign(self, node: str, *assignments: Assignment) -> None:
        with self.lock:
            self.assignments[node] = list(assignments)
            self.version += 1

    def forget_node(self, node: str) -> None:
        with self.lock:
            self.known.discard(node)

    def status(self, job_id: int, attempt: int = 0) -> AttemptStatus | None:
        with self.lock:
            return self.statuses.get((job_id, attempt))

    def lines(self, job_id: int, attempt: int = 0) -> list:
        with self.lock:
            return [v for k, v in sorted(self.logs.items()) if k[:2] == (job_id, attempt)]

    # -- protocol
    def _reply(self, node: str) -> ServerReply:
        with self.lock:
            a = self.assignments.get(node, [])
            digest = hashlib.sha256(json.dumps([x.model_dump(mode="json") for x in a]).encode()).hexdigest()
            return ServerReply(node=node, assignments=a, assignments_digest=digest, heartbeat_interval_s=0.2)

    def _absorb(self, attempts: list[AttemptStatus]) -> None:
        now = time.time()
        with self.lock:
            for st in attempts:
                self.statuses[(st.job_id, st.attempt)] = st
                self.status_log.append((now, st))

    def _app(self) -> FastAPI:
        app = FastAPI()

        def auth(authorization: str | None):
            if authorization != f"Bearer {TOKEN}":
                raise HTTPException(401, "bad token")

        @app.post("/api/v1/agent/register")
        def register(hello: AgentHello, authorization: str | None = Header(None)):
            auth(authorization)
            if self.refuse_version or hello.protocol_version not in SUPPORTED_VERSIONS:
                return JSONResponse({"detail": "protocol version 1 is not supported; speak 2"}, status_code=426)
            with self.lock:
                self.hellos.append(hello)
                self.known.add(hello.node)
            self._absorb(hello.attempts)
            return self._reply(hello.node)

        @app.post("/api/v1/agent/heartbeat")
        async def heartbeat(hb: Heartbeat, request: Request, authorization: str | None = Header(None)):
            auth(authorization)
            with self.lock:
                self.heartbeats += 1
                known = hb.node in self.known
                since = self.version
            if not known:
                return ServerReply(node=hb.node, assignments_digest="", reregister=True)
            self._absorb(hb.attempts)
            reply = self._reply(hb.node)
            if hb.wait_s > 0 and reply.assignments_digest == hb.assignments_digest:
                deadline = time.monotonic() + hb.wait_s
                with self.lock:
                    self.holding += 1
                try:
                    while time.monotonic() < deadline and self.version == since:
                        if await request.is_disconnected():
                            break
                        await asyncio.sleep(0.02)
                finally:
                    with self.lock:
                        self.holding -= 1
                reply = self._reply(hb.node)
            return reply

        @app.post("/api/v1/agent/logs")
        def logs(batch: LogBatch, authorization: str | None = Header(None)):
            auth(authorization)
            with self.lock:
                for ln in batch.lines:
                    self.logs.setdefault((ln.job_id, ln.attempt, ln.rank, ln.seq), ln)
            return LogAck(accepted=len(batch.lines))

        return app

    def start(self) -> FakeServer:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        wait_for(lambda: self._server.started, timeout=20, what="test server start")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None


@pytest.fixture
def server():
    s = FakeServer().start()
    yield s
    s.stop()


class AgentThread:
    def __init__(self, server_url: str, state_dir, *, node="n1", wait_s=5.0, **kw):
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.node = node

        def run():
            try:
                run_agent(server=server_url, token=TOKEN, node=node, zone="A", leaf="A1", fake_gpus=2,
                          state_dir=str(state_dir), heartbeat_wait_s=wait_s, stop_event=self.stop_event,
                          kill_grace_s=2.0, backoff_max_s=1.0, ranks_as_agent_user=True, **kw)
            except BaseException as e:  # noqa: BLE001 - surfaced to the test
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture
def agents():
    started: list[AgentThread] = []

    def start(*a, **kw) -> AgentThread:
        t = AgentThread(*a, **kw)
        started.append(t)
        return t

    yield start
    for t in started:
        t.stop_event.set()
    for t in started:
        t.thread.join(30)


def _script(tmp_path, name, body) -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def test_register_run_logs_exit_and_forget(server, agents, tmp_path):
    state = tmp_path / "state"
    agent = agents(server.url, state, wait_s=30.0)  # long polls: changes must cut through them
    wait_for(lambda: server.hellos, what="register")
    hello = server.hellos[0]
    assert hello.node == "n1" and hello.zone == "A" and hello.fake_gpus and len(hello.gpus) == 2
    assert hello.address and hello.attempts == []
    go = tmp_path / "go"
    s = _script(tmp_path, "job.py", f"""
        import os, pathlib, sys, time
        for i in range(5):
            print("line", i, "rank", os.environ["RANK"])
        print("to stderr", file=sys.stderr)
        while not pathlib.Path({str(go)!r}).exists():
            time.sleep(0.02)
    """)
    t0 = time.monotonic()
    server.assign("n1", assignment(1, [PY, s], attempt=1, job_type="torch", gpus=[0, 1]))
    st = wait_for(lambda: (lambda x: x if x and len(x.ranks) == 2 and all(r.pid for r in x.ranks) else None)(
        server.status(1, 1)), what="ranks reported running")
    assert time.monotonic() - t0 < 5  # the long poll answered the change, not its 30 s timeout
    assert {r.rank for r in st.ranks} == {0, 1} and st.started_at
    wait_for(lambda: len(server.lines(1, 1)) == 12, what="12 log lines")
    lines = server.lines(1, 1)
    for rank in (0, 1):
        mine = [ln for ln in lines if ln.rank == rank]
        assert [ln.seq for ln in mine] == list(range(6))
        assert [ln.line for ln in mine if ln.stream == "stdout"] == [f"line {i} rank {rank}" for i in range(5)]
        assert [ln.line for ln in mine if ln.stream == "stderr"] == ["to stderr"]
    t1 = time.time()
    go.touch()
    st = wait_for(lambda: (lambda x: x if x and x.finished else None)(server.status(1, 1)), what="final status")
    assert [r.exit_code for r in st.ranks] == [0, 0]
    assert st.finished_at - t1 < 3 and time.time() - t1 < 5  # reported at once, not at the next long poll
    attempt_dir = state / "attempts" / "1-1"
    assert attempt_dir.exists()
    server.assign("n1")  # the server has it: no longer assigned
    wait_for(lambda: not attempt_dir.exists(), what="forgotten")
    assert (state / "done" / "1-1.json").exists()
    agent.stop()
    assert agent.error is None


def test_suspend_handshake_through_the_server(server, agents, tmp_path):
    agents(server.url, tmp_path / "state", wait_s=30.0)
    s = _script(tmp_path, "train.py", """
        import time
        from hai import sdk
        step = 0
        while True:
            if sdk.should_suspend():
                with sdk.checkpointing():
                    time.sleep(0.05)
                    sdk.report_checkpoint("/ck/step.pt", step=step)
                sdk.suspend_ready()
                time.sleep(600)  # a job that would linger: the agent stops it
            sdk.report_progress(step, 10**9, loss=1.0)
            step += 1
            time.sleep(0.01)
    """)
    a = assignment(2, [PY, s], attempt=1, suspend_grace_s=30)
    server.assign("n1", a)
    wait_for(lambda: (lambda x: x and x.progress and x.progress.step > 0)(server.status(2, 1)), what="progress")
    t0 = time.time()
    server.assign("n1", a.model_copy(update={"action": DesiredAction.SUSPEND}))
    st = wait_for(lambda: (lambda x: x if x and x.finished else None)(server.status(2, 1)), what="suspended")
    assert st.suspend_ready and st.stop_cause == "suspend" and st.suspend_requested_at >= t0 - 1
    assert st.checkpoint.path == "/ck/step.pt" and st.checkpoint.duration_s >= 0.05
    assert st.progress is not None and st.progress.total == 10**9
    assert st.finished_at - t0 < 10


def test_a_job_ignoring_the_suspend_request_is_stopped_after_its_grace(server, agents, tmp_path):
    agents(server.url, tmp_path / "state", wait_s=30.0)
    s = _script(tmp_path, "deaf.py", "import time\nwhile True: time.sleep(0.05)\n")
    a = assignment(3, [PY, s], attempt=1, suspend_grace_s=1.0, stop_grace_s=1.0)
    server.assign("n1", a)
    wait_for(lambda: (lambda x: x and x.ranks and x.ranks[0].pid)(server.status(3, 1)), what="start")
    server.assign("n1", a.model_copy(update={"action": DesiredAction.SUSPEND}))
    st = wait_for(lambda: (lambda x: x if x and x.finished else None)(server.status(3, 1)), what="stopped")
    assert not st.suspend_ready and st.stop_cause == "suspend_timeout"
    assert "suspend_grace_s=1s" in st.stopped_reason
    assert st.finished_at - st.suspend_requested_at >= 1.0


def test_protocol_version_refused_exits_with_a_clear_message(tmp_path):
    s = FakeServer(refuse_version=True).start()
    try:
        with pytest.raises(SystemExit) as e:
            run_agent(server=s.url, token=TOKEN, node="n1", zone=None, leaf=None, fake_gpus=1,
                      state_dir=str(tmp_path / "state"), stop_event=threading.Event(), ranks_as_agent_user=True)
        assert "protocol version" in str(e.value)
    finally:
        s.stop()


def test_the_agent_waits_for_an_unreachable_server_and_keeps_jobs_running(agents, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    agent = agents(url, tmp_path / "state", wait_s=2.0)
    s1 = FakeServer(port).start()  # the server comes up late
    try:
        wait_for(lambda: s1.hellos, what="register after backoff")
        go = tmp_path / "go"
        script = _script(tmp_path, "job.py", f"""
            import pathlib, time
            print("started", flush=True)
            while not pathlib.Path({str(go)!r}).exists():
                time.sleep(0.02)
            print("done")
        """)
        s1.assign("n1", assignment(4, [PY, script], attempt=1))
        wait_for(lambda: s1.lines(4, 1), what="first line")
    finally:
        s1.stop()  # the server goes away mid-job
    go.touch()  # the job ends while nobody listens
    s2 = FakeServer(port)
    s2.known.add("n1")  # same database: it still knows the node
    s2.assign("n1", assignment(4, [PY, script], attempt=1))
    s2.start()
    try:
        st = wait_for(lambda: (lambda x: x if x and x.finished else None)(s2.status(4, 1)), what="status after reconnect")
        assert st.ranks[0].exit_code == 0
        wait_for(lambda: any(ln.line == "done" for ln in s2.lines(4, 1)), what="logs after reconnect")
    finally:
        agent.stop()
        s2.stop()
    assert agent.error is None


def test_reregister_when_the_server_does_not_know_the_node(server, agents, tmp_path):
    agents(server.url, tmp_path / "state", wait_s=0.5)
    wait_for(lambda: len(server.hellos) == 1, what="register")
    server.forget_node("n1")
    wait_for(lambda: len(server.hellos) == 2, what="register again")


def test_an_agent_killed_mid_job_is_restarted_and_reattaches(server, tmp_path):
    """A real agent process is SIGKILLed; its job keeps running; a new agent process reattaches
    (reports the same pid in its handshake), never launches the job again, and reports its exit."""
    state = tmp_path / "state"
    launches = tmp_path / "launches"
    go = tmp_path / "go"
    script = _script(tmp_path, "job.py", f"""
        import os, pathlib, time
        with open({str(launches)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        print("up", flush=True)
        while not pathlib.Path({str(go)!r}).exists():
            time.sleep(0.02)
        print("finishing")
        raise SystemExit(3)
    """)
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO); from hai.agent.main import run_agent; "
            f"run_agent(server={server.url!r}, token={TOKEN!r}, node='n1', zone=None, leaf=None, fake_gpus=1, "
            f"state_dir={str(state)!r}, heartbeat_wait_s=2.0, backoff_max_s=1.0, ranks_as_agent_user=True)")
    a = assignment(5, [PY, script], attempt=1)
    server.assign("n1", a)
    first = subprocess.Popen([PY, "-c", code])
    second = None
    try:
        st = wait_for(lambda: (lambda x: x if x and x.ranks and x.ranks[0].pid else None)(server.status(5, 1)),
                      what="job running")
        wrapper = st.ranks[0].pid
        wait_for(lambda: server.lines(5, 1), what="first line")
        first.kill()
        first.wait(10)
        assert is_alive(wrapper, None)  # the job did not die with its agent
        second = subprocess.Popen([PY, "-c", code])
        wait_for(lambda: len(server.hellos) == 2, what="second handshake")
        (reattached,) = server.hellos[1].attempts
        assert (reattached.job_id, reattached.attempt) == (5, 1)
        assert reattached.ranks[0].pid == wrapper and reattached.ranks[0].state == "running"
        go.touch()
        st = wait_for(lambda: (lambda x: x if x and x.finished else None)(server.status(5, 1)), what="exit")
        assert st.ranks[0].exit_code == 3
        wait_for(lambda: [ln.line for ln in server.lines(5, 1)] == ["up", "finishing"], what="all lines once")
        assert len(launches.read_text().split()) == 1  # launched exactly once
        assert group_members(wrapper) == []
        second.send_signal(signal.SIGTERM)
        assert second.wait(20) == 0
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_sigterm_ends_the_agent_without_waiting_for_its_long_poll(server, tmp_path):
    """An agent process told to stop (SIGTERM) while the server holds its long poll (60 s here)
    exits with code 0 long before the poll would return: the poll in flight is abandoned. (On a
    ThreadPoolExecutor's worker the interpreter waited for it at exit: a stopped agent lingered
    for the rest of its poll after logging "stopped".)"""
    code = ("import logging; logging.basicConfig(level=logging.INFO); from hai.agent.main import run_agent; "
            f"run_agent(server={server.url!r}, token={TOKEN!r}, node='n1', zone=None, leaf=None, fake_gpus=1, "
            f"state_dir={str(tmp_path / 'state')!r}, heartbeat_wait_s=60.0, backoff_max_s=1.0, ranks_as_agent_user=True)")
    p = subprocess.Popen([PY, "-c", code])
    try:
        wait_for(lambda: server.holding == 1, what="the agent's long poll held by the server")
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0  # well before the 60 s poll returns
        wait_for(lambda: server.holding == 0, what="the held poll's connection closed")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_stop_jobs_on_exit_stops_the_ranks_and_reports_them(server, agents, tmp_path):
    agent = agents(server.url, tmp_path / "state", wait_s=30.0, stop_jobs_on_exit=True)
    s = _script(tmp_path, "long.py", "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    server.assign("n1", assignment(6, [PY, s], attempt=1))
    st = wait_for(lambda: (lambda x: x if x and x.ranks and x.ranks[0].pid else None)(server.status(6, 1)),
                  what="start")
    wrapper = st.ranks[0].pid
    agent.stop()
    assert agent.error is None and not is_alive(wrapper, None) and group_members(wrapper) == []
    st = server.status(6, 1)
    assert st.finished and st.stop_cause == "requested" and st.ranks[0].exit_code == 128 + signal.SIGTERM
