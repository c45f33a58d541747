"""The rank wrapper: the process the agent launches for each rank.

    python -I -S rankwrap.py --exit-file F --pid-file P [--cpus 0,1,2] -- CMD ARGS...

It is the leader of the rank's process group and session (the agent starts it with
``start_new_session``), runs CMD as its child with the stdio it inherited (the rank's log files
under the agent's state dir), waits for it and writes the exit code to ``--exit-file`` atomically.
So a rank does not depend on the agent: the agent may die and come back, re-read the pid and
exit files and reattach — no second launch, no orphan.

- SIGTERM/SIGINT/SIGHUP sent to the group reach the command; the wrapper itself only notes them
  and keeps waiting, so it can record how the command ended. SIGKILL ends both.
- It is a child subreaper: descendants that daemonize are re-parented to it. When the command
  ends, whatever is left of its process group or below the wrapper is killed (no process left
  behind) before the wrapper exits with the command's exit code.
- ``--cpus`` binds the command to those CPUs (sched_setaffinity, inherited by the child).
- ``--lease F`` (issue 13, fencing): F is the agent's lease, ``{"valid_until": EPOCH, "grace_s": G}``,
  renewed by the agent each time it reaches the server. Once it has run out (the agent has not
  reached the server for long enough that the server is about to give this node's work away; or
  the agent is frozen, or partitioned), the wrapper stops the command itself: SIGTERM to its
  group, SIGKILL after G seconds, and records ``"fenced": true`` — so a job given to another node
  never runs twice. No lease file (an agent that never reached a server that sends the limit):
  no fencing.

- Output (issue 13, a full log folder): the command writes into two pipes that the wrapper copies
  into the rank's log files (its own stdout/stderr, opened by the agent). When a file cannot be
  written (the log folder is full, ENOSPC/EDQUOT) the output is dropped and counted — the command
  never blocks and never sees an error — and once a write succeeds again (the next output, or a
  retry every second) a line ``[hai] N lines of output dropped (B bytes): the log folder was full
  (No space left on device)`` comes first. Space for the exit record is reserved at start
  (``<exit file>.reserve``, given back just before the record is written), so a full folder does
  not lose the exit code either.

Exit codes follow the shell convention: 128 + N when the command was killed by signal N, 127 when
it could not be found, 126 when it could not be executed.

Stdlib only and importable without the ``hai`` package: the agent runs this file by path in
isolated mode, so the job's environment (PYTHONPATH, PYTHONHOME, ...) cannot break it.
"""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
RESERVE_BYTES = 16384  # room kept for the exit record (and its temporary file)
MARKER_RETRY_S = 1.0
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
PIPE_BYTES = 1 << 20


class Sink:
    """One of the rank's log files (a file descriptor the agent opened, O_APPEND). ``write``
    never raises: what cannot be written is dropped and counted, and the count is written as a
    marker line before the next data once the file takes writes again."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.dropped_bytes = 0
        self.dropped_lines = 0
        self.error: str | None = None
        self.at_line_start = True
        self.last_try = 0.0

    def _write_all(self, data: bytes) -> int:
        """Bytes written before an error (all of them when none)."""
        done = 0
        while done < len(data):
            try:
                n = os.write(self.fd, data[done:])
            except InterruptedError:
                continue
            except OSError as e:
                self.error = os.strerror(e.errno) if e.errno else str(e)
                break
            if n <= 0:
                break
            done += n
        if done:
            self.at_line_start = data[done - 1 : done] == b"\n"
        return done

    def _drop(self, data: bytes) -> None:
        if not data:
            return
        self.dropped_bytes += len(data)
        self.dropped_lines += data.count(b"\n") + (0 if data.endswith(b"\n") else 1)

    def flush_marker(self) -> bool:
        """Write the pending drop marker (if any); False while the file still takes nothing."""
        if not self.dropped_bytes:
            return True
        self.last_try = time.monotonic()
        marker = ((b"" if self.at_line_start else b"\n") +
                  (f"[hai] {self.dropped_lines} lines of output dropped ({self.dropped_bytes} bytes): "
                   f"the log folder was full ({self.error or 'write failed'})\n").encode())
        n = self._write_all(marker)
        if n < len(marker):
            if n:  # a part of the marker went out: end its line, count on
                self._write_all(b"\n")
            return False
        self.dropped_bytes = self.dropped_lines = 0
        return True

    def write(self, data: bytes) -> None:
        if self.dropped_bytes and not self.flush_marker():
            self._drop(data)
            return
        n = self._write_all(data)
        if n < len(data):
            # the rest of a line cut by the error is dropped with it
            self._drop(data[n:])

    def retry_due(self, now: float) -> bool:
        return bool(self.dropped_bytes) and now - self.last_try >= MARKER_RETRY_S


def _say(msg: str) -> None:
    """A line of the wrapper's own on the rank's stderr; never raises (the folder may be full)."""
    try:
        os.write(2, (msg + "\n").encode())
    except OSError:
        pass


def _reserve(path: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * RESERVE_BYTES)
        finally:
            os.close(fd)
    except OSError:
        pass  # already full: the record is written if it can be


def _write_exit(path: str, data: dict) -> None:
    """The exit record, atomically; on a full folder the space reserved at start is given back
    first. Never raises: without a record the agent still has the wrapper's own exit code."""
    reserve = path + ".reserve"
    try:
        _write_atomic(path, data)
    except OSError:
        try:
            os.unlink(reserve)
        except OSError:
            pass
        try:
            _write_atomic(path, data)
        except OSError as e:
            _say(f"[hai] rankwrap: could not write the exit record {path}: {e}")
            return
    try:
        os.unlink(reserve)
    except OSError:
        pass


