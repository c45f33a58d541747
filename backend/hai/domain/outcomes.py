"""What the agents' reports mean for a job: a few named rules over plain report records.

The service (``services/reports.py``) turns each node's last report for the job's current
attempt into a :class:`NodeReport`, asks :func:`judge` for the :class:`Outcome`, and carries it
out through ``services.jobs.transition``. Nothing here touches the database.

In the spirit of Prefect's orchestration rules, each rule names the states it applies
``from`` and the state it leads ``to``; :data:`RULES` holds them in precedence order, and the
first rule that fires decides:

0. ``fenced``             a node's agent lost the server past its lease
                          and its ranks stopped themselves               -> queued
                          (a restart, not the job's failure: issue 13)
1. ``launch_failed``      a node could not launch the attempt            -> failed
2. ``rank_failed``        a limit the agent enforced, or a rank that
                          exited non-zero (while suspending: exited
                          without reaching a checkpoint)                -> failed
3. ``suspended``          suspending, every node done, at a checkpoint
                          or stopped by the agent                        -> queued
4. ``succeeded``          every rank exited 0                            -> succeeded
5. ``all_ranks_started``  starting, every expected rank reported         -> running
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from hai.domain.jobs import JobState
from hai.protocol.vocab import StopCause

# causes of an agent-side stop that are the job's own failure
FAILING_STOPS = frozenset({StopCause.MAX_RUNTIME, StopCause.LOG_WATCHDOG})


@dataclass(frozen=True, slots=True)
class RankReport:
    rank: int  # global rank
    running: bool
    exit_code: int | None = None


@dataclass(frozen=True, slots=True)
class NodeReport:
    """One node's last report for the attempt (the protocol's AttemptStatus, as plain facts)."""

    node: str
    node_rank: int
    ranks: tuple[RankReport, ...] = ()
    launch_error: str | None = None
    suspend_ready: bool = False
    stopped_reason: str | None = None
    stop_cause: StopCause | str | None = None  # a string: a cause a newer agent named
    finished: bool = False

    def has_all_ranks(self, expected: int) -> bool:
        return len(self.ranks) >= expected

    @property
    def all_exited(self) -> bool:
        return all(not r.running for r in self.ranks)

    def done_with(self, expected: int) -> bool:
        """Nothing of the attempt runs on this node any more, and nothing more will start here:
        the node's GPUs can be released."""
        if any(r.running for r in self.ranks):
            return False
        return self.finished or self.launch_error is not None or self.has_all_ranks(expected)


@dataclass(frozen=True, slots=True)
class AttemptReports:
    """The facts a rule reads: the job's state, how many ranks each node should report, how
    many nodes hold the attempt, and the reports received so far (in node-rank order)."""

    state: JobState
    expected_ranks: int  # per node: 1 for a command job, gpus_per_node otherwise
    nodes: int  # allocations of the current attempt
    reports: tuple[NodeReport, ...]

    @property
    def every_node_reported(self) -> bool:
        return len(self.reports) == self.nodes

    @property
    def complete(self) -> bool:
        """Every node reported every rank it should run."""
        return self.every_node_reported and all(r.has_all_ranks(self.expected_ranks) for r in self.reports)

    @property
    def all_exited(self) -> bool:
        return self.complete and all(r.all_exited for r in self.reports)

    @property
    def all_stopped(self) -> bool:
        """Every node is done with the attempt (finished, or every rank reported and exited)."""
        return self.every_node_reported and all(
            r.finished or (r.has_all_ranks(self.expected_ranks) and r.all_exited) for r in self.reports
        )

    @property
    def at_checkpoint(self) -> bool:
        """The job said its checkpoint is safe (or nothing ever ran: nothing to lose)."""
        never_ran = all(r.stop_cause == StopCause.NOT_LAUNCHED for r in self.reports)
        return never_ran or any(r.suspend_ready for r in self.reports)

    @property
    def forced_reason(self) -> str | None:
        """Why an agent stopped ranks itself (the first node's reason), if one did."""
        for r in self.reports:
            if r.stopped_reason or r.stop_cause:
                return r.stopped_reason or str(r.stop_cause)
        return None


class Verdict(StrEnum):
    REQUEUED = "requeued"  # the attempt ended for the infrastructure's sake: run it again
    FAILED = "failed"
    SUSPENDED = "suspended"
    SUCCEEDED = "succeeded"
    RUNNING = "running"


@dataclass(frozen=True, slots=True)
class Outcome:
    verdict: Verdict
    rule: str  # the name of the rule that decided
    reason: str = ""  # for the job event (suspended: see suspension_reason)
    exit_code: int | None = None
    at_checkpoint: bool = False  # suspended: at a checkpoint (else stopped without one)
    forced_reason: str | None = None  # suspended without a checkpoint: why the agent stopped it

    @property
    def target(self) -> JobState:
        return _TARGET[self.verdict]


_TARGET = {
    Verdict.REQUEUED: JobState.QUEUED,
    Verdict.FAILED: JobState.FAILED,
    Verdict.SUSPENDED: JobState.QUEUED,
    Verdict.SUCCEEDED: JobState.SUCCEEDED,
    Verdict.RUNNING: JobState.RUNNING,
}


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    from_states: frozenset[JobState]
    to_state: JobState
    apply: Callable[[AttemptReports], Outcome | None]


_STARTED = frozenset({JobState.STARTING, JobState.RUNNING})
_ACTIVE = _STARTED | {JobState.SUSPENDING}


