"""The attempts an agent holds and their state folder: the records (what was launched, pids,
start times, the stop in progress), the SDK's control files, the tombstones of forgotten
attempts, and the recovery that lets a restarted agent reattach. No supervision decisions here
(``supervision.py``) and no networking (``main.py``).

State directory::

    <state_dir>/attempts/<job>-<attempt>/attempt.json   the record (spec, pids, start times, ...)
                                        /logstate.json  log read offsets + seq counters
                                        /ranks/<rank>.stdout|.stderr|.exit|.pid
                                        /control/       HAI_CONTROL_DIR (suspend, events.<rank>.jsonl)
    <state_dir>/done/<job>-<attempt>.json               final status of a forgotten attempt
    <checkpoint_root>/<job>/checkpoints/                 HAI_CHECKPOINT_DIR (outlives attempts)

A record is written before any process of the attempt exists, and after every change worth
surviving a restart; a tombstone is written before an attempt's folder is removed, so a stale
``run`` can never launch a finished attempt twice.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from hai.agent.logs import AttemptTail, RankTail, StreamTail
from hai.agent.procs import SIGKILL_EXIT, is_alive, signal_group
from hai.protocol import (
    AttemptStatus,
    CheckpointInfo,
    DesiredAction,
    LaunchSpec,
    ProgressInfo,
    RankStatus,
    StopCause,
)
from hai.sdk.core import SUSPEND_FILE  # the control file the SDK's should_suspend() looks for

log = logging.getLogger("hai.agent")

TOMBSTONE_TTL_S = 7 * 24 * 3600

Key = tuple[int, int]  # (job id, attempt)


FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_full(e: BaseException) -> bool:
    """The filesystem is full (or the quota used up): ENOSPC / EDQUOT."""
    return isinstance(e, OSError) and e.errno in FULL_ERRNOS


def write_json_atomic(path: Path, data: dict, *, mode: int = 0o644) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as f:
            os.fchmod(f.fileno(), mode)
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        try:  # a full disk leaves no half-written temporary behind
            tmp.unlink()
        except OSError:
            pass
        raise


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


def _cause(value: str | None) -> StopCause | str | None:
    try:
        return StopCause(value) if value is not None else None
    except ValueError:
        return value


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
    storage_errors: list[str] = field(default_factory=list)  # issue 13: the SDK's StorageFull reports
    # not persisted
    assigned: DesiredAction | str | None = "unknown"  # the action of the last applied reply; None: not assigned
    final_reported: bool = False
    drained: bool = False
    ended_at: float | None = None  # every rank had ended (finished waits for their last log lines)
    log_mark: int | None = None  # the log buffer's position after the last line of the attempt
    attached_at: float = 0.0  # when this agent process took charge (launch or reattach)
    blind_at: float | None = None  # issue 13: last seen with the log folder full (output unseeable)
    tail: AttemptTail | None = field(default=None, repr=False)
    event_offsets: dict[str, int] = field(default_factory=dict)

    @property
    def key(self) -> Key:
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

    @property
    def alive_ranks(self) -> list[Rank]:
        return [r for r in self.ranks if not r.ended]

    @property
    def last_output_at(self) -> float | None:
        return self.tail.last_output_at if self.tail is not None else None

    def make_tail(self) -> AttemptTail:
        t = AttemptTail(job_id=self.job_id, attempt=self.attempt, state_path=str(self.dir / "logstate.json"))
        for r in self.ranks:
            t.ranks[r.rank] = RankTail(rank=r.rank, streams=[
                StreamTail(path=str(self.rank_path(r.rank, "stdout")), stream="stdout"),
                StreamTail(path=str(self.rank_path(r.rank, "stderr")), stream="stderr"),
            ])
        return t

    def read_exit(self, r: Rank) -> int | None:
        """The exit code the rank's wrapper recorded, if it did."""
        return self.read_exit_record(r)[0]

    def read_exit_record(self, r: Rank) -> tuple[int | None, bool]:
        """The exit code the rank's wrapper recorded (None: none yet), and whether the wrapper
        stopped the rank because the agent's lease ran out (rankwrap --lease), from one read."""
        try:
            record = json.loads(self.rank_path(r.rank, "exit").read_text())
            return int(record["exit_code"]), record.get("fenced") is True
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None, False

    def status(self) -> AttemptStatus:
        """The report the agent sends for this attempt."""
        return AttemptStatus(
            job_id=self.job_id, attempt=self.attempt,
            ranks=[RankStatus(rank=r.rank, local_rank=r.local_rank, pid=r.pid,
                              state="exited" if r.ended else "running", exit_code=r.exit_code)
                   for r in self.ranks],
            launch_error=self.launch_error, suspend_ready=self.ready_at is not None,
            stopped_reason=self.stopped_reason, checkpoint=self.checkpoint, progress=self.progress,
            finished=self.finished, stop_cause=self.stop_cause, started_at=self.started_at,
            finished_at=self.finished_at, suspend_requested_at=self.suspend_requested_at,
            storage_errors=list(self.storage_errors),
        )

    def to_json(self) -> dict:
        return {
            "job_id": self.job_id, "attempt": self.attempt, "spec": self.spec.model_dump(mode="json"),
            "created_at": self.created_at, "started_at": self.started_at, "finished_at": self.finished_at,
            "ranks": [r.to_json() for r in self.ranks], "launch_error": self.launch_error,
            "suspend_requested_at": self.suspend_requested_at, "ready_at": self.ready_at,
            "stop_cause": self.stop_cause, "stopped_reason": self.stopped_reason,
            "term_sent_at": self.term_sent_at, "kill_sent": self.kill_sent, "finished": self.finished,
            "storage_errors": self.storage_errors,
        }

    @classmethod
    def from_json(cls, d: dict, dir: Path) -> Attempt:
        return cls(
            job_id=d["job_id"], attempt=d["attempt"], spec=LaunchSpec.model_validate(d["spec"]), dir=dir,
            created_at=d.get("created_at", 0.0), started_at=d.get("started_at"),
            finished_at=d.get("finished_at"), ranks=[Rank.from_json(r) for r in d.get("ranks", [])],
            launch_error=d.get("launch_error"), suspend_requested_at=d.get("suspend_requested_at"),
            ready_at=d.get("ready_at"), stop_cause=_cause(d.get("stop_cause")),
            stopped_reason=d.get("stopped_reason"), term_sent_at=d.get("term_sent_at"),
            kill_sent=d.get("kill_sent", False), finished=d.get("finished", False),
            storage_errors=list(d.get("storage_errors") or []),
        )


