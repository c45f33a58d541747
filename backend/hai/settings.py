"""One Settings class, nested sections, read from the environment with the prefix HAI_ and
``__`` between section and key (HAI_SCHEDULER__MIN_RUNTIME_S). Nothing is built at import time:
call ``get_settings()``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class DatabaseSettings(BaseModel):
    # empty: SQLite under data_dir (embedded default)
    url: str = ""
    echo: bool = False


class RedisSettings(BaseModel):
    # empty: no Redis; events and locks stay in-process (embedded mode)
    url: str = ""


class SchedulerSettings(BaseModel):
    min_runtime_s: float = 15 * 60
    demote_after_s: float = 30 * 60
    quantum_s: float = 4 * 3600
    wait_threshold_s: float = 15 * 60
    usage_half_life_s: float = 3600
    interval_s: float = Field(default=1.0, gt=0, description="a cycle runs at least this often")
    lock_id: int = 0x4841_4901  # PostgreSQL advisory lock key for the leader


class AgentSettings(BaseModel):
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    lost_after_s: float = Field(default=30.0, gt=0, description="a silent node is marked lost")
    master_port_base: int = 29500
    default_suspend_grace_s: float = 60.0
    stop_grace_s: float = 10.0


class KubernetesSettings(BaseModel):
    """The Kubernetes execution backend (HAI_EXECUTOR=kubernetes): jobs run as pods."""

    kubeconfig: str = Field(default="", description="empty: the in-cluster configuration")
    context: str = ""
    namespace: str = "hai-jobs"  # where job pods, their Services and parent ConfigMaps live
    node_selector: str = Field(default="", description="label selector of the GPU nodes the platform uses")
    zone_label: str = "topology.kubernetes.io/zone"
    leaf_label: str = "hai.io/leaf"
    gpu_resource: str = "nvidia.com/gpu"
    image: str = "hai-platform:latest"  # job image: has python and the hai package (the SDK)
    image_pull_policy: str = "IfNotPresent"
    python: str = "python"  # the interpreter in the image that runs the pod wrapper
    service_account: str = ""  # job pods' service account (empty: the namespace default)
    checkpoint_claim: str = Field(default="", description="PersistentVolumeClaim holding per-job checkpoints")
    checkpoint_host_path: str = Field(default="", description="or a host path (single-site tests, NFS mounts)")
    checkpoint_mount: str = "/hai/checkpoints"
    gang_timeout_s: float = Field(default=300.0, gt=0, description="every pod of an attempt must run by then")
    resync_s: float = Field(default=60.0, gt=0, description="full re-list of nodes and pods")
    watch_timeout_s: int = Field(default=50, gt=0, description="server-side watch timeout; resumed at its resourceVersion")
    reconcile_interval_s: float = Field(default=0.5, gt=0)
    heartbeat_workers: int = Field(default=4, ge=1, description="nodes reconciled in parallel")
    follow_logs: bool = True


class AuthSettings(BaseModel):
    # tokens registered when the server starts (production bootstrap); defaults are refused
    # outside development
    bootstrap_admin_token: str = ""
    bootstrap_agent_token: str = ""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HAI_", env_nested_delimiter="__", extra="ignore")

    environment: str = "development"  # development | production
    data_dir: Path = Path(".hai")
    db: DatabaseSettings = DatabaseSettings()
    redis: RedisSettings = RedisSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    agent: AgentSettings = AgentSettings()
    auth: AuthSettings = AuthSettings()
    # who runs the jobs: node agents (HAI_EXECUTOR=agent) or Kubernetes pods (kubernetes)
    executor: Literal["agent", "kubernetes"] = "agent"
    kubernetes: KubernetesSettings = KubernetesSettings()
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
