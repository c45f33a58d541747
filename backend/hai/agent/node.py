"""The agent's node state: the attempts it holds, applying the server's assignments, launching
and supervising the ranks (exits, suspend handshake, deadlines, SIGTERM -> SIGKILL), log
tailing and the AttemptStatus reports. No networking here (main.py).

The attempt records and their state folder (tombstones, recovery after a restart) live in
``attempts.py``; what deadline is due (stop or kill) is the pure rule in ``supervision.py``.

Thread-safety: every public method takes ``self.lock``; ``tail_logs`` runs in its own thread and
only touches the tail state (guarded by ``self._tail_lock``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hai.agent import launcher, supervision
from hai.agent.attempts import Attempt, AttemptStore, Key, Rank, is_full, read_events, reattach
from hai.agent.gpu import GpuBackend
from hai.agent.logs import LogBuffer, tail_attempt
from hai.agent.procs import SIGKILL_EXIT, exit_code_from_returncode, is_alive, signal_group
from hai.agent.users import UnmappedUser, UserMap, own_private
from hai.protocol import Assignment, AttemptStatus, DesiredAction, GpuMetrics, LogLine, NicInfo, StopCause

log = logging.getLogger("hai.agent")

LEASE_BYTES = 128  # the lease file's fixed size: on a full folder it is overwritten in place
STORAGE_CHECK_S = 1.0


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
        log_drain_s: float = 10.0,
        sysfs: str = "/sys",
        on_change: Callable[[], None] | None = None,
        on_progress: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
        user_map: UserMap | None = None,
    ):
        self.node = node
        self.store = AttemptStore(state_dir)
        self.state_dir = self.store.state_dir
        self.gpus = gpus
        self.gpu_inventory = gpus.inventory()
        self.nics = list(nics or [])
        self.buf = log_buffer if log_buffer is not None else LogBuffer()
        root = checkpoint_root or os.environ.get("HAI_CHECKPOINT_ROOT") or (self.state_dir / "jobs")
        self.checkpoint_root = Path(root).resolve()
        self.kill_grace_s = kill_grace_s
        self.log_drain_s = log_drain_s
        self.sysfs = sysfs
        self.on_change = on_change or (lambda: None)  # worth reporting at once
        self.on_progress = on_progress or (lambda: None)  # worth reporting soon (progress)
        self.clock = clock
        self.user_map = user_map  # issue 13: None = ranks run as the agent's own user (development)
        self.lock = threading.RLock()
        self._tail_lock = threading.Lock()
        self.attempts: dict[Key, Attempt] = {}
        self.pending: dict[Key, Assignment] = {}  # waiting for their GPUs to be free
        self.ghosts: dict[Key, AttemptStatus] = {}  # forgotten but assigned again
        self.launches = 0  # attempts launched by this agent process (tests: never twice)
        # issue 13: the lease every rank wrapper reads (rankwrap.py --lease): renewed each time
        # the agent reaches the server; once it runs out, the ranks stop themselves
        self.lease_path = self.state_dir / "lease.json"
        # issue 13: the state folder (the ranks' log files, the records, the lease) is full: the
        # message reported on every running attempt (None: it has room)
        self.storage_error: str | None = None
        self._next_storage_check = 0.0

    def renew_lease(self, *, valid_until: float, grace_s: float) -> None:
        data = json.dumps({"valid_until": valid_until, "grace_s": grace_s}).encode().ljust(LEASE_BYTES)
        tmp = self.lease_path.with_name(f"lease.json.tmp{os.getpid()}")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.lease_path)
        except OSError as e:
            if not is_full(e) or not self.lease_path.exists():
                raise
            try:
                tmp.unlink()
            except OSError:
                pass
            # a full folder (issue 13): the ranks must not stop for want of a renewed lease, so it
            # is overwritten in place (same size: its blocks exist, no new space is needed)
            fd = os.open(self.lease_path, os.O_WRONLY)
            try:
                os.pwrite(fd, data, 0)
            finally:
                os.close(fd)
            self.store.note_full(e, "the lease")

    # ------------------------------------------------------------------ a full state folder (issue 13)

    def check_storage(self, now: float) -> bool:
        """Whether the state folder is full: a write of the agent's failed with ENOSPC/EDQUOT
        since the last check, or the filesystem has no block left for an unprivileged writer
        (the ranks). While it is, every running attempt carries the message in its
        ``storage_errors`` (the server records it once as a job event: "storage full on node
        N: log folder ..."). The ranks' output is dropped meanwhile (rankwrap), not the ranks.
        Returns whether an attempt's report changed."""
        if now < self._next_storage_check:
            return False
        self._next_storage_check = now + STORAGE_CHECK_S
        error, self.store.full_error = self.store.full_error, None
        for att in self.attempts.values():
            if att.tail is not None and att.tail.save_error:
                error, att.tail.save_error = error or att.tail.save_error, None
        if error is None:
            try:
                if os.statvfs(self.state_dir).f_bavail == 0:
                    error = os.strerror(errno.ENOSPC)
            except OSError:
                pass
        was = self.storage_error
        if error is None:
            if was is not None:
                log.info("the state folder %s has room again", self.state_dir)
            self.storage_error = None
            self.store.full_told.clear()
            return False
        self.storage_error = (f"log folder {self.state_dir} is full ({error}): the ranks' output is dropped "
                              "until there is room; the job keeps running")
        if was is None:
            log.warning("%s", self.storage_error)
        changed = False
        for att in self.attempts.values():
            if not att.finished:
                att.blind_at = now  # its output cannot be seen: the log watchdog does not count this
            if not att.finished and self.storage_error not in att.storage_errors:
                att.storage_errors = [*att.storage_errors, self.storage_error][-5:]
                changed = True
        return changed

    # ------------------------------------------------------------------ recovery

    def recover(self) -> list[AttemptStatus]:
        """Re-read the state dir after an agent restart: reattach to live ranks, pick up the exit
        codes of ranks that ended meanwhile. Returns the statuses for AgentHello.attempts."""
        now = self.clock()
        with self.lock:
            self.store.prune_tombstones(now)
            for att in self.store.load():
                reattach(att, now=now)
                self.store.save(att)
                self.attempts[att.key] = att
                if att.tail is not None:  # lines read before the restart and never shipped
                    self.buf.offer_many(att.tail.unshipped_lines())
                log.info("reattached job %s attempt %s: %s", att.job_id, att.attempt,
                         ", ".join(f"rank {r.rank} " + ("exited %s" % r.exit_code if r.ended else f"pid {r.pid}")
                                   for r in att.ranks) or "no ranks")
            return self.statuses()

    # ------------------------------------------------------------------ assignments

    def apply(self, assignments: list[Assignment], *, sent_at: float | None = None) -> None:
        """Apply the full desired set for this node (idempotent). ``sent_at``: when the request
        this reply answers was sent; attempts launched after that are not judged by it."""
        with self.lock:
            wanted = {(a.job_id, a.attempt): a for a in assignments}
            for key, a in wanted.items():
                att = self.attempts.get(key)
                if att is None:
                    self._apply_unheld(key, a)
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

    def _apply_unheld(self, key: Key, a: Assignment) -> None:
        """An assignment for an attempt this agent does not hold (yet, or any more)."""
        if key in self.pending:
            if a.action == DesiredAction.RUN:
                self.pending[key] = a
                return
            del self.pending[key]
            self._not_launched(a)
            return
        if key in self.ghosts:
            return
        ghost = self.store.read_tombstone(key)
        if ghost is not None:  # finished and forgotten: never launch it twice
            self.ghosts[key] = ghost
            return
        if a.action == DesiredAction.RUN:
            self._launch_or_defer(a)
        else:
            self._not_launched(a)

    def _not_launched(self, a: Assignment) -> None:
        """stop/suspend for an attempt this node never launched: report that nothing ran here
        (and remember it, so a stale 'run' can never launch it afterwards)."""
        st = AttemptStatus(job_id=a.job_id, attempt=a.attempt, finished=True, stop_cause=StopCause.NOT_LAUNCHED,
                           stopped_reason=f"{a.action} arrived before this node launched the attempt",
                           finished_at=self.clock())
        try:
            self.store.write_tombstone(st)
        except OSError as e:  # a full folder: remembered in memory only (issue 13)
            if not is_full(e):
                raise
            self.store.note_full(e, f"the tombstone of job {a.job_id} attempt {a.attempt}")
        self.ghosts[(a.job_id, a.attempt)] = st
        self.on_change()

    def _gpus_in_use(self) -> set[int]:
        return {g for att in self.attempts.values() for r in att.alive_ranks for g in r.gpus}

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

    # ------------------------------------------------------------------ launching

    def _defer_for_storage(self, a: Assignment, e: OSError, att: Attempt | None) -> None:
        """The attempt's record cannot be written (a full folder, issue 13): no process is started
        without one (a restarted agent could not find it). It waits, as for busy GPUs, and is
        launched once there is room; its report carries the reason meanwhile."""
        self.store.note_full(e, f"the record of job {a.job_id} attempt {a.attempt}")
        if att is not None:
            self.attempts.pop(att.key, None)
            self.launches -= 1
            shutil.rmtree(att.dir, ignore_errors=True)
        self.pending[(a.job_id, a.attempt)] = a
        self.on_change()

    def _launch(self, a: Assignment) -> None:
        now = self.clock()
        spec = a.spec
        try:
            att = self.store.new(job_id=a.job_id, attempt=a.attempt, spec=spec, now=now, assigned=a.action)
        except OSError as e:
            if not is_full(e):
                raise
            self._defer_for_storage(a, e, None)
            return
        ckpt = self.checkpoint_dir(a.job_id)
        self.attempts[att.key] = att
        self.launches += 1
        try:
            try:
                account = self.user_map.account(spec.user) if self.user_map is not None else None
            except UnmappedUser as e:
                raise launcher.LaunchError(str(e)) from None
            ckpt.mkdir(parents=True, exist_ok=True)
            # the job's checkpoint and log folders: its owner's only (issue 13); the attempt's
            # own folder (its record, with the job's environment) stays the agent's, passable
            os.chmod(att.dir, 0o711)
            for folder in (ckpt, att.ranks_dir, att.control_dir):
                own_private(folder, account)
            plans = launcher.plan_ranks(
                spec, job_id=a.job_id, attempt=a.attempt, node=self.node, node_gpus=self.gpu_inventory,
                nics=self.nics, control_dir=str(att.control_dir), checkpoint_dir=str(ckpt), sysfs=self.sysfs,
            )
            if account is not None:
                for plan in plans:
                    plan.env.update(HOME=account.home, USER=account.name, LOGNAME=account.name)
            cwd = spec.cwd
            if cwd is not None and not os.path.isdir(cwd):
                raise launcher.LaunchError(f"working directory {cwd} does not exist")
            launcher.check_executable(spec.command[0], plans[0].env, cwd)
        except (launcher.LaunchError, OSError) as e:
            att.launch_error = str(e)
            att.finished = True
            att.finished_at = now
            att.tail = att.make_tail()
            self.store.save(att)
            log.warning("job %s attempt %s cannot be launched: %s", a.job_id, a.attempt, e)
            self.on_change()
            return
        att.ranks = [Rank(rank=p.rank, local_rank=p.local_rank, gpus=p.gpus) for p in plans]
        att.tail = att.make_tail()
        try:
            self.store.save(att, required=True)  # the record exists before any process does
        except OSError as e:
            if not is_full(e):
                raise
            self._defer_for_storage(a, e, att)
            return
        att.started_at = self.clock()
        for plan, r in zip(plans, att.ranks):
            try:
                proc = launcher.spawn_rank(
                    plan, cwd=cwd, stdout_path=str(att.rank_path(r.rank, "stdout")),
                    stderr_path=str(att.rank_path(r.rank, "stderr")),
                    exit_path=str(att.rank_path(r.rank, "exit")), pid_path=str(att.rank_path(r.rank, "pid")),
                    account=account,
                    lease_path=str(self.lease_path),
                )
            except OSError as e:
                att.launch_error = f"rank {r.rank} could not be started: {e}"
                r.ended = True
                for other in att.ranks:
                    if other.pid is None and not other.ended:
                        other.ended = True
                break
            r.pid, r.start_ticks, r.popen = proc.pid, proc.start_ticks, proc.popen
        self.store.save(att)
        log.info("launched job %s attempt %s (%s, %d rank(s) here: %s)", a.job_id, a.attempt, spec.job_type,
                 len(att.ranks), ", ".join(f"rank {r.rank} pid {r.pid}" for r in att.ranks))
        if att.launch_error:
            self._stop(att, StopCause.RANK_FAILED, att.launch_error)
        if a.action == DesiredAction.SUSPEND:
            self._request_suspend(att)
        elif a.action == DesiredAction.STOP:
            self._stop(att, StopCause.REQUESTED, "stop requested by the server")
        self.on_change()

    # ------------------------------------------------------------------ suspend / stop / kill

    def _request_suspend(self, att: Attempt) -> None:
        self.store.request_suspend(att, at=self.clock())
        log.info("job %s attempt %s: suspend requested (grace %ss)", att.job_id, att.attempt,
                 att.spec.suspend_grace_s)
        self.on_change()

    def _cancel_suspend(self, att: Attempt) -> None:
        self.store.cancel_suspend(att)
        self.on_change()

    def _stop(self, att: Attempt, cause: StopCause, reason: str) -> None:
        """SIGTERM to every live rank's process group; SIGKILL follows after the grace (tick)."""
        if att.stopping or att.finished:
            return
        if att.stop_cause != StopCause.FENCED:  # the other ranks stop because one was fenced: still fenced
            att.stop_cause = cause
            att.stopped_reason = reason
        att.term_sent_at = self.clock()
        for r in att.ranks:
            if not r.ended and r.pid is not None and self._rank_alive(r):
                launcher.terminate(r.pid)
        self.store.save(att)
        log.info("job %s attempt %s: stopping (%s)", att.job_id, att.attempt, reason)
        self.on_change()

    def _kill(self, att: Attempt) -> None:
        for r in att.ranks:
            if not r.ended and r.pid is not None and self._rank_alive(r):
                launcher.kill(r.pid)
        att.kill_sent = True
        log.info("job %s attempt %s: SIGKILL after %gs grace", att.job_id, att.attempt,
                 supervision.grace_s(att, self.kill_grace_s))

    # ------------------------------------------------------------------ supervision

    def _rank_alive(self, r: Rank) -> bool:
        if r.popen is not None:
            return r.popen.poll() is None  # type: ignore[attr-defined]
        return r.pid is not None and is_alive(r.pid, r.start_ticks)

    def _poll_rank(self, att: Attempt, r: Rank) -> bool:
        """True when the rank has just ended."""
        if r.ended or r.pid is None:
            return False
        if r.popen is not None:
            rc = r.popen.poll()  # type: ignore[attr-defined]
            if rc is None:
                return False
            code, fenced = att.read_exit_record(r)
            r.exit_code = code if code is not None else exit_code_from_returncode(rc)
            # the wrapper cleans up after its command; if the wrapper itself was killed, sweep
            signal_group(r.pid, 9)
        else:
            if is_alive(r.pid, r.start_ticks):
                return False
            code, fenced = att.read_exit_record(r)
            r.exit_code = code if code is not None else SIGKILL_EXIT
        if fenced and att.stop_cause is None:
            # issue 13: not the job's failure; the server requeues it (outcomes: fenced)
            att.stop_cause = StopCause.FENCED
            att.stopped_reason = ("the agent did not reach the server within its lease; the ranks stopped themselves "
                                  "so that the job cannot run twice")
        r.ended = True
        r.popen = None
        return True

    def tick(self) -> None:
        """One supervision round: rank exits, SDK events, suspend handshake, deadlines."""
        with self.lock:
            now = self.clock()
            for att in list(self.attempts.values()):
                if not att.finished:
                    self._supervise(att, now)
            for key, a in list(self.pending.items()):
                if key not in self.attempts:
                    self._launch_or_defer(a)
            if self.check_storage(now):
                self.on_change()
            self._forget_done()

    def _supervise(self, att: Attempt, now: float) -> None:
        changed = notify = False
        for r in att.ranks:
            if self._poll_rank(att, r):
                changed = notify = True
                log.info("job %s attempt %s rank %s exited with code %s", att.job_id, att.attempt,
                         r.rank, r.exit_code)
        urgent, progress = read_events(att, now=now)
        notify |= urgent
        if progress:
            self.on_progress()
        if att.suspend_requested_at is not None and att.ready_at is None and supervision.suspend_ready_seen(att):
            att.ready_at = now
            changed = notify = True
            log.info("job %s attempt %s: suspend_ready()", att.job_id, att.attempt)
        due = supervision.deadline(att, now, kill_grace_s=self.kill_grace_s)
        if due is not None and due.action == "stop":
            self._stop(att, due.cause, due.reason)  # type: ignore[arg-type]
            due = supervision.deadline(att, now, kill_grace_s=self.kill_grace_s)  # a zero grace: kill now
        if due is not None and due.action == "kill":
            self._kill(att)
            changed = True
        if att.ranks and all(r.ended for r in att.ranks):
            if att.ended_at is None:
                att.ended_at = now
            if self._logs_delivered(att, now):
                att.finished = True
                att.finished_at = att.ended_at
                changed = notify = True
                log.info("job %s attempt %s finished on this node", att.job_id, att.attempt)
        if changed:
            self.store.save(att)
        if notify:
            self.on_change()

    # ------------------------------------------------------------------ logs

    def _logs_delivered(self, att: Attempt, now: float) -> bool:
        """Whether the ended attempt's output has left the agent, so that it may be reported
        finished: its files are read to the end into the buffer and the shipper has delivered
        every line up to there. Without it the server could end the job (and a follower of its
        log stop) before its last lines arrived, since logs and statuses travel separately. Waits
        at most ``log_drain_s`` after the ranks ended (an unreachable server, a flood); with no
        shipper running (a bare NodeAgent) there is nothing to wait for."""
        if att.tail is None:
            return True
        if not att.drained:
            with self._tail_lock:
                self._tail(att, True)
        if att.drained and att.log_mark is None:
            att.log_mark = self.buf.mark()
        if att.log_mark is not None and self.buf.delivered_to(att.log_mark):
            return True
        return now - (att.ended_at or now) >= self.log_drain_s

    def tail_logs(self) -> int:
        """One tail round over every attempt's rank files; returns the number of lines read."""
        with self.lock:
            atts = [(a, a.finished) for a in self.attempts.values() if a.tail is not None]
        total = 0
        with self._tail_lock:
            for att, final in atts:
                if att.drained or att.key not in self.attempts:
                    continue
                total += self._tail(att, final)
        return total

    def shipped(self, lines: list[LogLine]) -> None:
        """The log shipper delivered ``lines``: out of their attempts' journals (``LogShipper``'s
        ``shipped``; called from its thread)."""
        by_attempt: dict[tuple[int, int], list[LogLine]] = {}
        for ln in lines:
            by_attempt.setdefault((ln.job_id, ln.attempt), []).append(ln)
        for key, some in by_attempt.items():
            att = self.attempts.get(key)
            if att is not None and att.tail is not None:
                att.tail.shipped(some)

    def _tail(self, att: Attempt, final: bool) -> int:
        """One tail round of ``att`` (the caller holds ``_tail_lock``); ``final``: its ranks
        ended, so a finished read marks it drained. Returns the lines read."""
        try:
            n, drained = tail_attempt(att.tail, self.buf, final=final, now=self.clock)
        except OSError as e:
            log.debug("tailing job %s attempt %s: %s", att.job_id, att.attempt, e)
            return 0
        if final and drained:
            att.drained = True
        return n

    # ------------------------------------------------------------------ forgetting

    def _forget_done(self) -> None:
        for key, att in list(self.attempts.items()):
            if not (att.finished and att.final_reported and att.assigned is None and att.drained):
                continue
            with self._tail_lock:
                if not self.store.forget(att):
                    continue  # a full folder: forgotten once there is room (issue 13)
                del self.attempts[key]
            log.info("forgot job %s attempt %s", att.job_id, att.attempt)

    # ------------------------------------------------------------------ reports

    def statuses(self) -> list[AttemptStatus]:
        with self.lock:
            out = [a.status() for _, a in sorted(self.attempts.items())]
            waiting = [self.storage_error] if self.storage_error else []  # issue 13
            for key, a in sorted(self.pending.items()):
                out.append(AttemptStatus(job_id=a.job_id, attempt=a.attempt, storage_errors=waiting))
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

    def settling(self) -> bool:
        """An attempt whose ranks have ended waits for its last log lines to leave."""
        with self.lock:
            return any(not a.finished and a.ended_at is not None for a in self.attempts.values())
