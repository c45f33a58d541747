from __future__ import annotations

from datetime import datetime
from enum import Enum

from pydantic import BaseModel, Field


class Window(str, Enum):
    hour = "hour"
    day = "day"
    week = "week"


class UsageBy(str, Enum):
    user = "user"
    group = "group"


class MetricPoint(BaseModel):
    t: int = Field(description="bucket start, epoch seconds")
    util_avg_pct: float
    util_max_pct: float
    busy_pct: float
    mem_used_avg_mib: float
    temp_max_c: float
    power_avg_w: float


class MetricSeries(BaseModel):
    window: Window
    grain_s: int
    points: list[MetricPoint]


class GpuMetricSeries(BaseModel):
    index: int
    points: list[MetricPoint]


class NodeMetrics(BaseModel):
    node: str
    series: MetricSeries
    gpus: list[GpuMetricSeries]


class JobMetrics(BaseModel):
    job_id: int
    series: MetricSeries
    gpu_samples: int
    busy_samples: int
    util_avg_pct: float | None
    busy_pct: float | None = Field(description="busy vs allocated: share of the job's GPU samples that were busy")


class ClusterSummary(BaseModel):
    gpus: int
    allocated_gpus: int
    busy_gpus: int
    running_jobs: int
    queued_by_priority: dict[str, int]


class IdleAllocationRead(BaseModel):
    job_id: int
    job_name: str
    user: str
    node: str
    gpus: list[int]
    idle_s: float


class UsageRowRead(BaseModel):
    key: str
    gpu_hours: float
    jobs: int


class UsageReport(BaseModel):
    by: UsageBy
    since: datetime
    until: datetime
    rows: list[UsageRowRead]


class QuotaUseRead(BaseModel):
    group: str
    priority: str
    user: str | None
    gpus: int
    used_gpus: int


class ClusterNodeRead(BaseModel):
    name: str
    zone: str
    leaf: str
    state: str
    state_reason: str
    gpus: int
    allocated_gpus: int
    util_pct: float | None = Field(description="mean GPU utilisation in the latest heartbeat")
    jobs: list[int] = Field(description="jobs holding GPUs here")
