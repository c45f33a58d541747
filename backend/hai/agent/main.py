"""The agent process: handshake, heartbeats (long poll), supervision, log tailing and shipping.

Threads: the caller's thread runs the reporter loop, ``Agent._reporter`` — the one heartbeat
loop (register, heartbeats, applying replies); ``Agent.periodic`` lists the rounds that run
beside it, one thread each: ``hai-agent-supervise`` ticks the NodeAgent (rank exits, suspend
handshake, deadlines), ``hai-agent-tail`` reads the ranks' log files into the bounded buffer
(a validator round or a fault injector is one more entry); ``hai-agent-logs`` ships the buffer
to the server; ``hai-agent-poll`` holds the long-poll heartbeat. Configuration: one
``AgentOptions``.

Heartbeats: one long poll (``wait_s``) is in flight at a time; when the local state changes (a
rank exits, the job says suspend_ready, a checkpoint is reported) the reporter sends a short
heartbeat (``wait_s=0``) at once, without waiting for the long poll. Replies are applied in the
order their requests were sent: a reply to an older request than the last applied one is not
applied (the next long poll carries our digest, so the server answers it at once if anything
changed). Server unreachable: the jobs keep running; retries back off exponentially (capped).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from urllib.parse import urlparse

from hai.agent.client import AgentClient, ProtocolVersionUnsupported, Rejected
from hai.agent.gpu import GpuBackend, discover_nics, make_gpu_backend
from hai.agent.logs import LogBuffer, LogShipper
from hai.agent.node import NodeAgent
from hai.agent.faults import FaultEffects, FaultPlan  # issue 10
from hai.agent.validators import Validator, make_context  # issue 10
from hai.agent.users import UserMap, root_without_user_map
from hai.protocol import AgentHello, AttemptStatus, Heartbeat, LogBatch, LogLine, ServerReply, round_phase

log = logging.getLogger("hai.agent")

AGENT_VERSION = "0.1.0"


def detect_address(server: str) -> str:
    """The address of the interface this host uses to reach the server."""
    u = urlparse(server)
    host = u.hostname or "127.0.0.1"
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"


class Backoff:
    def __init__(self, base_s: float = 0.5, cap_s: float = 10.0):
        self.base_s, self.cap_s = base_s, cap_s
        self.n = 0

    def next(self) -> float:
        d = min(self.cap_s, self.base_s * (2 ** self.n))
        self.n += 1
        return d * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self.n = 0


def fence_lease(*, sent_at: float, lost_after_s: float) -> dict[str, float]:
    """The lease a successful exchange buys (issue 13). The server marks the node lost, and gives
    its jobs to other nodes, once it has heard nothing for ``lost_after_s`` since it received a
    request (no earlier than ``sent_at``). The ranks must be gone by then: they stop themselves
    (SIGTERM) ``margin`` before that, and are killed ``margin/2`` later, margin being a quarter
    of ``lost_after_s`` (at least 1 s). Wall-clock times: the rank wrappers read them."""
    margin = max(1.0, 0.25 * lost_after_s)
    return {"valid_until": sent_at + max(0.5, lost_after_s - margin), "grace_s": margin / 2}


@dataclass
class _Result:
    seq: int
    sent_at: float
    sent_mono: float
    statuses: list[AttemptStatus]
    reply: ServerReply | None = None
    validations: list = field(default_factory=list)  # issue 10: the reports (ValidationReport) this request carried
    error: Exception | None = None


@dataclass(frozen=True)
class AgentOptions:
    """Everything an agent is configured with (``hai agent`` options, or a test's keywords).

    ``fake_gpus`` N: N fake GPUs (their utilisation follows the running ranks); None: NVML.
    ``gpu_indices``: use only these NVML GPUs (default: env HAI_AGENT_GPUS="0,1", else all) —
    e.g. two agents on one host standing for two nodes.
    ``checkpoint_root``: where HAI_CHECKPOINT_DIR lives (default: env HAI_CHECKPOINT_ROOT, else
    <state_dir>/jobs); set it to a shared filesystem so a job can resume on another node.
    ``heartbeat_wait_s``: long-poll time; rank exits, suspend_ready and checkpoints are reported
    at once regardless, progress within ``status_refresh_s``.
    ``log_drain_s``: an attempt whose ranks ended is reported finished once its last log lines
    have been delivered, or after this long (a server that takes no logs).
    ``stop_jobs_on_exit``: stop the ranks when the agent exits (dev mode); by default they keep
    running and a restarted agent reattaches to them.
    """

    server: str
    token: str
    node: str
    state_dir: str
    zone: str | None = None
    leaf: str | None = None
    fake_gpus: int | None = None
    gpu_indices: list[int] | None = None
    address: str | None = None
    heartbeat_wait_s: float = 10.0
    checkpoint_root: str | None = None
    kill_grace_s: float = 10.0
    log_drain_s: float = 10.0
    stop_jobs_on_exit: bool = False
    backoff_max_s: float = 10.0
    log_buffer_lines: int = 10000
    status_refresh_s: float = 5.0
    sysfs: str = "/sys"
    inject_faults: tuple[str, ...] | None = None  # fake GPUs: KIND[@SECONDS] (agent/faults.py; issue 10)
    user_map: str | None = None  # issue 13: ranks run as the submitter's Unix account (agent/users.py)
    ranks_as_agent_user: bool = False  # development: no user map, ranks as the agent's user even as root

    def gpu_backend(self) -> GpuBackend:
        indices = self.gpu_indices
        if indices is None and os.environ.get("HAI_AGENT_GPUS"):
            indices = [int(x) for x in os.environ["HAI_AGENT_GPUS"].split(",") if x.strip()]
        return make_gpu_backend(fake_gpus=self.fake_gpus, node=self.node, indices=indices)


@dataclass(frozen=True)
class Periodic:
    """A round the agent runs in its own thread every ``period_s`` (sooner again while ``fn``
    returns True: more work is waiting)."""

    name: str
    fn: Callable[[], object]
    period_s: float


class Agent:
    """One node's agent. ``run()`` holds the heartbeat loop (``_reporter``: register, heartbeats,
    applying replies) in the caller's thread; the other rounds (supervision, log tailing) are
    the ``periodic`` list, one thread each: add a round there (a validator, a fault injector)."""

    def __init__(self, options: AgentOptions, *, gpus: GpuBackend | None = None,
                 stop_event: threading.Event | None = None):
        o = self.options = options
        self.server = o.server
        self.token = o.token
        self.node_name = o.node
        self.zone, self.leaf = o.zone, o.leaf
        self.address = o.address or detect_address(o.server.split(",")[0].strip())
        self.wait_s = max(0.0, min(60.0, o.heartbeat_wait_s))
        self.stop = stop_event or threading.Event()
        self.stop_jobs_on_exit = o.stop_jobs_on_exit
        self.backoff = Backoff(cap_s=o.backoff_max_s)
        self.backoff_max_s = o.backoff_max_s
        self.gpus = gpus if gpus is not None else o.gpu_backend()
        self.nics = discover_nics(o.sysfs)
        self.buf = LogBuffer(max_lines=o.log_buffer_lines)
        self._dirty = threading.Event()
        self._soft = threading.Event()  # progress changed: report within status_refresh_s
        self.status_refresh_s = o.status_refresh_s
        self._last_sent = 0.0
        self._wake = threading.Event()
        self.node = NodeAgent(node=o.node, state_dir=o.state_dir, gpus=self.gpus, nics=self.nics, log_buffer=self.buf,
                              checkpoint_root=o.checkpoint_root, kill_grace_s=o.kill_grace_s, sysfs=o.sysfs,
                              log_drain_s=o.log_drain_s,
                              on_change=self._changed, on_progress=self._soft.set,
                              user_map=UserMap(o.user_map) if o.user_map else None)
        self.periodic: list[Periodic] = [
            Periodic("hai-agent-supervise", self.node.tick, 0.1),
            Periodic("hai-agent-tail", lambda: self.node.tail_logs() > 0, 0.1),
        ]
        # issue 10: validator runs the server asks for, one at a time in their own thread
        self.faults = FaultPlan.parse(list(o.inject_faults)) if o.inject_faults else None
        self.validator = Validator(make_context(
            fake=self.gpus.fake, inventory=self.node.gpu_inventory, checkpoint_root=self.node.checkpoint_root,
            sysfs=o.sysfs, faults=self.faults, busy_gpus=lambda: set(self.node.busy_gpus())), on_done=self._changed)
        if self.faults is not None and self.node.gpu_inventory:  # issue 10: injected faults' effects
            effects = FaultEffects(self.faults, gpu=self.node.gpu_inventory[-1].index, pids_on=self._pids_on)
            self.periodic.append(Periodic("hai-agent-faults", effects.tick, 0.2))
        self._seq = itertools.count()
        self._seq_lock = threading.Lock()
        self.last_applied_seq = -1
        # issue 12 (protocol version 2): heartbeats towards the next own quick round; None until a
        # reply gives the period (the first round then comes 0 to every - 1 heartbeats later than
        # the period, by the node's name, as the server spreads the rounds of version 1)
        self._since_round: int | None = None
        self.digest: str | None = None
        self.interval_s = 1.0
        self.registered = False
        self.connected = False

    # -------------------------------------------------------------- helpers

    def _pids_on(self, gpu: int) -> list[int]:  # issue 10: for injected faults
        with self.node.lock:
            return [r.pid for a in self.node.attempts.values() for r in a.ranks
                    if not r.ended and r.pid is not None and gpu in r.gpus]

    def _changed(self) -> None:
        self._dirty.set()
        self._wake.set()

    def _next_seq(self) -> int:
        with self._seq_lock:
            return next(self._seq)

    def _hello(self, statuses: list[AttemptStatus]) -> AgentHello:
        return AgentHello(node=self.node_name, zone=self.zone, leaf=self.leaf, address=self.address,
                          gpus=self.node.gpu_inventory, nics=self.nics, fake_gpus=self.gpus.fake,
                          agent_version=AGENT_VERSION, attempts=statuses)

    def _exchange(self, client: AgentClient, *, register: bool, wait_s: float) -> _Result:
        seq = self._next_seq()
        sent_at, sent_mono = time.time(), time.monotonic()
        self._last_sent = sent_mono
        self._soft.clear()
        statuses = self.node.statuses()
        res = _Result(seq=seq, sent_at=sent_at, sent_mono=sent_mono, statuses=statuses)
        try:
            if register:
                res.reply = client.register(self._hello(statuses))
            else:
                reports = self.validator.reports()  # issue 10
                res.validations = reports
                hb = Heartbeat(node=self.node_name, gpus=self.node.gpu_metrics(), attempts=statuses,
                               wait_s=wait_s, assignments_digest=self.digest, validations=reports)
                res.reply = client.heartbeat(hb)
        except Exception as e:  # classified by _handle
            res.error = e
        return res

    def _handle(self, res: _Result) -> float | None:
        """Apply a reply (or note an error). Returns the backoff delay after an error."""
        if res.error is not None:
            e = res.error
            if isinstance(e, ProtocolVersionUnsupported):
                raise e
            if isinstance(e, Rejected):
                log.error("the server refused the agent's message: %s", e)
                if e.status in (401, 403):
                    log.error("check the agent token (--token)")
            elif self.connected or self.backoff.n == 0:
                log.warning("server %s unreachable (%s); jobs keep running, retrying", self.server, e)
            else:
                log.debug("server still unreachable: %s", e)
            self.connected = False
            return self.backoff.next()
        if not self.connected:
            log.info("connected to %s as node %s", self.server, self.node_name)
        self.connected = True
        self.backoff.reset()
        reply = res.reply
        assert reply is not None
        try:
            return self._apply_reply(res, reply)
        except OSError as e:
            # the node's own trouble (a full state folder, issue 13): the agent keeps running and
            # heartbeating; the reply is applied again with the next one (replies are idempotent)
            log.error("could not apply the server's reply: %s", e)
            return None

    def _count_round(self, res: _Result, reply: ServerReply) -> None:
        """The server's rule for periodic quick rounds (``node_health.on_heartbeat``), kept by the
        agent from protocol version 2: every ``quick_every_heartbeats`` answered heartbeats that
        delivered no results, counted only while no run is under way; the round starts then."""
        every = reply.quick_every_heartbeats
        if every <= 0 or res.validations:
            return
        if self._since_round is None:
            self._since_round = -round_phase(self.node_name, every)
        if self.validator.busy() or reply.validations:
            return
        self._since_round += 1
        if self._since_round >= every and self.validator.own_round(self.node.gpu_inventory):
            self._since_round = 0

    def _apply_reply(self, res: _Result, reply: ServerReply) -> float | None:
        self.node.mark_reported(res.statuses)
        if not reply.reregister:  # issue 10: delivered reports, new validation runs
            self.validator.acknowledge(res.validations, reply.validations)
            self.validator.submit(reply.validations)
            self._count_round(res, reply)
        if reply.reregister:
            log.info("the server asks this node to register again")
            self.registered = False
            return None
        if reply.lost_after_s:  # issue 13: fence before the server gives this node's work away
            self.node.renew_lease(**fence_lease(sent_at=res.sent_at, lost_after_s=reply.lost_after_s))
        if res.seq > self.last_applied_seq:
            self.last_applied_seq = res.seq
            self.digest = reply.assignments_digest
            self.interval_s = max(0.05, reply.heartbeat_interval_s)
            self.node.apply(reply.assignments, sent_at=res.sent_at)
        return None

    # -------------------------------------------------------------- threads

    def _loop(self, name: str, fn, period_s: float) -> threading.Thread:
        def run():
            while not self._threads_stop.is_set():
                busy = False
                try:
                    busy = bool(fn())
                except Exception:
                    log.exception("%s failed", name)
                if not busy:
                    self._threads_stop.wait(period_s)

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t

    def _send_logs(self, lines: list[LogLine]) -> None:
        self._log_client.logs(LogBatch(node=self.node_name, lines=lines))

    # -------------------------------------------------------------- main

    def run(self) -> None:
        installed = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                installed.append((sig, signal.signal(sig, lambda s, f: (self.stop.set(), self._wake.set()))))
        self._threads_stop = threading.Event()
        self._ship_stop = threading.Event()
        client = AgentClient(self.server, self.token)
        poll_client = AgentClient(self.server, self.token)
        self._log_client = AgentClient(self.server, self.token)
        pool = _PollThreads()
        shipper = LogShipper(self.buf, self._send_logs, stop=self._ship_stop, backoff_max_s=self.backoff_max_s,
                             shipped=self.node.shipped)
        threads = []
        try:
            self.node.recover()
            threads.extend(self._loop(p.name, p.fn, p.period_s) for p in self.periodic)
            shipper.start()
            log.info("agent %s starting: server %s, %d %sGPU(s), state dir %s", self.node_name, self.server,
                     len(self.node.gpu_inventory), "fake " if self.gpus.fake else "", self.node.state_dir)
            self._reporter(client, poll_client, pool)
        finally:
            if self.stop_jobs_on_exit:
                self._stop_jobs(client)
            self._threads_stop.set()
            for t in threads:
                t.join(timeout=5)
            try:  # last lines out, briefly
                self.node.tail_logs()
            except Exception:
                pass
            self._ship_stop.set()
            self.buf.wake()
            shipper.join(timeout=3)
            for c in (client, poll_client, self._log_client):
                c.close()
            self.gpus.close()
            for sig, old in installed:
                signal.signal(sig, old)
            log.info("agent %s stopped", self.node_name)

    def _stop_jobs(self, client: AgentClient) -> None:
        self.node.stop_all()
        deadline = time.monotonic() + self.node.kill_grace_s + 10
        while (self.node.running() or self.node.settling()) and time.monotonic() < deadline:
            self.node.tick()
            self._threads_stop.wait(0.05)
        self.node.tick()
        if self.registered:  # report the final statuses once, best effort
            res = self._exchange(client, register=False, wait_s=0.0)
            if res.error is None:
                self.node.mark_reported(res.statuses)

    def _reporter(self, client: AgentClient, poll_client: AgentClient, pool: _PollThreads) -> None:
        poll: Future | None = None
        next_poll = 0.0  # monotonic time of the next long poll
        next_urgent = 0.0
        in_backoff = False
        while not self.stop.is_set():
            self._wake.clear()
            now = time.monotonic()
            if not self.registered:
                if now < next_poll:
                    self._wake.wait(next_poll - now)
                    continue
                res = self._exchange(client, register=True, wait_s=0)
                if res.error is None:
                    self.registered = True
                    log.info("registered node %s (%s) at %s", self.node_name, self.address, self.server)
                delay = self._handle(res)
                if delay is not None:
                    next_poll = time.monotonic() + delay
                    in_backoff = True
                else:
                    next_poll = 0.0
                    in_backoff = False
                continue
            if self._soft.is_set() and now - self._last_sent >= self.status_refresh_s:
                self._dirty.set()  # progress waited long enough: report it now
            if poll is None and self._dirty.is_set() and not in_backoff:
                next_poll = min(next_poll, now)
            if poll is None and now >= next_poll:
                self._dirty.clear()
                poll = pool.submit(self._exchange, poll_client, register=False, wait_s=self.wait_s)
                poll.add_done_callback(lambda f: self._wake.set())
            elif poll is not None and self._dirty.is_set() and now >= next_urgent and self.connected:
                self._dirty.clear()
                next_urgent = now + 0.05
                res = self._exchange(client, register=False, wait_s=0.0)
                delay = self._handle(res)
                if delay is not None:
                    in_backoff = True
            if poll is not None and poll.done():
                res = poll.result()
                poll = None
                delay = self._handle(res)
                if delay is not None:
                    next_poll = time.monotonic() + delay
                    in_backoff = True
                else:
                    in_backoff = False
                    next_poll = res.sent_mono + self.interval_s
                continue
            now = time.monotonic()
            if poll is None:
                timeout = max(0.0, min(1.0, next_poll - now))
            else:  # a long poll is in flight: wake for urgent reports (never spin)
                timeout = 1.0
                if self.connected and self._dirty.is_set():
                    timeout = max(0.01, next_urgent - now)
                elif self.connected and self._soft.is_set():
                    timeout = max(0.01, min(1.0, self._last_sent + self.status_refresh_s - now))
            if timeout > 0:
                self._wake.wait(timeout)


class _PollThreads:
    """Runs the long poll, one call at a time, each on a daemon thread of its own.

    Not a ``ThreadPoolExecutor``: the interpreter joins an executor's workers at exit, so an
    agent told to stop (SIGTERM) lingered until its long poll returned, up to ``wait_s`` (10 s)
    after it had logged "stopped". A poll in flight at exit is abandoned instead: the server
    keeps nothing for a poll that is never answered, and the next agent registers afresh."""

    def submit(self, fn: Callable[..., _Result], *args, **kwargs) -> Future:
        fut: Future = Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # (handed to whoever reads the future)
                fut.set_exception(e)

        threading.Thread(target=run, name="hai-agent-poll", daemon=True).start()
        return fut


def run_agent(options: AgentOptions | None = None, *, stop_event: threading.Event | None = None, **fields) -> None:
    """Run a node agent until ``stop_event`` is set or SIGTERM/SIGINT (main thread only).

    Configured by ``options``, or by its fields as keywords (``run_agent(server=..., token=...,
    node=..., state_dir=..., fake_gpus=2)``); see :class:`AgentOptions`.
    Raises SystemExit with a clear message when the server refuses the protocol version (426),
    and before anything starts when it runs as root with no user map (every user's ranks would
    run as root) unless ``ranks_as_agent_user`` (development) says so.
    """
    if options is None:
        options = AgentOptions(**fields)
    elif fields:
        options = replace(options, **fields)
    refusal = root_without_user_map(os.geteuid(), options.user_map, options.ranks_as_agent_user)
    if refusal:
        raise SystemExit(f"hai agent: {refusal}")
    agent = Agent(options, stop_event=stop_event)
    try:
        agent.run()
    except ProtocolVersionUnsupported as e:
        log.error("%s", e)
        raise SystemExit(f"hai agent: {e}") from None
