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
    submit_on_loop: bool = Field(default=True, description=(
        "PostgreSQL: single submissions answered before routing (a cached credential, the usual case; "
        "hai.api.jobs.SubmissionGroups) are written on the API process's event loop through psycopg's "
        "asyncio connections (a pool of its own, up to 6 connections a process) instead of in a worker "
        "thread (issue 12: the thread hop was a fifth of a submission's server CPU); off: in a worker "
        "thread. No effect on SQLite"))
    prepared_statements: bool = Field(default=True, description=(
        "PostgreSQL: psycopg prepares a statement on the server after its fifth execution on a "
        "connection (its default); false: never. Set false behind PgBouncer in transaction mode before "
        "1.21 (or without max_prepared_statements), which hands each transaction whichever server "
        "connection is free: a statement prepared on one is unknown to the others"))
    pool_size: int = Field(default=20, ge=1, description=(
        "PostgreSQL: connections an API, scheduler or worker process keeps open (SQLAlchemy's pool); "
        "behind PgBouncer they are PgBouncer's client connections"))
    max_overflow: int = Field(default=20, ge=0, description=(
        "PostgreSQL: connections a process may open beyond pool_size under load, closed when returned"))


class RedisSettings(BaseModel):
    # empty: no Redis; events and locks stay in-process (embedded mode)
    url: str = ""
    poll_s: float = Field(default=1.0, gt=0, description=(
        "without Redis, waits that another process would end (an agent's long poll, a followed "
        "log) re-read the database at least this often, so several API replicas and a separate "
        "scheduler still work, with up to this much more latency"))


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
    service_classes_gpu_s: tuple[float, ...] = _POLICY.service_classes_gpu_s
    starvation_factor: float = Field(default=_POLICY.starvation_factor, ge=0)
    service_quantum_factor: float = Field(default=_POLICY.service_quantum_factor, ge=0)
    service_quantum_min_class: int = Field(default=_POLICY.service_quantum_min_class, ge=0)
    service_protect_wait_factor: float = Field(default=_POLICY.service_protect_wait_factor, ge=0)
    service_protect_time_sharing: bool = _POLICY.service_protect_time_sharing
    service_checkpoint_slack_s: float = Field(default=_POLICY.service_checkpoint_slack_s, ge=0)
    interval_s: float = Field(default=1.0, gt=0, description="a cycle runs at least this often")
    coalesce_s: float = Field(
        default=0.2, ge=0,
        description="wake-ups (submissions, releases) within this long of a cycle's start wait for the next "
        "cycle: a burst of submissions costs a few cycles, not one each (issue 12)",
    )
    max_busy_share: float = Field(
        default=0.5, gt=0, le=1,
        description="a wake-up waits until the scheduler has been busy at most this share of the time since the "
        "last cycle began: after a cycle of d seconds the next starts no sooner than d x (1/share - 1) after it "
        "ended (as Slurm's sched_min_interval), so a slow cycle (a deep queue) leaves the rest of the machine to "
        "the API; 1: no limit (issue 12)",
    )
    pending_reason_refresh_s: float = Field(default=30.0, ge=0, description=(
        "a queued job's pending reason whose words stay the same and only its numbers change (for example "
        "'(256 nodes reserved for other jobs)', then 288) is written at most once in this many seconds, at a "
        "moment of the job's own in that span; any other change of its reason or reservation is written by the "
        "cycle that makes it; 0: every change at once (issue 12: while preemptions were in flight, every "
        "queued job's count moved every cycle, and every cycle rewrote, and read back, the whole queue)"))
    lock_id: int = Field(default=0x4841_4901, ge=0, lt=2**31,
                         description="PostgreSQL advisory lock key: the leader of epoch E holds (lock_id, E)")
    lease_s: float = Field(default=10.0, gt=0, description=(
        "the leader's lease: renewed every cycle; a leader silent this long (paused, partitioned) "
        "is replaced and fenced off"))

    def policy(self) -> Policy:
        """The scheduling policy these settings describe (every field of ``Policy``)."""
        return Policy(**{f.name: getattr(self, f.name) for f in fields(Policy)})


class AgentSettings(BaseModel):
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    lost_after_s: float = Field(default=30.0, gt=0, description="a silent node is marked lost")
    master_port_base: int = 29500
    default_suspend_grace_s: float = 60.0
    stop_grace_s: float = 10.0
    reply_cache_s: float = Field(default=60.0, ge=0, description=(
        "with Redis: a steady heartbeat (the report and the held assignments unchanged, all of them "
        "running) is answered from the API process's cache, without the database (liveness written in "
        "batches, liveness_flush_s), for at most this long; any change to the node's assignments invalidates it at once, "
        "and so does a notification path found silent (RedisNotifier's ticks): this bound is only the backstop for a "
        "notification its publisher never sent (it died between its commit and its publish) (0: never)"))
    access_log_heartbeats: bool = Field(default=False, description=(
        "log every heartbeat answered 2xx in hai server's access log (a line per node per second); "
        "refused heartbeats are logged either way"))
    liveness_flush_s: float = Field(default=1.0, gt=0, description=(
        "the liveness (last heartbeat, latest GPU figures) of heartbeats answered from the reply cache is "
        "written for all nodes at once this often, by each API process; keep it well under lost_after_s"))


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