def _write_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
        return int(data[data.rfind(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _set_subreaper() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except Exception:  # not fatal: only daemonizing grandchildren escape then
        pass


def _leftovers(me: int) -> list[int]:
    """Processes in our process group, or our children (adopted orphans), other than us."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = data[data.rfind(")") + 2 :].split()
        if len(fields) < 3 or fields[0] in ("Z", "X"):
            continue
        ppid, pgrp = int(fields[1]), int(fields[2])
        if pgrp == me or ppid == me:
            out.append(int(name))
    return out


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _cleanup(me: int) -> None:
    """Kill what the command left behind (it ended; the rank is over)."""
    for _ in range(50):
        left = _leftovers(me)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            _reap_all()
            if not _leftovers(me):
                break
            time.sleep(0.01)
    _reap_all()


def _lease_expired(path: str | None, now: float) -> float | None:
    """The grace period to use when the lease at ``path`` has run out, else None."""
    if path is None:
        return None
    try:
        with open(path) as f:
            lease = json.load(f)
        if now > float(lease["valid_until"]):
            return max(0.0, float(lease.get("grace_s", 1.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def main(argv: list[str]) -> int:
    exit_file = pid_file = lease_file = None
    cpus: list[int] | None = None
    uid = gid = None
    groups: list[int] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a == "--exit-file":
            exit_file = argv[i + 1]
            i += 2
        elif a == "--pid-file":
            pid_file = argv[i + 1]
            i += 2
        elif a == "--lease":
            lease_file = argv[i + 1]
            i += 2
        elif a == "--cpus":
            cpus = [int(c) for c in argv[i + 1].split(",") if c]
            i += 2
        elif a == "--uid":
            uid = int(argv[i + 1])
            i += 2
        elif a == "--gid":
            gid = int(argv[i + 1])
            i += 2
        elif a == "--groups":
            groups = [int(g) for g in argv[i + 1].split(",") if g]
            i += 2
        else:
            print(f"[hai] rankwrap: unknown option {a}", file=sys.stderr)
            return 2
    cmd = argv[i:]
    if not cmd or exit_file is None:
        print("[hai] rankwrap: usage: --exit-file F [--pid-file P] [--cpus L] [--uid U --gid G [--groups L]] -- CMD...", file=sys.stderr)
        return 2

    me = os.getpid()
    # Python-level handlers (not SIG_IGN) so the child's exec resets them to the default.
    got: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: got.append(signum))
    _set_subreaper()
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            _say(f"[hai] could not bind to CPUs {cpus}: {e}")

    _reserve(exit_file + ".reserve")
    # the command's output goes through pipes to the rank's log files (our stdout/stderr): a full
    # log folder drops output, never the command (Sink)
    sinks: dict[int, Sink] = {}
    pipes: list[tuple[int, int]] = []
    for fd in (1, 2):
        r, w = os.pipe()
        os.set_blocking(r, False)
        try:  # room for a burst of output while the wrapper copies (64 KiB by default)
            fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass
        pipes.append((r, w))
        sinks[r] = Sink(fd)
    # SIGCHLD wakes the loop below at once (a handler, not SIG_IGN: the child's exec resets it)
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    try:
        # --uid: the command runs as the submitter's account (issue 13); the wrapper keeps the
        # agent's user, to write the exit file and clean up after the command
        as_user = {} if uid is None else {"user": uid, "group": gid, "extra_groups": groups}
        child = subprocess.Popen(cmd, stdout=pipes[0][1], stderr=pipes[1][1], **as_user)
    except FileNotFoundError:
        _say(f"[hai] command not found: {cmd[0]}")
        code = 127
        _write_exit(exit_file, {"exit_code": code, "at": time.time(), "error": "not found"})
        return code
    except OSError as e:
        _say(f"[hai] could not execute {cmd[0]}: {e}")
        code = 126
        _write_exit(exit_file, {"exit_code": code, "at": time.time(), "error": str(e)})
        return code
    for _, w in pipes:
        os.close(w)

    if pid_file:
        try:
            _write_atomic(
                pid_file,
                {"pid": me, "start_ticks": _start_ticks(me), "child_pid": child.pid},
            )
        except OSError:
            pass

    sel = selectors.DefaultSelector()
    sel.register(wake_r, selectors.EVENT_READ)
    for r, _ in pipes:
        sel.register(r, selectors.EVENT_READ)

    def pump(timeout: float | None) -> bool:
        """Copy what the pipes hold to the files (waiting up to ``timeout`` for something).
        True when a pipe gave data or was closed."""
        moved = False
        for key, _ in sel.select(timeout):
            fd = key.fd
            if fd == wake_r:
                try:
                    while os.read(wake_r, 512):
                        pass
                except (BlockingIOError, OSError):
                    pass
                continue
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            moved = True
            if data:
                sinks[fd].write(data)
            else:  # every writer has closed it
                sel.unregister(fd)
                os.close(fd)
        now = time.monotonic()
        for sink in sinks.values():
            if sink.retry_due(now):
                sink.flush_marker()
        return moved

    def drain(until: float, *, to_eof: bool) -> None:
        """Copy what is left in the pipes: until they are empty (``to_eof``: until every writer
        has closed them), or ``until`` (monotonic) at the latest."""
        while any(fd in sinks for fd in sel.get_map()) and time.monotonic() < until:
            if not pump(0.05) and not to_eof:
                return

    status = None
    fenced_at: float | None = None
    killed = False
    while status is None:
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # pragma: no cover - the child is ours, cannot happen
                pid, st = child.pid, 0
            if pid == 0:
                break
            if pid == child.pid:
                status = st
                break
        if status is not None:
            break
        if lease_file:
            now = time.time()
            if fenced_at is None:
                grace = _lease_expired(lease_file, now)
                if grace is not None:
                    fenced_at, fence_grace = now, grace
                    _say(f"[hai] the agent has not reached the server in time (lease {lease_file} ran out): "
                         "stopping this rank so that it never runs twice")
                    if os.getpgrp() == me:  # as the agent starts us: our group is the rank's
                        _signal_group(me, signal.SIGTERM)
                    else:
                        try:
                            os.kill(child.pid, signal.SIGTERM)
                        except OSError:
                            pass
            elif not killed and now - fenced_at >= fence_grace:
                killed = True
                for left in _leftovers(me):  # not the group: it holds this wrapper too
                    try:
                        os.kill(left, signal.SIGKILL)
                    except OSError:
                        pass
        pump(0.05 if fenced_at is not None else (0.25 if lease_file else 1.0))
    child.returncode = 0  # reaped by hand above; keep Popen from waiting again
    drain(time.monotonic() + 2.0, to_eof=False)  # the command's last output (descendants may hold the pipes)
    rc = os.waitstatus_to_exitcode(status) if status is not None else 1
    code = 128 - rc if rc < 0 else rc
    record = {"exit_code": code, "at": time.time()}
    if fenced_at is not None:
        record["fenced"] = True
    if rc < 0:
        record["signal"] = -rc
    _write_exit(exit_file, record)
    _cleanup(me)
    drain(time.monotonic() + 1.0, to_eof=True)  # what the leftovers wrote before they were killed
    for sink in sinks.values():
        sink.flush_marker()  # a last try: the count of dropped output, if there is room now
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
