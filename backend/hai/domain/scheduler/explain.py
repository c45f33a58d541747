"""Words for people: durations and the sentences the scheduler records.

The explanations are functions of (job, facts, policy): they read the cycle's state, never
change it, so one sentence can be cached per key by the cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hai.domain.scheduler.model import Policy, QueuedJob
    from hai.domain.scheduler.placement import FreeIndex
    from hai.domain.scheduler.victims import VictimFacts


def fmt_duration(seconds: float) -> str:
    """900 -> '15 min', 14400 -> '4 h', 5400 -> '1 h 30 min', 42 -> '42 s'."""
    s = round(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    minutes, _ = divmod(s, 60)
    hours, minutes = divmod(minutes, 60)
    if hours == 0:
        return f"{minutes} min"
    if minutes == 0:
        return f"{hours} h"
    return f"{hours} h {minutes} min"


def plural(n: int, word: str, words: str | None = None) -> str:
    return f"{n} {word if n == 1 else (words or word + 's')}"


def waiting_for_checkpoints(n: int, nodes: tuple[str, ...]) -> str:
    shown = ", ".join(nodes[:4]) + (f" and {len(nodes) - 4} more" if len(nodes) > 4 else "")
    return f"waiting for {plural(n, 'job')} to reach a checkpoint; {plural(len(nodes), 'node')} reserved ({shown})"


def demotion_sentence(ran_s: float, demote_after_s: float) -> str:
    return f"ran {fmt_duration(ran_s)} at ABOVE_NORMAL; demoted to NORMAL after {fmt_duration(demote_after_s)}"


def outranked_sentence(job: QueuedJob, victim_priority: str, ran_s: float, min_runtime_s: float, lost: float) -> str:
    return (
        f"suspend at its next checkpoint for job {job.id} ({job.priority.value} outranks"
        f" {victim_priority}); it ran {fmt_duration(ran_s)} (minimum {fmt_duration(min_runtime_s)}),"
        f" ~{lost:.0f} GPU-seconds since its last checkpoint"
    )


def time_sharing_sentence(
    job: QueuedJob, victim_priority: str, ran_s: float, quantum_s: float, waited_s: float, lost: float
) -> str:
    return (
        f"time-sharing: it ran {fmt_duration(ran_s)}, past the {fmt_duration(quantum_s)} quantum at"
        f" {victim_priority}; job {job.id} of user {job.user} has waited"
        f" {fmt_duration(waited_s)}; ~{lost:.0f} GPU-seconds since its last checkpoint"
    )


def placement_failure(job: QueuedJob, index: FreeIndex, reserved: int, cross_ok: bool) -> str:
    """Why ``job`` cannot be placed on the free capacity of ``index`` (``reserved``: nodes held
    back for other jobs; ``cross_ok``: it may span zones now)."""
    idx = index
    tail = f" ({plural(reserved, 'node')} reserved for other jobs)" if reserved else ""
    if job.nodes == 1:
        g = job.gpus_per_node
        if g > idx.max_gpus:
            return f"needs {g} GPUs on one node but the largest node has {idx.max_gpus}; ask for whole nodes"
        most = max(idx.max_free_partial(), idx.largest_idle_gpus())
        return f"needs {g} GPU(s) on one node; the most free on any available node is {most}{tail}"
    k = job.nodes
    largest_zone = max(idx.zone_size, default=0)
    best, best_zone = 0, None
    for z, zone in enumerate(idx.zones):
        c = sum(c for c, _ in idx.leaf_counts(z, job.gpus_per_node))
        if c > best or best_zone is None:
            best, best_zone = c, zone
    if k > largest_zone and not job.allow_cross_zone:
        return (
            f"needs {k} whole nodes in one zone but the largest zone has {largest_zone} schedulable nodes;"
            " it can only run with allow_cross_zone"
        )
    msg = f"needs {k} whole nodes in one zone; largest free block is {plural(best, 'node')}"
    if best_zone is not None:
        msg += f" in zone {best_zone}"
    if job.allow_cross_zone and not cross_ok:
        msg += "; another cross-zone job is running (one at a time)"
    elif job.allow_cross_zone:
        total = sum(c for c, _ in idx.leaf_counts(None, job.gpus_per_node))
        msg += f"; {total} free across zones"
    return msg + tail


def waiting_note(job: QueuedJob, rank: int, facts: VictimFacts, policy: Policy, variant: int, deferred: bool) -> str:
    """What preemption could not do for a waiting job (of effective ``rank``), appended to its
    placement failure. ``variant`` (time-sharing was tried): 0 not tried, 1 no job of another
    user at its priority has run its quantum, 2 some have but freeing them does not make room."""
    parts: list[str] = []
    if deferred:
        parts.append(
            f"suspending other jobs may make room; this cycle already planned {policy.max_preemptions_per_cycle}"
            " preemptions, the next cycle continues"
        )
    elif policy.preemption and facts.snap.running:
        young = facts.young_lower(rank)
        if young:
            parts.append(
                f"{plural(young, 'lower-priority job')} could make room but"
                f" {'has' if young == 1 else 'have'} run less than the {fmt_duration(policy.min_runtime_s)} minimum"
            )
        if variant == 2:
            parts.append(
                f"time-sharing: no job of another user at {job.priority.value} that has run its"
                f" {fmt_duration(policy.quantum_s)} quantum can make room"
            )
        elif variant == 1:
            parts.append(
                f"time-sharing: no job of another user at {job.priority.value} has run its"
                f" {fmt_duration(policy.quantum_s)} quantum yet"
            )
    return "".join("; " + p for p in parts)
