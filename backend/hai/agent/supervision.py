"""Supervision deadlines as one pure rule: given an attempt's record and the time, is a stop
or a kill due? No processes, no files: ``NodeAgent.tick`` asks :func:`deadline` and carries
out the answer (SIGTERM to the ranks' process groups, or SIGKILL).

The ladder, first match wins:

- not stopping yet, some rank still alive:
  1. another rank failed (exited non-zero)                        -> stop, ``rank_failed``
  2. the job called suspend_ready() and its ranks had
     ``READY_EXIT_WINDOW_S`` (at most the stop grace) to exit       -> stop, ``suspend``
  3. a suspend was requested and ``suspend_grace_s`` passed
     without suspend_ready()                                       -> stop, ``suspend_timeout``
  4. running longer than ``max_runtime_s``                         -> stop, ``max_runtime``
  5. no output for ``log_watchdog_s`` (counted from the start, the
     agent taking charge, the last line, or the last moment the
     log folder was full — output dropped there is not silence —
     whichever is latest)                                          -> stop, ``log_watchdog``
- stopping, the SIGKILL not sent yet, the stop grace passed        -> kill
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hai.agent.attempts import Attempt
from hai.protocol import StopCause

READY_EXIT_WINDOW_S = 2.0  # after suspend_ready(), ranks get this long to exit by themselves
READY_CLOCK_SLACK_S = 1.0  # SDK and agent share the host clock; allow a little slack anyway


@dataclass(frozen=True, slots=True)
class Due:
    action: Literal["stop", "kill"]
    cause: StopCause | None = None  # stop: why
    reason: str = ""  # stop: the sentence for stopped_reason


KILL = Due("kill")


def grace_s(att: Attempt, default_s: float) -> float:
    """Seconds between SIGTERM and SIGKILL: the spec's, else the agent's ``--kill-grace``."""
    return att.spec.stop_grace_s if att.spec.stop_grace_s is not None else default_s


def suspend_ready_seen(att: Attempt) -> bool:
    """A rank called suspend_ready() after the current suspend request."""
    if att.suspend_requested_at is None:
        return False
    return any(r.ready_at is not None and r.ready_at >= att.suspend_requested_at - READY_CLOCK_SLACK_S
               for r in att.ranks)


def deadline(att: Attempt, now: float, *, kill_grace_s: float) -> Due | None:
    """The stop or kill due for ``att`` at ``now``; None: nothing is due."""
    grace = grace_s(att, kill_grace_s)
    if att.stopping:
        if not att.kill_sent and now - (att.term_sent_at or now) >= grace:
            return KILL
        return None
    alive = att.alive_ranks
    if not alive:
        return None
    failed = [r for r in att.ranks if r.ended and r.exit_code not in (0, None)]
    if failed:
        r0 = failed[0]
        return Due("stop", StopCause.RANK_FAILED, f"rank {r0.rank} exited with code {r0.exit_code}")
    if att.ready_at is not None:
        if now - att.ready_at >= min(READY_EXIT_WINDOW_S, grace):
            return Due("stop", StopCause.SUSPEND, "stopped after the job called suspend_ready()")
    elif att.suspend_requested_at is not None:
        if now - att.suspend_requested_at >= att.spec.suspend_grace_s:
            return Due("stop", StopCause.SUSPEND_TIMEOUT,
                       f"the job did not call suspend_ready() within suspend_grace_s={att.spec.suspend_grace_s:g}s")
    if att.started_at is None:
        return None
    ms = att.spec.max_runtime_s
    if ms is not None and now - att.started_at >= ms:
        return Due("stop", StopCause.MAX_RUNTIME, f"max_runtime_s={ms:g}s exceeded")
    wd = att.spec.log_watchdog_s
    if wd is not None:
        last = max(att.started_at, att.attached_at, att.last_output_at or 0.0, att.blind_at or 0.0)
        if now - last >= wd:
            return Due("stop", StopCause.LOG_WATCHDOG, f"no output for log_watchdog_s={wd:g}s")
    return None
