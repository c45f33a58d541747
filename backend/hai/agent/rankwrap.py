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

Exit codes follow the shell convention: 128 + N when the command was killed by signal N, 127 when
it could not be found, 126 when it could not be executed.

Stdlib only and importable without the ``hai`` package: the agent runs this file by path in
isolated mode, so the job's environment (PYTHONPATH, PYTHONHOME, ...) cannot break it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def _write_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
            print(f"[hai] could not bind to CPUs {cpus}: {e}", file=sys.stderr, flush=True)

    try:
        # --uid: the command runs as the submitter's account (issue 13); the wrapper keeps the
        # agent's user, to write the exit file and clean up after the command
        as_user = {} if uid is None else {"user": uid, "group": gid, "extra_groups": groups}
        child = subprocess.Popen(cmd, **as_user)
    except FileNotFoundError:
        print(f"[hai] command not found: {cmd[0]}", file=sys.stderr, flush=True)
        code = 127
        _write_atomic(exit_file, {"exit_code": code, "at": time.time(), "error": "not found"})
        return code
    except OSError as e:
        print(f"[hai] could not execute {cmd[0]}: {e}", file=sys.stderr, flush=True)
        code = 126
        _write_atomic(exit_file, {"exit_code": code, "at": time.time(), "error": str(e)})
        return code

    if pid_file:
        try:
            _write_atomic(
                pid_file,
                {"pid": me, "start_ticks": _start_ticks(me), "child_pid": child.pid},
            )
        except OSError:
            pass

    status = None
    fenced_at: float | None = None
    killed = False
    while status is None:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG if lease_file else 0)
        except ChildProcessError:  # pragma: no cover - the child is ours, cannot happen
            break
        if pid == child.pid:
            status = st
            continue
        if pid != 0 or not lease_file:
            continue
        now = time.time()
        if fenced_at is None:
            grace = _lease_expired(lease_file, now)
            if grace is not None:
                fenced_at, fence_grace = now, grace
                print(f"[hai] the agent has not reached the server in time (lease {lease_file} ran out): "
                      "stopping this rank so that it never runs twice", file=sys.stderr, flush=True)
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
        time.sleep(0.05 if fenced_at is not None else 0.25)
    child.returncode = 0  # reaped by hand above; keep Popen from waiting again
    rc = os.waitstatus_to_exitcode(status) if status is not None else 1
    code = 128 - rc if rc < 0 else rc
    record = {"exit_code": code, "at": time.time()}
    if fenced_at is not None:
        record["fenced"] = True
    if rc < 0:
        record["signal"] = -rc
    _write_atomic(exit_file, record)
    _cleanup(me)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
