"""Test-only crash points (issue 13): ``HAI_FAULT_CRASH_AT=after_submit_commit`` makes the
process kill itself with SIGKILL when it reaches that point, the way a power cut would. Unset
(always, outside the fault tests), every crash point is a no-op."""

from __future__ import annotations

import os
import signal

ENV = "HAI_FAULT_CRASH_AT"
STOP_ENV = "HAI_FAULT_STOP_AT"


def crash_point(name: str) -> None:
    wanted = os.environ.get(ENV)
    if wanted and name in wanted.split(","):
        os.kill(os.getpid(), signal.SIGKILL)


def stop_point(name: str) -> None:
    """``HAI_FAULT_STOP_AT=scheduler_before_commit``: the process stops itself (SIGSTOP) there,
    as a long GC pause or a frozen VM would, until someone sends SIGCONT (issue 12's fencing
    test). Unset, a no-op."""
    wanted = os.environ.get(STOP_ENV)
    if wanted and name in wanted.split(","):
        os.kill(os.getpid(), signal.SIGSTOP)