def _fenced(f: AttemptReports) -> Outcome | None:
    """A node whose agent could not reach the server stopped its ranks (the server is about to
    give the job away, or has); the other nodes' ranks fail in consequence. Requeued at once,
    as when the server itself finds the node lost."""
    for r in f.reports:
        if r.stop_cause == StopCause.FENCED:
            return Outcome(Verdict.REQUEUED, "fenced",
                           reason=f"node {r.node}'s agent lost the server past its lease and stopped the ranks; requeued")
    return None


def _launch_failed(f: AttemptReports) -> Outcome | None:
    for r in f.reports:
        if r.launch_error:
            return Outcome(Verdict.FAILED, "launch_failed", reason=f"could not launch on node {r.node}: {r.launch_error}")
    return None


def first_failure(reports: tuple[NodeReport, ...]) -> tuple[str, int | None] | None:
    """Why the attempt failed, if it did: a limit the agent enforced, else the rank that exited
    with its own non-zero code (before ranks that were merely signalled to stop)."""
    for r in sorted(reports, key=lambda r: r.node_rank):
        if r.stop_cause in FAILING_STOPS or (r.stopped_reason and r.stop_cause is None):
            return f"stopped on node {r.node}: {r.stopped_reason or r.stop_cause}", None
    bad = [(r, k) for r in reports for k in r.ranks if not k.running and k.exit_code not in (0, None)]
    if not bad:
        return None
    node, rank = min(bad, key=lambda p: (p[1].exit_code < 0, p[0].node_rank, p[1].rank))  # type: ignore[operator]
    return f"rank {rank.rank} on node {node.node} exited with code {rank.exit_code}", rank.exit_code


def _nonzero_codes(f: AttemptReports) -> list[int]:
    return [k.exit_code for r in f.reports for k in r.ranks if k.exit_code not in (0, None)]  # type: ignore[misc]


def _all_zero(f: AttemptReports) -> bool:
    return all(k.exit_code == 0 for r in f.reports for k in r.ranks)


def _rank_failed(f: AttemptReports) -> Outcome | None:
    if f.state == JobState.SUSPENDING:
        # a rank that exits while its job suspends is judged once every node is done
        if not f.all_stopped or f.at_checkpoint or f.forced_reason or _all_zero(f):
            return None
        codes = _nonzero_codes(f)
        return Outcome(Verdict.FAILED, "rank_failed", reason="exited while suspending without reaching a checkpoint",
                       exit_code=codes[0] if codes else None)
    failure = first_failure(f.reports)
    if failure is None:
        return None
    reason, code = failure
    return Outcome(Verdict.FAILED, "rank_failed", reason=reason, exit_code=code)


def _suspended(f: AttemptReports) -> Outcome | None:
    if not f.all_stopped:
        return None
    ready, forced = f.at_checkpoint, f.forced_reason
    if not (ready or forced):
        return None
    return Outcome(Verdict.SUSPENDED, "suspended", at_checkpoint=ready, forced_reason=forced)


def _succeeded(f: AttemptReports) -> Outcome | None:
    if f.state == JobState.SUSPENDING:
        # exited 0 by itself while asked to suspend (neither ready nor stopped by the agent)
        done = f.all_stopped and not f.at_checkpoint and not f.forced_reason and _all_zero(f)
    else:
        done = f.all_exited  # a non-zero exit was caught by rank_failed
    return Outcome(Verdict.SUCCEEDED, "succeeded", reason="every rank exited 0", exit_code=0) if done else None


def _all_ranks_started(f: AttemptReports) -> Outcome | None:
    return Outcome(Verdict.RUNNING, "all_ranks_started", reason="all ranks started") if f.complete else None


FENCED = Rule("fenced", _ACTIVE, JobState.QUEUED, _fenced)
LAUNCH_FAILED = Rule("launch_failed", _ACTIVE, JobState.FAILED, _launch_failed)
RANK_FAILED = Rule("rank_failed", _ACTIVE, JobState.FAILED, _rank_failed)
SUSPENDED = Rule("suspended", frozenset({JobState.SUSPENDING}), JobState.QUEUED, _suspended)
SUCCEEDED = Rule("succeeded", _ACTIVE, JobState.SUCCEEDED, _succeeded)
ALL_RANKS_STARTED = Rule("all_ranks_started", frozenset({JobState.STARTING}), JobState.RUNNING, _all_ranks_started)

RULES: tuple[Rule, ...] = (FENCED, LAUNCH_FAILED, RANK_FAILED, SUSPENDED, SUCCEEDED, ALL_RANKS_STARTED)


def judge(facts: AttemptReports) -> Outcome | None:
    """The outcome of the first rule (in :data:`RULES` order) that applies and fires; None:
    the reports change nothing yet."""
    for rule in RULES:
        if facts.state in rule.from_states:
            outcome = rule.apply(facts)
            if outcome is not None:
                return outcome
    return None


def suspension_reason(
    outcome: Outcome, *, checkpoint_step: int | None, safe_at: float, now: float, gpus: int
) -> tuple[str, float]:
    """The job event's reason for a suspension and the GPU-seconds of work it lost (zero at a
    checkpoint; else the time since the last safe point — the last checkpoint or the attempt's
    start, ``safe_at`` — times the job's GPUs)."""
    if outcome.at_checkpoint:
        reason = "suspended at its checkpoint"
        if checkpoint_step is not None:
            reason += f" (step {checkpoint_step})"
        return reason, 0.0
    lost = max(0.0, now - safe_at) * gpus
    return f"stopped without a checkpoint ({outcome.forced_reason}); {lost:.0f} GPU-seconds of work lost", lost
