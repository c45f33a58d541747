"""The scheduler's input (Snapshot) and output (Decisions).

One cycle: the service reads a Snapshot in one go, calls ``schedule(snapshot, policy, now)``
and persists the Decisions in one transaction. The snapshot is never mutated by planning.
All times are seconds (floats, epoch or virtual clock: the domain does not care).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from hai.domain.jobs import JobState, Priority


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    zone: str
    leaf: str
    gpus: int  # total GPUs on the node
    free_gpus: tuple[int, ...]  # indices of GPUs not held by any active job, sorted
    schedulable: bool = True  # False when draining, drained, unhealthy or lost


@dataclass(frozen=True, slots=True)
class Allocation:
    node: str
    gpus: tuple[int, ...]  # GPU indices on that node


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A job that holds GPUs now (starting, running or suspending)."""

    id: int
    user: str
    group: str
    priority: Priority  # effective priority now (after any demotion)
    nodes: int
    gpus_per_node: int
    allocations: tuple[Allocation, ...]
    state: JobState
    started_at: float  # start of the current attempt
    first_submitted_at: float  # FIFO key, kept across suspensions
    submitted_priority: Priority | None = None  # what the user asked for (ABOVE_NORMAL demotion)
    last_checkpoint_at: float | None = None  # last reported checkpoint in this attempt
    checkpoint_duration_s: float | None = None
    allow_cross_zone: bool = False
    min_runtime_s: float | None = None  # per-job override of the policy's minimum runtime
    suspend_requested_for: int | None = None  # the queued job this suspension frees GPUs for
    attained_gpu_s: float = 0.0  # GPU-seconds held in earlier attempts (this one: started_at..now)

    @property
    def gpu_count(self) -> int:
        return sum(len(a.gpus) for a in self.allocations)


