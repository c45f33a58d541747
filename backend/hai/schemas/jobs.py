from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, model_validator, field_validator

from hai.domain.jobs import JobState, JobType, Priority
from hai.protocol.messages import json_types_only
from hai.schemas.common import NO_NUL_PATTERN, Text


# issue 13: the most a job's argv and environment may weigh (bytes of UTF-8, with one NUL per
# string, as execve counts them); Linux refuses a single string over 128 KiB anyway
MAX_COMMAND_BYTES = 64 * 1024
MAX_ENV_BYTES = 64 * 1024


class JobCreate(BaseModel):
    # a number that is not finite (1e400 reads as infinity) is refused: no job runs forever by a
    # typo, and every database and JSON reply holds the values sent
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    _json_types = model_validator(mode="before")(classmethod(json_types_only))  # issue 13

    name: Text = Field(min_length=1, max_length=128)
    command: list[str] = Field(
        min_length=1,
        description="argv; never run through a shell",
        # what the validator below checks, stated in the schema (issue 13): no NUL, a program
        json_schema_extra={"items": {"type": "string", "pattern": NO_NUL_PATTERN},
                           "prefixItems": [{"type": "string", "pattern": "\\S"}]},
    )
    nodes: int = Field(default=1, ge=1, le=4096)
    gpus_per_node: int = Field(
        default=8, ge=1, le=8, description="a job of more than one node takes whole nodes of this many GPUs"
    )
    priority: Priority = Priority.NORMAL
    env: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra={"propertyNames": {"pattern": "^[^=\\x00]+$"},
                           "additionalProperties": {"type": "string", "pattern": NO_NUL_PATTERN}},
    )
    job_type: JobType = JobType.COMMAND
    max_runtime_s: float | None = Field(default=None, gt=0)
    tags: list[Text] = Field(default_factory=list, max_length=32)
    allow_cross_zone: bool = False
    suspend_grace_s: float = Field(default=60.0, gt=0, le=24 * 3600)
    log_watchdog_s: float | None = Field(default=None, gt=0)

    @field_validator("command")
    @classmethod
    def _command_not_blank(cls, v: list[str]) -> list[str]:
        if not v[0].strip():
            raise ValueError("the program (first argument) must not be empty")
        size = sum(len(a.encode()) + 1 for a in v)
        if size > MAX_COMMAND_BYTES:
            raise ValueError(f"the command is {size} bytes; at most {MAX_COMMAND_BYTES} are accepted")
        if any("\0" in a for a in v):
            raise ValueError("arguments must not contain NUL characters")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not key or "=" in key or "\0" in key:
                raise ValueError(f"invalid environment variable name {key!r}")
        if any("\0" in value for value in v.values()):
            raise ValueError("environment values must not contain NUL characters")
        size = sum(len(k.encode()) + len(val.encode()) + 2 for k, val in v.items())
        if size > MAX_ENV_BYTES:
            raise ValueError(f"the environment is {size} bytes; at most {MAX_ENV_BYTES} are accepted")
        return v


MAX_BATCH_JOBS = 1000


class JobBatchCreate(BaseModel):
    """Several jobs in one request (issue 12: CI submits in bursts, sweeps submit many alike, as
    Slurm's job arrays do): all are queued, in order, or none is."""

    model_config = ConfigDict(extra="forbid")

    jobs: list[JobCreate] = Field(min_length=1, max_length=MAX_BATCH_JOBS,
                                  description=f"the jobs, 1 to {MAX_BATCH_JOBS}; their ids follow this order")


class PlacementRead(BaseModel):
    node: str
    zone: str
    leaf: str
    gpus: list[int]


class JobEventRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    at: datetime
    from_state: str | None
    to_state: str
    reason: str


class CheckpointRead(BaseModel):
    path: str
    step: int | None = None
    at: float
    duration_s: float | None = None


class ProgressRead(BaseModel):
    step: int
    total: int | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    at: float


class JobRead(BaseModel):
    id: int
    name: str
    user: str
    group: str
    state: JobState
    priority: Priority
    submitted_priority: Priority
    nodes: int
    gpus_per_node: int
    job_type: JobType
    command: list[str]
    env: dict[str, str]
    tags: list[str]
    allow_cross_zone: bool
    max_runtime_s: float | None
    suspend_grace_s: float
    log_watchdog_s: float | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    exit_code: int | None
    failure_reason: str | None
    attempt: int
    suspensions: int
    restarts: int
    held: bool = Field(description="suspended by its owner; `resume` queues it again")
    placement: list[PlacementRead]
    placement_reason: str | None
    pending_reason: str | None
    last_checkpoint: CheckpointRead | None
    progress: ProgressRead | None
    lost_gpu_s: float
    events: list[JobEventRead]


class JobList(BaseModel):
    items: list[JobRead]
    total: int = Field(description="the jobs that match the filter (every page's, not only below `before_id`): "
                       "exact when `total_exact`, else a lower bound (there are more than `total`)")
    total_exact: bool = Field(True, description="false when the count stopped at its cap (10,000 jobs, or the "
                              "page's depth) to stay cheap; ask `count=exact` for the exact figure")


class JobBatchRead(BaseModel):
    jobs: list[JobRead] = Field(description="the jobs created (or, for a replayed Idempotency-Key, created "
                                "before), in the order they were sent")
