"""One Settings class, nested sections, read from the environment with the prefix HAI_ and
``__`` between section and key (HAI_SCHEDULER__MIN_RUNTIME_S). Nothing is built at import time:
call ``get_settings()``.
"""

from __future__ import annotations

from dataclasses import fields
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from hai.domain.scheduler.model import Policy

_POLICY = Policy()  # the defaults of the scheduler's knobs


class DatabaseSettings(BaseModel):
    # empty: SQLite under data_dir (embedded default)
    url: str = ""
    echo: bool = False


class RedisSettings(BaseModel):
    # empty: no Redis; events and locks stay in-process (embedded mode)
    url: str = ""


class SchedulerSettings(BaseModel):
    """Every knob of the scheduling ``Policy`` (its defaults are the domain's, written once, in
    ``domain/scheduler/model.py``), and the cycle's own (interval, leader lock)."""

    min_runtime_s: float = _POLICY.min_runtime_s
    demote_after_s: float = _POLICY.demote_after_s
    quantum_s: float = _POLICY.quantum_s
    wait_threshold_s: float = _POLICY.wait_threshold_s
    usage_half_life_s: float = _POLICY.usage_half_life_s
    preemption: bool = _POLICY.preemption
    time_sharing: bool = _POLICY.time_sharing
    max_preemptions_per_cycle: int = Field(default=_POLICY.max_preemptions_per_cycle, ge=0)
    interval_s: float = Field(default=1.0, gt=0, description="a cycle runs at least this often")
    lock_id: int = 0x4841_4901  # PostgreSQL advisory lock key for the leader

    def policy(self) -> Policy:
        """The scheduling policy these settings describe (every field of ``Policy``)."""
        return Policy(**{f.name: getattr(self, f.name) for f in fields(Policy)})


class AgentSettings(BaseModel):
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    lost_after_s: float = Field(default=30.0, gt=0, description="a silent node is marked lost")
    master_port_base: int = 29500
    default_suspend_grace_s: float = 60.0
    stop_grace_s: float = 10.0


class ValidationSettings(BaseModel):
    """Node health (issue 10): validator rounds and the undrain gate."""

    # quick checks every N heartbeats of a node (0: never)
    quick_every_heartbeats: int = Field(default=30, ge=0)
    # the full suite on every node on this schedule (Celery beat); weekly by default
    full_every_s: float = Field(default=7 * 24 * 3600, gt=0)
    # how long an undrain waits for its validation run before refusing
    undrain_timeout_s: float = Field(default=600.0, gt=0)
    # a run the agent has not answered within this long is marked expired
    run_expire_s: float = Field(default=1800.0, gt=0)
    # a job that failed on a node found faulty within this long after the failure is requeued
    fault_window_s: float = Field(default=600.0, ge=0)
    # the level of the run that gates a lost node's return to ready
    return_level: Literal["quick", "full"] = "full"


class AuthSettings(BaseModel):
    # tokens registered when the server starts (production bootstrap); defaults are refused
    # outside development
    bootstrap_admin_token: str = ""
    bootstrap_agent_token: str = ""


class LimitsSettings(BaseModel):
    """Issue 13: limits against abuse; each refusal is a clear 4xx."""

    # a request body larger than this is refused with 413
    max_body_bytes: int = Field(default=1024 * 1024, gt=0)
    # a user with this many queued jobs gets 429 on the next submission (0: no limit)
    max_queued_jobs_per_user: int = Field(default=10_000, ge=0)
    # a client (by address) that failed authentication this many times within the window
    # gets 429 with Retry-After until the window has passed
    auth_failures: int = Field(default=20, ge=1)
    auth_failure_window_s: int = Field(default=60, ge=1)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HAI_", env_nested_delimiter="__", extra="ignore")

    environment: str = "development"  # development | production
    data_dir: Path = Path(".hai")
    db: DatabaseSettings = DatabaseSettings()
    redis: RedisSettings = RedisSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    agent: AgentSettings = AgentSettings()
    auth: AuthSettings = AuthSettings()
    validation: ValidationSettings = ValidationSettings()
    limits: LimitsSettings = LimitsSettings()
    # serve the built dashboard from here when it exists
    frontend_dist: Path | None = None
    log_retention_days: int = 30

    @model_validator(mode="after")
    def _refuse_default_secrets(self) -> "Settings":
        if self.environment != "development":
            for name in ("bootstrap_admin_token", "bootstrap_agent_token"):
                value = getattr(self.auth, name)
                if value and (value in {"changeme", "admin", "agent", "secret"} or len(value) < 16):
                    raise ValueError(f"HAI_AUTH__{name.upper()} is a default or short secret; refused outside development")
        return self

    @property
    def database_url(self) -> str:
        if self.db.url:
            return self.db.url
        return f"sqlite:///{(self.data_dir / 'hai.db').resolve()}"


@lru_cache
def get_settings() -> Settings:
    return Settings()