class KubernetesSettings(BaseModel):
    """The Kubernetes execution backend (HAI_EXECUTOR=kubernetes): jobs run as pods."""

    kubeconfig: str = Field(default="", description="empty: the in-cluster configuration")
    context: str = ""
    namespace: str = "hai-jobs"  # where job pods, their Services and parent ConfigMaps live
    node_selector: str = Field(default="", description="label selector of the GPU nodes the platform uses")
    zone_label: str = "topology.kubernetes.io/zone"
    leaf_label: str = "hai.io/leaf"
    gpu_resource: str = "nvidia.com/gpu"
    # hfreduce pods: each rank's container also asks for one of this RDMA device plugin resource
    # (e.g. rdma/hca_shared_devices_a), so that the node's HCAs are mounted in it; "": none
    rdma_resource: str = ""
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
    agent_token_cache_s: float = Field(default=10.0, ge=0, description=(
        "each API process re-checks a node credential at most this often (0: on every request)"))
    token_cache_s: float = Field(default=10.0, ge=0, description=(
        "each API process re-checks a user token at most this often (0: on every request); a revocation "
        "takes effect at once in every process that notifications reach (Redis), within this long elsewhere"))


class MetricsSettings(BaseModel):
    """GPU metrics over time (HAI_METRICS__*): per-GPU buckets of ``fine_s`` kept
    ``fine_retention_h``; per-node/job/cluster rollups at ``fine_s`` (same retention) and
    ``coarse_s`` (kept ``coarse_retention_days``)."""

    fine_s: int = Field(default=120, gt=0)
    coarse_s: int = Field(default=900, gt=0)
    flush_interval_s: float = Field(default=10.0, ge=0, description="buffered samples are written this often")
    fine_retention_h: float = Field(default=48.0, gt=0)
    coarse_retention_days: float = Field(default=400.0, gt=0)
    busy_util_pct: float = Field(default=5.0, ge=0, le=100, description="a GPU at or above this is busy")
    idle_after_s: float = Field(default=600.0, ge=0, description="an allocated GPU idle this long is listed")


class HttpSettings(BaseModel):
    """``hai server``'s HTTP layer (uvicorn). Not ``server``: HAI_SERVER is the CLI's server URL."""

    access_log: bool = Field(default=True, description=(
        "a log line per request (uvicorn's access log, through the token redaction filter); off, the "
        "server logs only its own events and errors (about 6% of a submission's server CPU, issue 12: "
        "benchmarks/README.md), for deployments that log requests at their proxy or load balancer"))
    opentelemetry: bool = Field(default=False, description=(
        "FastAPI's native OpenTelemetry: a span, metrics and error logs per request, exported by the "
        "OpenTelemetry SDK providers configured in the process (for example by `opentelemetry-instrument "
        "hai server`). Off by default: the platform's own figures are Prometheus metrics (`/metrics`), and "
        "FastAPI looks the global providers up on every request even when none is configured (issue 12: "
        "about 5% of a submission's server CPU)"))
    gc_threshold: int = Field(default=50_000, ge=0, description=(
        "the cyclic garbage collector's first threshold in `hai server` and `hai dev` processes, whose "
        "objects at startup are also frozen out of later collections (gc.freeze); 0 keeps Python's "
        "defaults (700, no freeze). Issue 12: with the defaults, a worker serving 1,250 agents paused "
        "for full collections of 150-250 ms every few seconds (benchmarks/README.md)"))
    node_list_max_age_s: float = Field(default=1.0, ge=0, description=(
        "`GET /api/v1/nodes` (without per-GPU figures) is served from the document this API process "
        "last built while nothing it shows but the heartbeats' figures has changed (a revision the "
        "database raises on every change of a node's labels, state or allocations, whichever process "
        "commits it) and the document is at most this old; so `last_heartbeat_at`, `gpu_util_pct` and "
        "`gpus_busy` may be this much older than the last heartbeat, everything else is current. "
        "0: every request builds the list (issue 12: at 1,250 nodes ~16 ms of PostgreSQL's CPU)"))


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
    # a log line longer than this (characters) is stored cut, ending in a visible marker
    # "[hai: line truncated, N more characters]"
    max_log_line_chars: int = Field(default=16 * 1024, ge=64)
    # a followed log (GET /jobs/{id}/logs?follow=true) open this long ends with a `limit` event
    # (0: until the job ends)
    max_follow_s: float = Field(default=0.0, ge=0)


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
    metrics: MetricsSettings = MetricsSettings()
    # who runs the jobs: node agents (HAI_EXECUTOR=agent) or Kubernetes pods (kubernetes)
    executor: Literal["agent", "kubernetes"] = "agent"
    kubernetes: KubernetesSettings = KubernetesSettings()
    limits: LimitsSettings = LimitsSettings()
    http: HttpSettings = HttpSettings()
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
