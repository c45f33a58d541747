from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hai.domain.jobs import JobState, JobType, Priority


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    command: list[str] = Field(min_length=1, description="argv; never run through a shell")
    nodes: int = Field(default=1, ge=1, le=4096)
    gpus_per_node: int = Field(
        default=8, ge=1, le=8, description="a job of more than one node takes whole nodes of this many GPUs"
    )
    priority: Priority = Priority.NORMAL
    env: dict[str, str] = Field(default_factory=dict)
    job_type: JobType = JobType.COMMAND
    max_runtime_s: float | None = Field(default=None, gt=0)
    tags: list[str] = Field(default_factory=list, max_length=32)
    allow_cross_zone: bool = False
    suspend_grace_s: float = Field(default=60.0, gt=0, le=24 * 3600)
    log_watchdog_s: float | None = Field(default=None, gt=0)

    @field_validator("command")
    @classmethod
    def _command_not_blank(cls, v: list[str]) -> list[str]:
        if not v[0].strip():
            raise ValueError("the program (first argument) must not be empty")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not key or "=" in key or "\0" in key:
                raise ValueError(f"invalid environment variable name {key!r}")
        return v


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
    total: int
