"""The simulator's policies by name: ``hai`` (this platform's scheduler, the live code), and the
baselines ``fifo`` (public HAI release), ``las`` (Tiresias 2D-LAS) and ``easy-fs`` (Slurm-style
fair share + EASY backfill)."""

from __future__ import annotations

from collections.abc import Callable

POLICIES = ("hai", "fifo", "las", "easy-fs")


def make_scheduler(name: str) -> Callable:
    """A fresh scheduler for one replay (baselines hold state: RNG, usage)."""
    if name == "hai":
        from hai.domain.scheduler import schedule

        return schedule
    if name == "fifo":
        from hai.sim.fifo import FifoScheduler

        return FifoScheduler(seed=0)
    if name == "las":
        from hai.sim.las import LasScheduler

        return LasScheduler()
    if name == "easy-fs":
        from hai.sim.easy_fs import EasyFsScheduler

        return EasyFsScheduler()
    raise ValueError(f"unknown policy {name!r}; one of {', '.join(POLICIES)}")