class AttemptStore:
    """The agent's state folder: attempt records, control files, tombstones."""

    def __init__(self, state_dir: str | os.PathLike):
        self.state_dir = Path(state_dir).resolve()
        self.attempts_dir = self.state_dir / "attempts"
        self.done_dir = self.state_dir / "done"
        self.attempts_dir.mkdir(parents=True, exist_ok=True)
        self.done_dir.mkdir(parents=True, exist_ok=True)
        # issue 13: the last write that failed because the folder is full (ENOSPC/EDQUOT), until
        # the agent's storage check takes it (NodeAgent.check_storage)
        self.full_error: str | None = None
        self.full_told: set[str] = set()  # what was logged as failing, once per spell of a full folder

    def note_full(self, e: OSError, what: str) -> None:
        if what not in self.full_told:
            self.full_told.add(what)
            log.warning("the state folder %s is full: could not write %s (%s)", self.state_dir, what, e.strerror)
        self.full_error = e.strerror or str(e)

    # -- records
    def new(self, *, job_id: int, attempt: int, spec: LaunchSpec, now: float, assigned: DesiredAction) -> Attempt:
        """A fresh attempt with its folders (leftovers of a launch that crashed before its record
        existed are removed first). Not saved yet: the caller saves once the ranks are planned."""
        d = self.attempts_dir / f"{job_id}-{attempt}"
        if d.exists():
            shutil.rmtree(d, ignore_errors=True)
        att = Attempt(job_id=job_id, attempt=attempt, spec=spec, dir=d, created_at=now, assigned=assigned,
                      attached_at=now)
        att.control_dir.mkdir(parents=True, exist_ok=True)
        att.ranks_dir.mkdir(parents=True, exist_ok=True)
        return att

    def save(self, att: Attempt, *, required: bool = False) -> bool:
        """Write the attempt's record. On a full folder (issue 13) the record on disk stays the
        last one written and the agent goes on from memory (it writes again at the next change):
        False, unless ``required`` (a launch: no process before its record), which raises."""
        try:
            write_json_atomic(att.dir / "attempt.json", att.to_json(), mode=0o600)  # holds the job's env
        except OSError as e:
            if required or not is_full(e):
                raise
            self.note_full(e, f"the record of job {att.job_id} attempt {att.attempt}")
            return False
        return True

    def load(self) -> list[Attempt]:
        """Every readable record, in folder order. A folder without a record (the agent crashed
        before writing it) is removed; an unreadable record is left alone."""
        out = []
        for d in sorted(self.attempts_dir.iterdir()):
            f = d / "attempt.json"
            if not f.is_file():
                shutil.rmtree(d, ignore_errors=True)
                continue
            try:
                out.append(Attempt.from_json(json.loads(f.read_text()), d))
            except (OSError, ValueError, KeyError) as e:
                log.error("cannot read %s (%s); leaving it alone", f, e)
        return out

    # -- control files (the SDK's side of the suspend handshake)
    def request_suspend(self, att: Attempt, *, at: float) -> None:
        att.suspend_requested_at = at
        try:
            write_json_atomic(att.control_dir / SUSPEND_FILE, {"requested_at": at, "grace_s": att.spec.suspend_grace_s})
        except OSError as e:
            if not is_full(e):
                raise
            # the job cannot be asked (a full folder): it is stopped after the grace, and resumes
            # from its last reported checkpoint
            self.note_full(e, f"the suspend request of job {att.job_id}")
        self.save(att)

    def cancel_suspend(self, att: Attempt) -> None:
        try:
            (att.control_dir / SUSPEND_FILE).unlink()
        except FileNotFoundError:
            pass
        att.suspend_requested_at = None
        self.save(att)

    # -- tombstones
    def tombstone_path(self, key: Key) -> Path:
        return self.done_dir / f"{key[0]}-{key[1]}.json"

    def read_tombstone(self, key: Key) -> AttemptStatus | None:
        try:
            return AttemptStatus.model_validate_json(self.tombstone_path(key).read_text())
        except (OSError, ValueError):
            return None

    def write_tombstone(self, status: AttemptStatus) -> None:
        self.tombstone_path((status.job_id, status.attempt)).write_text(status.model_dump_json())

    def prune_tombstones(self, now: float) -> None:
        for p in sorted(self.done_dir.glob("*.json")):
            try:
                if now - p.stat().st_mtime > TOMBSTONE_TTL_S:
                    p.unlink()
            except OSError:
                pass

    def forget(self, att: Attempt) -> bool:
        """Tombstone first, then the folder: the attempt is never launched again. False (nothing
        removed; the caller keeps the attempt and tries again later) when the tombstone cannot
        be written because the folder is full."""
        try:
            self.write_tombstone(att.status())
        except OSError as e:
            if not is_full(e):
                raise
            self.note_full(e, f"the tombstone of job {att.job_id} attempt {att.attempt}")
            try:
                self.tombstone_path(att.key).unlink()
            except OSError:
                pass
            return False
        shutil.rmtree(att.dir, ignore_errors=True)
        return True


