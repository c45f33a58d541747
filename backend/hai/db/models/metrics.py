"""GPU metrics over time (issue 11). Every row holds sums, counts and maxima over one time
bucket, so partial buckets written by any API process merge exactly (upsert adds sums, keeps
maxima). Times are epoch seconds (integers): small rows, cheap range scans."""

from __future__ import annotations

from sqlalchemy import JSON, Float, Integer, SmallInteger, String
from sqlalchemy.orm import Mapped, mapped_column

from hai.db.base import Base


class GpuSample(Base):
    """One node's GPUs over one fine bucket (``HAI_METRICS__FINE_S``), written once when the
    bucket closes; kept ``fine_retention_h``. ``gpus`` holds one list per GPU:
    [index, samples, util_sum, util_max, mem_used_max_mib, temp_max_c, power_sum_w, busy_samples]. ``part``
    tells apart rows of one bucket written by different API processes (or an early flush);
    readers add them up."""

    __tablename__ = "gpu_samples"

    node_name: Mapped[str] = mapped_column(String(128), primary_key=True)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True)  # epoch s of the bucket start
    part: Mapped[int] = mapped_column(Integer, primary_key=True)
    gpus: Mapped[list[list[float]]] = mapped_column(JSON, default=list)


class MetricRollup(Base):
    """GPU samples rolled up per ``scope`` and ``key`` over buckets of ``grain_s``: the cluster
    ('') and each job (its id) at the fine and coarse grain, each node (its name) at the coarse
    grain (its fine series is its gpu_samples rows)."""

    __tablename__ = "metric_rollups"

    scope: Mapped[str] = mapped_column(String(8), primary_key=True)
    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    grain_s: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True)
    n: Mapped[int] = mapped_column(Integer, default=0)  # GPU samples
    busy_n: Mapped[int] = mapped_column(Integer, default=0)  # GPU samples at or above the busy threshold
    util_sum: Mapped[float] = mapped_column(Float, default=0.0)
    util_max: Mapped[float] = mapped_column(Float, default=0.0)
    mem_used_sum_mib: Mapped[float] = mapped_column(Float, default=0.0)
    temp_max_c: Mapped[float] = mapped_column(Float, default=0.0)
    power_sum_w: Mapped[float] = mapped_column(Float, default=0.0)


class GpuStatus(Base):
    """Each GPU's latest figures and when it was last busy: finds allocated GPUs that sit idle."""

    __tablename__ = "gpu_status"

    node_name: Mapped[str] = mapped_column(String(128), primary_key=True)
    gpu_index: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    last_seen_at: Mapped[float] = mapped_column(Float, default=0.0)  # epoch s
    last_busy_at: Mapped[float] = mapped_column(Float, default=0.0)  # epoch s; 0 = never seen busy
    util_pct: Mapped[float] = mapped_column(Float, default=0.0)
