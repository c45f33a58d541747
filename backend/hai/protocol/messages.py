from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hai.protocol.vocab import DesiredAction, StopCause

PROTOCOL_VERSION = 1
# The server accepts agents speaking any of these versions.
SUPPORTED_VERSIONS = frozenset({1})

__all__ = [
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "DesiredAction",
    "StopCause",
    "GpuInfo",
    "GpuMetrics",
    "NicInfo",
    "RankStatus",
    "CheckpointInfo",
    "ProgressInfo",
    "AttemptStatus",
    "AgentHello",
    "Heartbeat",
    "LaunchSpec",
    "Assignment",
    "ServerReply",
    "LogLine",
    "LogBatch",
    "LogAck",
]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="ignore")  # newer peers may add fields


class GpuInfo(_Msg):
    index: int
    uuid: str
    model: str
    memory_total_mib: int
    numa_node: int | None = None


class GpuMetrics(_Msg):
    index: int
    uuid: str
    util_pct: float = 0.0
    memory_used_mib: int = 0
    memory_total_mib: int = 0
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_uncorrected: int | None = None


class NicInfo(_Msg):
    name: str  # e.g. mlx5_0
    numa_node: int | None = None


class RankStatus(_Msg):
    rank: int  # global rank
    local_rank: int
    pid: int | None = None
    state: Literal["running", "exited"] = "running"
    exit_code: int | None = None


class CheckpointInfo(_Msg):
    path: str
    step: int | None = None
    at: float  # epoch seconds when the checkpoint became safe
    duration_s: float | None = None


class ProgressInfo(_Msg):
    step: int
    total: int | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    at: float


class AttemptStatus(_Msg):
    job_id: int
    attempt: int
    ranks: list[RankStatus] = Field(default_factory=list)
    launch_error: str | None = None  # the attempt could not be launched at all
    suspend_ready: bool = False  # the job said its checkpoint is safe
    stopped_reason: str | None = None  # why the agent stopped ranks (grace expired, watchdog, runtime)
    checkpoint: CheckpointInfo | None = None
    progress: ProgressInfo | None = None
    # Added by the agent (optional, older peers ignore them):
    # every rank of this attempt on this node has ended (or it could not be launched); the status
    # is final and the agent keeps sending it until the attempt is no longer assigned.
    finished: bool = False
    # machine-readable companion of stopped_reason (StopCause: "requested", "suspend",
    # "suspend_timeout", "max_runtime", "log_watchdog", "rank_failed", "unassigned",
    # "not_launched"). A cause this side does not know (a newer peer) stays a plain string.
    stop_cause: StopCause | str | None = Field(default=None, union_mode="left_to_right")
    started_at: float | None = None  # epoch seconds when the ranks were launched
    finished_at: float | None = None  # epoch seconds when the last rank here ended
    suspend_requested_at: float | None = None  # when the agent delivered the suspend request
    # issue 13: writes the job could not make for lack of space ("<path>: <error>"), as the SDK
    # reported them (hai.sdk.StorageFull); the server records each once as a job event
    storage_errors: list[str] = Field(default_factory=list)


class AgentHello(_Msg):
    """Handshake: sent when the agent starts and whenever the server asks it to re-register."""

    protocol_version: int = PROTOCOL_VERSION
    node: str
    zone: str | None = None
    leaf: str | None = None
    address: str  # reachable address of the node (MASTER_ADDR for jobs whose rank 0 is here)
    gpus: list[GpuInfo]
    nics: list[NicInfo] = Field(default_factory=list)
    fake_gpus: bool = False
    agent_version: str = "0"
    attempts: list[AttemptStatus] = Field(default_factory=list)  # reattached after a restart


class Heartbeat(_Msg):
    protocol_version: int = PROTOCOL_VERSION
    node: str
    gpus: list[GpuMetrics] = Field(default_factory=list)
    attempts: list[AttemptStatus] = Field(default_factory=list)
    # long poll: the server may hold the reply up to this long until the node's assignments change
    wait_s: float = Field(default=0.0, ge=0.0, le=60.0)
    # a digest of the assignments the agent holds; the server answers at once if its own differs
    assignments_digest: str | None = None
    # issue 10: finished validator runs, repeated until a reply no longer lists them
    validations: list["ValidationReport"] = Field(default_factory=list)


class LaunchSpec(_Msg):
    job_name: str
    user: str
    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    job_type: Literal["command", "torch", "hfreduce"] = "command"
    gpus: list[int]  # GPU indices on this node
    node_rank: int
    nnodes: int
    gpus_per_node: int
    master_addr: str
    master_port: int
    restart_count: int = 0
    resume_from: str | None = None
    suspend_grace_s: float = 60.0
    log_watchdog_s: float | None = None
    max_runtime_s: float | None = None
    # Added by the agent (optional): working directory of the ranks (default: the agent's), and
    # seconds between SIGTERM and SIGKILL when stopping (default: the agent's --kill-grace).
    cwd: str | None = None
    stop_grace_s: float | None = None


class Assignment(_Msg):
    job_id: int
    attempt: int
    # DesiredAction: run (keep the ranks running, launch them if they are not); suspend (ask the
    # job to checkpoint through the SDK, stop it once ready or after suspend_grace_s); stop (stop
    # every rank now: SIGTERM, then SIGKILL after the grace period)
    action: DesiredAction
    spec: LaunchSpec


class ServerReply(_Msg):
    protocol_version: int = PROTOCOL_VERSION
    node: str
    assignments: list[Assignment] = Field(default_factory=list)
    assignments_digest: str
    heartbeat_interval_s: float = 1.0
    reregister: bool = False  # the server does not know this node: send AgentHello again
    # issue 10: validator runs the server waits for (each run id is run once by the agent)
    validations: list["ValidationRequest"] = Field(default_factory=list)
    # issue 13 (optional, older agents ignore it): the server gives a node's work away once its
    # agent has been silent this long; the agent fences itself before that (its ranks stop once
    # it has not reached the server for most of this time), so no job runs twice.
    lost_after_s: float | None = None


class LogLine(_Msg):
    job_id: int
    attempt: int
    rank: int
    seq: int  # per (job, attempt, rank), from 0, so a re-sent batch is not stored twice
    ts: float
    stream: Literal["stdout", "stderr", "system"] = "stdout"
    line: str


class LogBatch(_Msg):
    protocol_version: int = PROTOCOL_VERSION
    node: str
    # lines the agent dropped because its buffer overflowed arrive as a "system" line
    # ("[hai] N lines dropped ...") in the same sequence, so the gap is visible and counted
    lines: list[LogLine] = Field(default_factory=list)


class LogAck(_Msg):
    accepted: int


# issue 10: validator messages (their own module); resolve the forward references above
from hai.protocol.validation import ValidationReport, ValidationRequest  # noqa: E402

Heartbeat.model_rebuild()
ServerReply.model_rebuild()