def reattach(att: Attempt, *, now: float) -> None:
    """After an agent restart: find each rank's process again (pid + start time, or the pid file
    its wrapper wrote when the agent died between spawn and record) and pick up the exit codes of
    ranks that ended meanwhile. Marks the attempt finished when no rank is left."""
    never_started = []
    for r in att.ranks:
        if r.ended:
            continue
        if r.pid is None:
            try:
                info = json.loads(att.rank_path(r.rank, "pid").read_text())
                r.pid, r.start_ticks = info["pid"], info.get("start_ticks")
            except (OSError, ValueError, KeyError):
                pass
        if r.pid is None:
            code = att.read_exit(r)
            r.ended = True
            r.exit_code = code
            if code is None:
                never_started.append(r.rank)
            continue
        code = att.read_exit(r)
        if is_alive(r.pid, r.start_ticks):
            if code is None:
                continue  # still running: reattached
            # the command ended and its wrapper is sweeping up: the rank is over
            signal_group(r.pid, 9)
        r.ended = True
        r.exit_code = code if code is not None else SIGKILL_EXIT
    if never_started and att.launch_error is None:
        att.launch_error = f"the agent restarted while launching; rank(s) {never_started} never started"
    att.attached_at = now
    att.tail = att.make_tail()
    att.tail.load()
    if all(r.ended for r in att.ranks) and not att.finished:
        att.finished = True
        att.finished_at = now


def read_events(att: Attempt, *, now: float) -> tuple[bool, bool]:
    """Take in the SDK's new events (checkpoint, progress, suspend_ready) from the control dir.
    Returns (worth reporting at once, progress changed)."""
    urgent = progress = False
    try:
        names = sorted(p.name for p in att.control_dir.iterdir() if p.name.startswith("events."))
    except OSError:
        return False, False
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
            u, p = _apply_event(att, ev, now=now)
            urgent |= u
            progress |= p
    return urgent, progress


def _apply_event(att: Attempt, ev: dict, *, now: float) -> tuple[bool, bool]:
    kind = ev.get("type")
    at = float(ev.get("at") or now)
    try:
        if kind == "checkpoint":
            ck = CheckpointInfo(path=str(ev["path"]), step=ev.get("step"), at=at, duration_s=ev.get("duration_s"))
            if att.checkpoint is None or ck.at >= att.checkpoint.at:
                att.checkpoint = ck
                return True, False
        elif kind == "progress":
            pr = ProgressInfo(step=int(ev["step"]), total=ev.get("total"), at=at,
                              metrics={k: float(v) for k, v in (ev.get("metrics") or {}).items()
                                       if isinstance(v, (int, float))})
            if att.progress is None or pr.at >= att.progress.at:
                att.progress = pr
                return False, True  # not urgent: reported within the agent's status refresh period
        elif kind == "storage_full":  # issue 13: the last few, each once
            msg = f"{ev['path']}: {ev.get('error', '')}"[:600]
            if msg not in att.storage_errors:
                att.storage_errors = [*att.storage_errors, msg][-5:]
                return True, False
        elif kind == "suspend_ready":
            rank = int(ev.get("rank", 0))
            for r in att.ranks:
                if r.rank == rank and r.ready_at is None:
                    r.ready_at = at
                    return True, False
    except (KeyError, ValueError, TypeError):
        log.debug("ignoring malformed event %r", ev)
    return False, False
