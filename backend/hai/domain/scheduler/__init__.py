"""Pure scheduling: snapshot in, decisions out, ``now`` passed in."""

from hai.domain.scheduler.core import collector_paused, schedule
from hai.domain.scheduler.kept import KeptQueue
from hai.domain.scheduler.model import (
    Allocation,
    Decisions,
    Demote,
    NodeView,
    Policy,
    QueuedJob,
    QueueDelta,
    Quota,
    RunningDelta,
    RunningJob,
    Snapshot,
    Start,
    Suspend,
    SuspendCode,
)

__all__ = [
    "Allocation",
    "collector_paused",
    "Decisions",
    "KeptQueue",
    "Demote",
    "NodeView",
    "Policy",
    "QueuedJob",
    "QueueDelta",
    "Quota",
    "RunningDelta",
    "RunningJob",
    "Snapshot",
    "Start",
    "Suspend",
    "SuspendCode",
    "schedule",
]
