"""Helpers for tests of the agent (and of systems that embed it). Stdlib + hai.protocol only."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from hai.protocol import Assignment, LaunchSpec

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float = 20.0, interval: float = 0.05,
             step: Callable[[], object] | None = None, what: str = "condition") -> T:
    """Wait until ``cond()`` is truthy (calling ``step()`` before each check); returns its value.
    Raises AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if step is not None:
            step()
        v = cond()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def assignment(job_id: int, command: list[str], *, attempt: int = 0, action: str = "run",
               job_type: str = "command", gpus: list[int] | None = None, node_rank: int = 0, nnodes: int = 1,
               gpus_per_node: int | None = None, master_addr: str = "127.0.0.1", master_port: int = 29500,
               **spec_fields) -> Assignment:
    gpus = [0] if gpus is None else gpus
    spec = LaunchSpec(job_name=f"job-{job_id}", user="tester", command=command, job_type=job_type,  # type: ignore[arg-type]
                      gpus=gpus, node_rank=node_rank, nnodes=nnodes,
                      gpus_per_node=gpus_per_node if gpus_per_node is not None else len(gpus),
                      master_addr=master_addr, master_port=master_port, **spec_fields)
    return Assignment(job_id=job_id, attempt=attempt, action=action, spec=spec)  # type: ignore[arg-type]
