"""The vocabularies that cross the agent protocol: what the server wants done with an attempt
and why an agent stopped one. Both are ``StrEnum``s, so on the wire they are the same plain
strings as before ("run", "suspend_timeout", ...), and ``str()``/f-strings give the value.

Shared by the protocol messages, the agent, the domain rules (``hai.domain.outcomes``) and the
services; a new member is a protocol change (see ``messages.SUPPORTED_VERSIONS``).
"""

from __future__ import annotations

from enum import StrEnum


class DesiredAction(StrEnum):
    """What the server wants done with an attempt (``Assignment.action``, ``Job.desired_action``)."""

    RUN = "run"  # keep the ranks running (launch them if they are not)
    SUSPEND = "suspend"  # ask the job to checkpoint (SDK), stop it once ready or after suspend_grace_s
    STOP = "stop"  # stop every rank now (SIGTERM, then SIGKILL after the grace period)


class StopCause(StrEnum):
    """Why an agent stopped an attempt's ranks (``AttemptStatus.stop_cause``, the machine-readable
    companion of ``stopped_reason``)."""

    REQUESTED = "requested"  # a stop assignment (or the agent shutting down with --stop-jobs-on-exit)
    SUSPEND = "suspend"  # stopped after the job called suspend_ready()
    SUSPEND_TIMEOUT = "suspend_timeout"  # suspend_grace_s expired before suspend_ready()
    MAX_RUNTIME = "max_runtime"  # the attempt ran longer than max_runtime_s
    LOG_WATCHDOG = "log_watchdog"  # no output for log_watchdog_s
    RANK_FAILED = "rank_failed"  # another rank of the attempt failed (or could not be started)
    UNASSIGNED = "unassigned"  # the server no longer assigns the attempt
    NOT_LAUNCHED = "not_launched"  # stop/suspend arrived for an attempt this node never launched
    # issue 13: the agent had not reached the server within its lease, and the ranks stopped
    # themselves (rankwrap --lease) before the server could give the job to another node
    FENCED = "fenced"
