"""The job lifecycle: states, priorities, job types and the one legal-transition table.

Every state change in the system goes through ``services.jobs.transition``, which asks
``check_transition`` here first. Nothing else decides whether a change is legal.
"""

from __future__ import annotations

from enum import Enum

from hai.protocol.vocab import DesiredAction


class JobState(str, Enum):
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUSPENDING = "suspending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES

    @property
    def active(self) -> bool:
        """Holds GPUs on nodes (an attempt is placed)."""
        return self in ACTIVE_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE_STATES = frozenset({JobState.STARTING, JobState.RUNNING, JobState.SUSPENDING})


class Priority(str, Enum):
    LOW = "LOW"
    NORMAL = "NORMAL"
    ABOVE_NORMAL = "ABOVE_NORMAL"
    HIGH = "HIGH"
    VERY_HIGH = "VERY_HIGH"
    EXTREME_HIGH = "EXTREME_HIGH"

    @property
    def rank(self) -> int:
        return _PRIORITY_RANK[self]

    def __lt__(self, other: object) -> bool:  # type: ignore[override]
        if not isinstance(other, Priority):
            return NotImplemented
        return self.rank < other.rank

    def __le__(self, other: object) -> bool:  # type: ignore[override]
        if not isinstance(other, Priority):
            return NotImplemented
        return self.rank <= other.rank

    def __gt__(self, other: object) -> bool:  # type: ignore[override]
        if not isinstance(other, Priority):
            return NotImplemented
        return self.rank > other.rank

    def __ge__(self, other: object) -> bool:  # type: ignore[override]
        if not isinstance(other, Priority):
            return NotImplemented
        return self.rank >= other.rank


_PRIORITY_RANK = {p: i for i, p in enumerate(Priority)}


class JobType(str, Enum):
    COMMAND = "command"  # one process per node
    TORCH = "torch"  # one process per GPU with the torch.distributed environment
    HFREDUCE = "hfreduce"  # as torch, plus NUMA-local CPU binding and NIC choice


class IllegalTransition(Exception):
    def __init__(self, current: JobState, target: JobState):
        super().__init__(f"a job in state '{current.value}' cannot become '{target.value}'")
        self.current = current
        self.target = target


# FROM -> allowed TO states. Terminal states allow nothing, except FAILED -> QUEUED (faulty node).
_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.STARTING, JobState.CANCELLED, JobState.FAILED}),
    JobState.STARTING: frozenset(
        {
            JobState.RUNNING,
            JobState.SUSPENDING,
            JobState.SUCCEEDED,  # a very short job can end before its start is confirmed
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.QUEUED,  # requeued: its node was lost before it ran
        }
    ),
    JobState.RUNNING: frozenset(
        {
            JobState.SUSPENDING,
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.QUEUED,  # requeued: its node was lost
        }
    ),
    JobState.SUSPENDING: frozenset(
        {
            JobState.QUEUED,  # suspended: back in line, suspensions + 1
            JobState.SUCCEEDED,  # finished before it reached its checkpoint
            JobState.FAILED,
            JobState.CANCELLED,
        }
    ),
    JobState.SUCCEEDED: frozenset(),
    # issue 10: a job that failed on a node found faulty within validation.fault_window_s after
    # the failure was not the user's failure: it is requeued from its last checkpoint (a restart)
    JobState.FAILED: frozenset({JobState.QUEUED}),
    JobState.CANCELLED: frozenset(),
}


def allowed_targets(current: JobState) -> frozenset[JobState]:
    return _TRANSITIONS[current]


def check_transition(current: JobState, target: JobState) -> None:
    """Raise IllegalTransition unless current -> target is in the table."""
    if target not in _TRANSITIONS[current]:
        raise IllegalTransition(current, target)


def assignment_action(state: JobState, desired: DesiredAction | str, *, current_attempt: bool) -> DesiredAction:
    """What an agent holding one of the job's attempts is told to do with it: an older attempt
    and a job that is neither starting, running (and meant to run) nor suspending is stopped."""
    if not current_attempt:
        return DesiredAction.STOP
    if state in (JobState.STARTING, JobState.RUNNING) and desired == DesiredAction.RUN:
        return DesiredAction.RUN
    if state == JobState.SUSPENDING:
        return DesiredAction.SUSPEND
    return DesiredAction.STOP
