"""The agent's node state: the attempts it holds, applying the server's assignments, supervising
the ranks (exits, suspend handshake, deadlines, SIGTERM -> SIGKILL), the state directory that
lets a restarted agent reattach, and the AttemptStatus reports. No networking here (main.py).

State directory::

    <state_dir>/attempts/<job>-<attempt>/attempt.json   the record (spec, pids, start times, ...)
                                        /logstate.json  log read offsets + seq counters
                                        /ranks/<rank>.stdout|.stderr|.exit|.pid
                                        /control/       HAI_CONTROL_DIR (suspend, events.<rank>.jsonl)
    <state_dir>/done/<job>-<attempt>.json               final status of a forgotten attempt
    <checkpoint_root>/<job>/checkpoints/                 HAI_CHECKPOINT_DIR (outlives attempts)

Thread-safety: every public method takes ``self.lock``; ``tail_logs`` runs in its own thread and
only touches the tail state (guarded by ``self._tail_lock``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hai.agent import launcher
from hai.agent.gpu import GpuBackend
from hai.agent.logs import AttemptTail, LogBuffer, RankTail, StreamTail, tail_attempt
from hai.agent.procs import SIGKILL_EXIT, exit_code_from_returncode, is_alive, signal_group
from hai.protocol import (
    Assignment,
    AttemptStatus,
    CheckpointInfo,
    DesiredAction,
    GpuMetrics,
    LaunchSpec,
    NicInfo,
    ProgressInfo,
    RankStatus,
    StopCause,
)

log = logging.getLogger("hai.agent")

READY_EXIT_WINDOW_S = 2.0  # after suspend_ready(), ranks get this long to exit by themselves
TOMBSTONE_TTL_S = 7 * 24 * 3600
SUSPEND_FILE = "suspend"


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


@dataclass
class Rank:
    rank: int
    local_rank: int
    gpus: list[int]
    pid: int | None = None
    start_ticks: int | None = None
    ended: bool = False
    exit_code: int | None = None
    ready_at: float | None = None  # when this rank called suspend_ready()
    popen: object | None = field(default=None, repr=False)  # subprocess.Popen when we launched it

    def to_json(self) -> dict:
        return {"rank": self.rank, "local_rank": self.local_rank, "gpus": self.gpus, "pid": self.pid,
                "start_ticks": self.start_ticks, "ended": self.ended, "exit_code": self.exit_code}

    @classmethod
    def from_json(cls, d: dict) -> Rank:
        return cls(rank=d["rank"], local_rank=d["local_rank"], gpus=list(d.get("gpus", [])),
                   pid=d.get("pid"), start_ticks=d.get("start_ticks"), ended=d.get("ended", False),
                   exit_code=d.get("exit_code"))


@dataclass
class Attempt:
    job_id: int
    attempt: int
    spec: LaunchSpec
    dir: Path
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    ranks: list[Rank] = field(default_factory=list)
    launch_error: str | None = None
    suspend_requested_at: float | None = None
    ready_at: float | None = None
    stop_cause: StopCause | str | None = None
    stopped_reason: str | None = None
    term_sent_at: float | None = None
    kill_sent: bool = False
    finished: bool = False
    checkpoint: CheckpointInfo | None = None
    progress: ProgressInfo | None = None
    # not persisted
    assigned: DesiredAction | str | None = "unknown"  # the action of the last applied reply; None: not assigned
    final_reported: bool = False
    drained: bool = False
    attached_at: float = 0.0  # when this agent process took charge (launch or reattach)
    tail: AttemptTail | None = field(default=None, repr=False)
    event_offsets: dict[str, int] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, int]:
        return (self.job_id, self.attempt)

    @property
    def control_dir(self) -> Path:
        return self.dir / "control"

    @property
    def ranks_dir(self) -> Path:
        return self.dir / "ranks"

    def rank_path(self, rank: int, what: str) -> Path:
        return self.ranks_dir / f"{rank}.{what}"

    @property
    def stopping(self) -> bool:
        return self.term_sent_at is not None

    def to_json(self) -> dict:
        return {
            "job_id": self.job_id, "attempt": self.attempt, "spec": self.spec.model_dump(mode="json"),
            "created_at": self.created_at, "started_at": self.started_at, "finished_at": self.finished_at,
            "ranks": [r.to_json() for r in self.ranks], "launch_error": self.launch_error,
            "suspend_requested_at": self.suspend_requested_at, "ready_at": self.ready_at,
            "stop_cause": self.stop_cause, "stopped_reason": self.stopped_reason,
            "term_sent_at": self.term_sent_at, "kill_sent": self.kill_sent, "finished": self.finished,
        }

    @classmethod
    def from_json(cls, d: dict, dir: Path) -> Attempt:
        return cls(
            job_id=d["job_id"], attempt=d["attempt"], spec=LaunchSpec.model_validate(d["spec"]), dir=dir,
            created_at=d.get("created_at", 0.0), started_at=d.get("started_at"),
            finished_at=d.get("finished_at"), ranks=[Rank.from_json(r) for r in d.get("ranks", [])],
            launch_error=d.get("launch_error"), suspend_requested_at=d.get("suspend_requested_at"),
            ready_at=d.get("ready_at"), stop_cause=d.get("stop_cause"),
            stopped_reason=d.get("stopped_reason"), term_sent_at=d.get("term_sent_at"),
            kill_sent=d.get("kill_sent", False), finished=d.get("finished", False),
        )


class NodeAgent:
    def __init__(
        self,
        *,
        node: str,
        state_dir: str | os.PathLike,
        gpus: GpuBackend,
        nics: list[NicInfo] | None = None,
        log_buffer: LogBuffer | None = None,
        checkpoint_root: str | os.PathLike | None = None,
        kill_grace_s: float = 10.0,
        sysfs: str = "/sys",
        on_change: Callable[[], None] | None = None,
        on_progress: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.node = node
        self.state_dir = Path(state_dir).resolve()
        self.gpus = gpus
        self.gpu_inventory = gpus.inventory()
        self.nics = list(nics or [])
        self.buf = log_buffer if log_buffer is not None else LogBuffer()
        root = checkpoint_root or os.environ.get("HAI_CHECKPOINT_ROOT") or (self.state_dir / "jobs")
        self.checkpoint_root = Path(root).resolve()
        self.kill_grace_s = kill_grace_s
        self.sysfs = sysfs
        self.on_change = on_change or (lambda: None)  # worth reporting at once
        self.on_progress = on_progress or (lambda: None)  # worth reporting soon (progress)
        self.clock = clock
        self.lock = threading.RLock()
        self._tail_lock = threading.Lock()
        self.attempts: dict[tuple[int, int], Attempt] = {}
        self.pending: dict[tuple[int, int], Assignment] = {}  # waiting for their GPUs to be free
        self.ghosts: dict[tuple[int, int], AttemptStatus] = {}  # forgotten but assigned again
        self.launches = 0  # attempts launched by this agent process (tests: never twice)
        self.attempts_dir = self.state_dir / "attempts"
        self.done_dir = self.state_dir / "done"
        self.attempts_dir.mkdir(parents=True, exist_ok=True)
        self.done_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ persistence

    def _save(self, att: Attempt) -> None:
        _write_json_atomic(att.dir / "attempt.json", att.to_json())

    def _tombstone_path(self, key: tuple[int, int]) -> Path:
        return self.done_dir / f"{key[0]}-{key[1]}.json"

    def _read_tombstone(self, key: tuple[int, int]) -> AttemptStatus | None:
        try:
            return AttemptStatus.model_validate_json(self._tombstone_path(key).read_text())
        except (OSError, ValueError):
            return None

    def recover(self) -> list[AttemptStatus]:
        """Re-read the state dir after an agent restart: reattach to live ranks, pick up the exit
        codes of ranks that ended meanwhile. Returns the statuses for AgentHello.attempts."""
        now = self.clock()
        with self.lock:
            for p in sorted(self.done_dir.glob("*.json")):
                try:
                    if now - p.stat().st_mtime > TOMBSTONE_TTL_S:
                        p.unlink()
                except OSError:
                    pass
            for d in sorted(self.attempts_dir.iterdir()):
                f = d / "attempt.json"
                if not f.is_file():
                    shutil.rmtree(d, ignore_errors=True)  # crashed before the record existed
                    continue
                try:
                    att = Attempt.from_json(json.loads(f.read_text()), d)
                except (OSError, ValueError, KeyError) as e:
                    log.error("cannot read %s (%s); leaving it alone", f, e)
                    continue
                att.attached_at = now
                self._reattach(att)
                self.attempts[att.key] = att
                log.info("reattached job %s attempt %s: %s", att.job_id, att.attempt,
                         ", ".join(f"rank {r.rank} " + ("exited %s" % r.exit_code if r.ended else f"pid {r.pid}")
                                   for r in att.ranks) or "no ranks")
            return self.statuses()

    def _reattach(self, att: Attempt) -> None:
        never_started = []
        for r in att.ranks:
            if r.ended:
                continue
            if r.pid is None:  # agent died between spawn and record: the wrapper wrote its pid
                try:
                    info = json.loads(att.rank_path(r.rank, "pid").read_text())
                    r.pid, r.start_ticks = info["pid"], info.get("start_ticks")
                except (OSError, ValueError, KeyError):
                    pass
            if r.pid is None:
                code = self._read_exit(att, r)
                r.ended = True
                r.exit_code = code
                if code is None:
                    never_started.append(r.rank)
                continue
            if not is_alive(r.pid, r.start_ticks):
                r.ended = True
                code = self._read_exit(att, r)
                r.exit_code = code if code is not None else SIGKILL_EXIT
        if never_started and att.launch_error is None:
            att.launch_error = f"the agent restarted while launching; rank(s) {never_started} never started"
        att.tail = self._make_tail(att)
        att.tail.load()
        if all(r.ended for r in att.ranks) and not att.finished:
            att.finished = True
            att.finished_at = self.clock()
        self._save(att)

    # ------------------------------------------------------------------ assignments

    def apply(self, assignments: list[Assignment], *, sent_at: float | None = None) -> None:
        """Apply the full desired set for this node (idempotent). ``sent_at``: when the request
        this reply answers was sent; attempts launched after that are not judged by it."""
        with self.lock:
            wanted = {(a.job_id, a.attempt): a for a in assignments}
            for key, a in wanted.items():
                att = self.attempts.get(key)
                if att is None:
                    if key in self.pending:
                        if a.action == DesiredAction.RUN:
                            self.pending[key] = a
                            continue
                        del self.pending[key]
                        self._not_launched(a)
                        continue
                    if key in self.ghosts:
                        continue
                    ghost = self._read_tombstone(key)
                    if ghost is not None:  # finished and forgotten: never launch it twice
                        self.ghosts[key] = ghost
                        continue
                    if a.action == DesiredAction.RUN:
                        self._launch_or_defer(a)
                    else:
                        self._not_launched(a)
                    continue
                att.assigned = a.action
                if att.finished:
                    continue
                if a.action == DesiredAction.STOP:
                    self._stop(att, StopCause.REQUESTED, "stop requested by the server")
                elif a.action == DesiredAction.SUSPEND:
                    if att.suspend_requested_at is None and not att.stopping:
                        self._request_suspend(att)
                elif a.action == DesiredAction.RUN:
                    if att.suspend_requested_at is not None and att.ready_at is None and not att.stopping:
                        self._cancel_suspend(att)
            for key, att in self.attempts.items():
                if key in wanted:
                    continue
                att.assigned = None
                if not att.finished and not att.stopping:
                    if sent_at is None or att.attached_at <= sent_at:
                        self._stop(att, StopCause.UNASSIGNED, "the server no longer assigns this attempt")
            for key in [k for k in self.pending if k not in wanted]:
                del self.pending[key]
            for key in [k for k in self.ghosts if k not in wanted]:
                del self.ghosts[key]
            self._forget_done()

    def _not_launched(self, a: Assignment) -> None:
        """stop/suspend for an attempt this node never launched: report that nothing ran here
        (and remember it, so a stale 'run' can never launch it afterwards)."""
        now = self.clock()
        st = AttemptStatus(job_id=a.job_id, attempt=a.attempt, finished=True, stop_cause=StopCause.NOT_LAUNCHED,
                           stopped_reason=f"{a.action} arrived before this node launched the attempt",
                           finished_at=now)
        key = (a.job_id, a.attempt)
        self._tombstone_path(key).write_text(st.model_dump_json())
        self.ghosts[key] = st
        self.on_change()

    def _gpus_in_use(self) -> set[int]:
        used: set[int] = set()
        for att in self.attempts.values():
            for r in att.ranks:
                if not r.ended:
                    used.update(r.gpus)
        return used

    def _launch_or_defer(self, a: Assignment) -> None:
        busy = self._gpus_in_use() & set(a.spec.gpus)
        if busy:
            # an earlier attempt is still stopping on these GPUs: launch once they are free
            if (a.job_id, a.attempt) not in self.pending:
                log.info("job %s attempt %s waits for GPUs %s", a.job_id, a.attempt, sorted(busy))
            self.pending[(a.job_id, a.attempt)] = a
            return
        self.pending.pop((a.job_id, a.attempt), None)
        self._launch(a)

    def checkpoint_dir(self, job_id: int) -> Path:
        return self.checkpoint_root / str(job_id) / "checkpoints"

    def _make_tail(self, att: Attempt) -> AttemptTail:
        t = AttemptTail(job_id=att.job_id, attempt=att.attempt, state_path=str(att.dir / "logstate.json"))
        for r in att.ranks:
            t.ranks[r.rank] = RankTail(rank=r.rank, streams=[
                StreamTail(path=str(att.rank_path(r.rank, "stdout")), stream="stdout"),
                StreamTail(path=str(att.rank_path(r.rank, "stderr")), stream="stderr"),
            ])
        return t

    def _launch(self, a: Assignment) -> None:
        now = self.clock()
        spec = a.spec
        d = self.attempts_dir / f"{a.job_id}-{a.attempt}"
        if d.exists():  # leftovers of a launch that crashed before its record: start clean
            shutil.rmtree(d, ignore_errors=True)
        att = Attempt(job_id=a.job_id, attempt=a.attempt, spec=spec, dir=d, created_at=now,
                      assigned=a.action, attached_at=now)
        att.control_dir.mkdir(parents=True, exist_ok=True)
        att.ranks_dir.mkdir(parents=True, exist_ok=True)
        ckpt = self.checkpoint_dir(a.job_id)
        self.attempts[att.key] = att
        self.launches += 1
        try:
            ckpt.mkdir(parents=True, exist_ok=True)
            plans = launcher.plan_ranks(
                spec, job_id=a.job_id, attempt=a.attempt, node=self.node, node_gpus=self.gpu_inventory,
                nics=self.nics, control_dir=str(att.control_dir), checkpoint_dir=str(ckpt), sysfs=self.sysfs,
            )
            cwd = spec.cwd
            if cwd is not None and not os.path.isdir(cwd):
                raise launcher.LaunchError(f"working directory {cwd} does not exist")
            launcher.check_executable(spec.command[0], plans[0].env, cwd)
        except (launcher.LaunchError, OSError) as e:
            att.launch_error = str(e)
            att.finished = True
            att.finished_at = now
            att.tail = self._make_tail(att)
            self._save(att)
            log.warning("job %s attempt %s cannot be launched: %s", a.job_id, a.attempt, e)
            self.on_change()
            return
        att.ranks = [Rank(rank=p.rank, local_rank=p.local_rank, gpus=p.gpus) for p in plans]
        att.tail = self._make_tail(att)
        self._save(att)  # the record exists before any process does
        att.started_at = self.clock()
        for plan, r in zip(plans, att.ranks):
            try:
                proc = launcher.spawn_rank(
                    plan, cwd=cwd, stdout_path=str(att.rank_path(r.rank, "stdout")),
                    stderr_path=str(att.rank_path(r.rank, "stderr")),
                    exit_path=str(att.rank_path(r.rank, "exit")), pid_path=str(att.rank_path(r.rank, "pid")),
                )
            except OSError as e:
                att.launch_error = f"rank {r.rank} could not be started: {e}"
                r.ended = True
                for other in att.ranks:
                    if other.pid is None and not other.ended:
                        other.ended = True
                break
            r.pid, r.start_ticks, r.popen = proc.pid, proc.start_ticks, proc.popen
        self._save(att)
        log.info("launched job %s attempt %s (%s, %d rank(s) here: %s)", a.job_id, a.attempt, spec.job_type,
                 len(att.ranks), ", ".join(f"rank {r.rank} pid {r.pid}" for r in att.ranks))
        if att.launch_error:
            self._stop(att, StopCause.RANK_FAILED, att.launch_error)
        if a.action == DesiredAction.SUSPEND:
            self._request_suspend(att)
        elif a.action == DesiredAction.STOP:
            self._stop(att, StopCause.REQUESTED, "stop requested by the server")
        self.on_change()

    # ------------------------------------------------------------------ suspend / stop

    def _request_suspend(self, att: Attempt) -> None:
        att.suspend_requested_at = self.clock()
        _write_json_atomic(att.control_dir / SUSPEND_FILE,
                           {"requested_at": att.suspend_requested_at, "grace_s": att.spec.suspend_grace_s})
        self._save(att)
        log.info("job %s attempt %s: suspend requested (grace %ss)", att.job_id, att.attempt,
                 att.spec.suspend_grace_s)
        self.on_change()

    def _cancel_suspend(self, att: Attempt) -> None:
        try:
            (att.control_dir / SUSPEND_FILE).unlink()
        except FileNotFoundError:
            pass
        att.suspend_requested_at = None
        self._save(att)
        self.on_change()

    def _stop(self, att: Attempt, cause: str, reason: str) -> None:
        """SIGTERM to every live rank's process group; SIGKILL follows after the grace (tick)."""
        if att.stopping or att.finished:
            return
        att.stop_cause = cause
        att.stopped_reason = reason
        att.term_sent_at = self.clock()
        for r in att.ranks:
            if not r.ended and r.pid is not None and self._rank_alive(r):
                launcher.terminate(r.pid)
        self._save(att)
        log.info("job %s attempt %s: stopping (%s)", att.job_id, att.attempt, reason)
        self.on_change()

    def _grace(self, att: Attempt) -> float:
        return att.spec.stop_grace_s if att.spec.stop_grace_s is not None else self.kill_grace_s

    # ------------------------------------------------------------------ supervision

    def _rank_alive(self, r: Rank) -> bool:
        if r.popen is not None:
            return r.popen.poll() is None  # type: ignore[attr-defined]
        return r.pid is not None and is_alive(r.pid, r.start_ticks)

    def _read_exit(self, att: Attempt, r: Rank) -> int | None:
        try:
            return int(json.loads(att.rank_path(r.rank, "exit").read_text())["exit_code"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _poll_rank(self, att: Attempt, r: Rank) -> bool:
        """True when the rank has just ended."""
        if r.ended or r.pid is None:
            return False
        if r.popen is not None:
            rc = r.popen.poll()  # type: ignore[attr-defined]
            if rc is None:
                return False
            code = self._read_exit(att, r)
            r.exit_code = code if code is not None else exit_code_from_returncode(rc)
            # the wrapper cleans up after its command; if the wrapper itself was killed, sweep
            signal_group(r.pid, 9)
        else:
            if is_alive(r.pid, r.start_ticks):
                return False
            code = self._read_exit(att, r)
            r.exit_code = code if code is not None else SIGKILL_EXIT
        r.ended = True
        r.popen = None
        return True

    def _read_events(self, att: Attempt) -> bool:
        changed = False
        try:
            names = sorted(p.name for p in att.control_dir.iterdir() if p.name.startswith("events."))
        except OSError:
            return False
        for name in names:
            path = att.control_dir / name
            off = att.event_offsets.get(name, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(off)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            att.event_offsets[name] = off + end + 1
            for raw in data[: end + 1].splitlines():
                try:
                    ev = json.loads(raw)
                except ValueError:
                    continue
                changed |= self._apply_event(att, ev)
        return changed

    def _apply_event(self, att: Attempt, ev: dict) -> bool:
        kind = ev.get("type")
        at = float(ev.get("at") or self.clock())
        try:
            if kind == "checkpoint":
                ck = CheckpointInfo(path=str(ev["path"]), step=ev.get("step"), at=at,
                                    duration_s=ev.get("duration_s"))
                if att.checkpoint is None or ck.at >= att.checkpoint.at:
                    att.checkpoint = ck
                    return True
            elif kind == "progress":
                pr = ProgressInfo(step=int(ev["step"]), total=ev.get("total"), at=at,
                                  metrics={k: float(v) for k, v in (ev.get("metrics") or {}).items()
                                           if isinstance(v, (int, float))})
                if att.progress is None or pr.at >= att.progress.at:
                    att.progress = pr
                    self.on_progress()
                return False  # not urgent: reported within the agent's status refresh period
            elif kind == "suspend_ready":
                rank = int(ev.get("rank", 0))
                for r in att.ranks:
                    if r.rank == rank and r.ready_at is None:
                        r.ready_at = at
                        return True
        except (KeyError, ValueError, TypeError):
            log.debug("ignoring malformed event %r", ev)
        return False

    def _suspend_ready_now(self, att: Attempt) -> bool:
        if att.suspend_requested_at is None:
            return False
        # SDK and agent clocks are the same host clock; allow a little slack anyway
        return any(r.ready_at is not None and r.ready_at >= att.suspend_requested_at - 1.0 for r in att.ranks)

    def tick(self) -> None:
        """One supervision round: rank exits, SDK events, suspend handshake, deadlines."""
        with self.lock:
            now = self.clock()
            for att in list(self.attempts.values()):
                if att.finished:
                    continue
                changed = notify = False
                for r in att.ranks:
                    if self._poll_rank(att, r):
                        changed = notify = True
                        log.info("job %s attempt %s rank %s exited with code %s", att.job_id, att.attempt,
                                 r.rank, r.exit_code)
                if self._read_events(att):
                    notify = True
                if att.suspend_requested_at is not None and att.ready_at is None and self._suspend_ready_now(att):
                    att.ready_at = now
                    changed = notify = True
                    log.info("job %s attempt %s: suspend_ready()", att.job_id, att.attempt)
                if not att.stopping:
                    failed = [r for r in att.ranks if r.ended and r.exit_code not in (0, None)]
                    alive = [r for r in att.ranks if not r.ended]
                    if failed and alive:
                        r0 = failed[0]
                        self._stop(att, StopCause.RANK_FAILED, f"rank {r0.rank} exited with code {r0.exit_code}")
                    elif att.ready_at is not None and alive:
                        if now - att.ready_at >= min(READY_EXIT_WINDOW_S, self._grace(att)):
                            self._stop(att, StopCause.SUSPEND, "stopped after the job called suspend_ready()")
                    elif att.suspend_requested_at is not None and alive and att.ready_at is None:
                        if now - att.suspend_requested_at >= att.spec.suspend_grace_s:
                            self._stop(att, StopCause.SUSPEND_TIMEOUT,
                                       f"the job did not call suspend_ready() within suspend_grace_s="
                                       f"{att.spec.suspend_grace_s:g}s")
                if not att.stopping and att.started_at is not None and any(not r.ended for r in att.ranks):
                    ms = att.spec.max_runtime_s
                    if ms is not None and now - att.started_at >= ms:
                        self._stop(att, StopCause.MAX_RUNTIME, f"max_runtime_s={ms:g}s exceeded")
                    wd = att.spec.log_watchdog_s
                    if wd is not None and not att.stopping:
                        last = max(att.started_at, att.attached_at,
                                   (att.tail.last_output_at or 0.0) if att.tail else 0.0)
                        if now - last >= wd:
                            self._stop(att, StopCause.LOG_WATCHDOG, f"no output for log_watchdog_s={wd:g}s")
                if att.stopping and not att.kill_sent and now - (att.term_sent_at or now) >= self._grace(att):
                    for r in att.ranks:
                        if not r.ended and r.pid is not None and self._rank_alive(r):
                            launcher.kill(r.pid)
                    att.kill_sent = True
                    changed = True
                    log.info("job %s attempt %s: SIGKILL after %gs grace", att.job_id, att.attempt,
                             self._grace(att))
                if att.ranks and all(r.ended for r in att.ranks):
                    att.finished = True
                    att.finished_at = now
                    changed = notify = True
                    log.info("job %s attempt %s finished on this node", att.job_id, att.attempt)
                if changed:
                    self._save(att)
                if notify:
                    self.on_change()
            for key, a in list(self.pending.items()):
                if key not in self.attempts:
                    self._launch_or_defer(a)
            self._forget_done()

    # ------------------------------------------------------------------ logs

    def tail_logs(self) -> int:
        """One tail round over every attempt's rank files; returns the number of lines read."""
        with self.lock:
            atts = [(a, a.finished) for a in self.attempts.values() if a.tail is not None]
        total = 0
        with self._tail_lock:
            for att, final in atts:
                if att.drained or att.key not in self.attempts:
                    continue
                try:
                    n, drained = tail_attempt(att.tail, self.buf, final=final, now=self.clock)
                except OSError as e:
                    log.debug("tailing job %s attempt %s: %s", att.job_id, att.attempt, e)
                    continue
                total += n
                if final and drained:
                    att.drained = True
        return total

    # ------------------------------------------------------------------ forgetting

    def _forget_done(self) -> None:
        for key, att in list(self.attempts.items()):
            if not (att.finished and att.final_reported and att.assigned is None and att.drained):
                continue
            with self._tail_lock:
                st = self._status(att)
                self._tombstone_path(key).write_text(st.model_dump_json())
                shutil.rmtree(att.dir, ignore_errors=True)
                del self.attempts[key]
            log.info("forgot job %s attempt %s", att.job_id, att.attempt)

    # ------------------------------------------------------------------ reports

    def _status(self, att: Attempt) -> AttemptStatus:
        return AttemptStatus(
            job_id=att.job_id, attempt=att.attempt,
            ranks=[RankStatus(rank=r.rank, local_rank=r.local_rank, pid=r.pid,
                              state="exited" if r.ended else "running", exit_code=r.exit_code)
                   for r in att.ranks],
            launch_error=att.launch_error, suspend_ready=att.ready_at is not None,
            stopped_reason=att.stopped_reason, checkpoint=att.checkpoint, progress=att.progress,
            finished=att.finished, stop_cause=att.stop_cause, started_at=att.started_at,
            finished_at=att.finished_at, suspend_requested_at=att.suspend_requested_at,
        )

    def statuses(self) -> list[AttemptStatus]:
        with self.lock:
            out = [self._status(a) for _, a in sorted(self.attempts.items())]
            for key, a in sorted(self.pending.items()):
                out.append(AttemptStatus(job_id=a.job_id, attempt=a.attempt))
            out.extend(st for _, st in sorted(self.ghosts.items()))
            return out

    def mark_reported(self, statuses: list[AttemptStatus]) -> None:
        """The server has these statuses; final ones need not be kept once unassigned."""
        with self.lock:
            for st in statuses:
                att = self.attempts.get((st.job_id, st.attempt))
                if att is not None and st.finished and att.finished:
                    att.final_reported = True
            self._forget_done()

    def busy_gpus(self) -> dict[int, int]:
        with self.lock:
            busy: dict[int, int] = {}
            for att in self.attempts.values():
                for r in att.ranks:
                    if not r.ended and r.pid is not None:
                        for g in r.gpus:
                            busy[g] = busy.get(g, 0) + 1
            return busy

    def gpu_metrics(self) -> list[GpuMetrics]:
        return self.gpus.metrics(self.busy_gpus())

    # ------------------------------------------------------------------ shutdown

    def stop_all(self, reason: str = "the agent is shutting down") -> None:
        with self.lock:
            for att in self.attempts.values():
                self._stop(att, StopCause.REQUESTED, reason)

    def running(self) -> bool:
        with self.lock:
            return any(not r.ended for a in self.attempts.values() for r in a.ranks)