@dataclass(frozen=True, slots=True)
class QueuedJob:
    id: int
    user: str
    group: str
    priority: Priority
    nodes: int
    gpus_per_node: int
    first_submitted_at: float  # FIFO key, kept across suspensions
    queued_at: float  # when it (re-)entered the queue; the waiting time counts from here
    submitted_priority: Priority | None = None
    allow_cross_zone: bool = False
    suspensions: int = 0
    reserved_nodes: tuple[str, ...] = ()  # nodes being freed for this job by suspensions
    attained_gpu_s: float = 0.0  # GPU-seconds held over its earlier attempts (attained service)

    @property
    def gpu_count(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Quota:
    group: str
    priority: Priority
    gpus: int
    user: str | None = None  # None: the whole group's quota at that priority


@dataclass(frozen=True, eq=False)
class QueueDelta:
    """How a snapshot's queue tuple differs from an earlier one (issue 12), as the caller that
    built both knows it: ``queued`` is ``base`` without the jobs of ``gone`` (ids) and with the
    jobs of ``changed`` (each arrived, or a new object for a job whose row changed, replacing
    the object of its id); every other job of ``queued`` is the very object it was in ``base``.
    A promise, not checked job by job: ``KeptQueue.sync`` then updates its order in O(changes)
    instead of proving O(queue) that the other jobs are the ones it kept. It applies only to
    the very tuples it names (``queued is snapshot.queued``, ``base`` the tuple of the kept
    queue's last sync): a snapshot whose queue was replaced (``dataclasses.replace``) drops it
    in effect. ``services.scheduling.QueueCache`` builds one from the rows it read."""

    base: tuple[QueuedJob, ...]
    queued: tuple[QueuedJob, ...]
    changed: tuple[QueuedJob, ...]
    gone: tuple[int, ...]


@dataclass(frozen=True)
class RunningDelta:
    """How a snapshot's running tuple differs from an earlier one (issue 12), as the caller that
    built both knows it: ``running`` is ``base`` without the objects of ``left`` and with those
    of ``came`` (each a job that started, or a new object for a job whose row or allocations
    changed); every other job of ``running`` is the very object it was in ``base``. A promise,
    not checked job by job, as ``QueueDelta`` is: what the cycle keeps about the running jobs
    (``quota.KeptCharges``) is then updated in O(changes). It applies only to the very tuples
    it names (``running is snapshot.running``, ``base`` the tuple the keeper last saw).
    ``services.scheduling.ActiveCache`` builds one from the rows it read."""

    base: tuple[RunningJob, ...]
    running: tuple[RunningJob, ...]
    came: tuple[RunningJob, ...]
    left: tuple[RunningJob, ...]


@dataclass(frozen=True)
class Snapshot:
    nodes: tuple[NodeView, ...]
    running: tuple[RunningJob, ...] = ()
    queued: tuple[QueuedJob, ...] = ()
    quotas: tuple[Quota, ...] = ()
    # each user's recent GPU usage (GPU-seconds, decayed with the policy's half-life) as of now
    usage: Mapping[str, float] = field(default_factory=dict)
    # (optional) how ``queued`` differs from an earlier snapshot's queue (QueueDelta): not part
    # of what the snapshot says, only a hint that spares the kept queue its proof
    queue_delta: QueueDelta | None = field(default=None, compare=False, repr=False)
    # (optional) how ``running`` differs from an earlier snapshot's (RunningDelta): a hint too
    running_delta: RunningDelta | None = field(default=None, compare=False, repr=False)


# The default service classes (issue 16): eight least-attained-service classes, x~3.2 apart, up to
# 3.25 M GPU-seconds (benchmarks/README.md, "Scheduling quality against Tiresias").
SERVICE_CLASSES_GPU_S: tuple[float, ...] = (1000.0, 3250.0, 10_000.0, 32_500.0, 100_000.0, 325_000.0, 1_000_000.0, 3_250_000.0)


@dataclass(frozen=True)
class Policy:
    """Every duration is a setting (HAI_SCHEDULER__*)."""

    min_runtime_s: float = 15 * 60
    demote_after_s: float = 30 * 60
    quantum_s: float = 4 * 3600
    wait_threshold_s: float = 15 * 60
    usage_half_life_s: float = 3600
    preemption: bool = True
    time_sharing: bool = True
    # at most this many waiting jobs start new suspensions in one cycle (bounds a cycle's cost;
    # suspensions take effect at checkpoints, minutes away, so the next cycle continues)
    max_preemptions_per_cycle: int = 32
    # least attained service within a priority level (issue 16; the default: eight classes;
    # empty: off, the FIFO levels, see FIFO_LEVELS).
    # Thresholds in GPU-seconds split each level into service classes: the queue is ordered by
    # class, then FIFO; a waiting one-node job may suspend jobs of its priority in a higher class
    # (past their minimum runtime), so short jobs overtake long ones without knowing durations.
    service_classes_gpu_s: tuple[float, ...] = SERVICE_CLASSES_GPU_S
    # a waiting job promoted to class 0 once it waited this many times its executed time
    # (Tiresias' starvation knob; 0: never)
    starvation_factor: float = 0.0
    # a quantum that grows with attained service: a job that resumes with A GPU-seconds attained
    # over g GPUs is not suspended for a job with less attained service before it ran
    # max(min_runtime_s, service_quantum_factor * A / g) in this attempt (0: the minimum runtime)
    service_quantum_factor: float = 0.0
    # the growing quantum only for jobs in this service class or above (0: every class): the
    # long jobs of the last classes run longer stretches, the short and middle ones still give
    # way after their minimum runtime
    service_quantum_min_class: int = 0
    # a running job that has waited (since its first submission, less the time it ran) at least
    # this many times the time it ran is not suspended for a job with less attained service: a
    # long job starved in the last classes keeps its GPUs once it gets them, until it has run
    # enough to be within the factor again (0: off; the default 0.5 met issue 16's scale-2 tail)
    service_protect_wait_factor: float = 0.5
    # the jobs kept by the two knobs above (a grown quantum, a long wait) are kept against
    # time-sharing too: they do not count as past the quantum while kept
    service_protect_time_sharing: bool = False
    # checkpoint-boundary preemption under least attained service: a running job is suspended
    # for a job with less attained service only within this many seconds after a checkpoint
    # (its last checkpoint, or its start), so it loses at most that much work; 0: any time (default 30)
    service_checkpoint_slack_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Start:
    job_id: int
    allocations: tuple[Allocation, ...]
    reason: str  # why this placement was chosen


class SuspendCode(StrEnum):
    """Why a job is suspended, for machines (the ``reason`` beside it is for people)."""

    OUTRANKED = "outranked"  # a waiting job of higher priority needs its GPUs
    TIME_SHARING = "time_sharing"  # it ran its quantum; a job of another user at its priority waited


@dataclass(frozen=True, slots=True)
class Suspend:
    job_id: int
    reason: str
    for_job_id: int | None = None
    code: SuspendCode = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class Demote:
    job_id: int
    to: Priority
    reason: str


@dataclass
class Decisions:
    starts: list[Start] = field(default_factory=list)
    suspends: list[Suspend] = field(default_factory=list)
    demotions: list[Demote] = field(default_factory=list)
    # queued job id -> nodes reserved for it (the GPUs its victims are freeing)
    reservations: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # queued job id -> why it is still waiting, in words a person understands
    pending_reasons: dict[int, str] = field(default_factory=dict)


# The policy before least attained service became the default (issue 16): FIFO within a priority
# level, no service classes. Tests and benchmarks that pin that behaviour set it explicitly:
# ``Policy(**FIFO_LEVELS)``.
FIFO_LEVELS = {"service_classes_gpu_s": (), "service_checkpoint_slack_s": 0.0, "service_protect_wait_factor": 0.0}
