"""The node states, one vocabulary for protocol, domain and services (issue 9/10)."""

from __future__ import annotations

from enum import Enum


class NodeState(str, Enum):
    READY = "ready"  # takes work
    DRAINING = "draining"  # an admin drained it; its jobs are moving off at their checkpoints
    DRAINED = "drained"  # no job holds GPUs there; waits for an undrain
    UNHEALTHY = "unhealthy"  # a critical validator check failed; waits for an undrain
    LOST = "lost"  # its agent went silent (or has not registered yet)
