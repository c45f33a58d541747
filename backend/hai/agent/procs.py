"""Small /proc helpers: process identity (pid + start time, against pid reuse), liveness,
process-group signalling, exit-code conventions. Linux only, stdlib only."""

from __future__ import annotations

import errno
import os
import signal


def _read_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name, or None when the pid does not exist.

    The command name (field 2) may hold spaces and parentheses, so split after the last ')'.
    Returned list index 0 is field 3 (state)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    except OSError:
        return None
    end = data.rfind(")")
    if end < 0:
        return None
    return data[end + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """Start time of the process in clock ticks since boot (field 22), None if it does not exist."""
    fields = _read_stat(pid)
    if fields is None or len(fields) < 20:
        return None
    return int(fields[19])


def proc_state(pid: int) -> str | None:
    fields = _read_stat(pid)
    return fields[0] if fields else None


def pgrp_of(pid: int) -> int | None:
    fields = _read_stat(pid)
    if fields is None or len(fields) < 3:
        return None
    return int(fields[2])


def try_reap(pid: int) -> int | None:
    """Reap ``pid`` if it is our exited child; returns its wait status, or None."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    except OSError:
        return None
    return status if got == pid else None


def is_alive(pid: int, ticks: int | None) -> bool:
    """True when ``pid`` runs and is the same process that started at ``ticks``.

    A zombie counts as dead (and is reaped when it is our child)."""
    fields = _read_stat(pid)
    if fields is None:
        return False
    if ticks is not None and len(fields) >= 20 and int(fields[19]) != ticks:
        return False  # the pid was reused by another process
    if fields[0] in ("Z", "X"):
        try_reap(pid)
        return False
    return True


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    except OSError as e:  # pragma: no cover - defensive
        if e.errno == errno.ESRCH:
            return False
        raise


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _read_stat(int(name))
        if fields is None or len(fields) < 3:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(name))
    return sorted(out)


def exit_code_from_returncode(rc: int) -> int:
    """subprocess returncode (negative = killed by signal) -> shell convention (128 + signal)."""
    return 128 - rc if rc < 0 else rc


SIGKILL_EXIT = 128 + signal.SIGKILL
