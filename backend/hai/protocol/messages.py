from __future__ import annotations

import typing

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from hai.protocol.vocab import DesiredAction, StopCause

# 2 (issue 12): the agent runs the periodic quick validation rounds itself, every
# ``ServerReply.quick_every_heartbeats`` heartbeats, and reports them without a run id
# (``ValidationReport.run_id`` None); with 1 the server asks for each round in a reply
PROTOCOL_VERSION = 2
# The server accepts agents speaking any of these versions.
SUPPORTED_VERSIONS = frozenset({1, 2})
# the first version whose agents run their own periodic quick rounds
AGENT_ROUNDS_VERSION = 2
# a 426 (a version the server does not speak) lists the versions it speaks in this header, e.g.
# "1"; an agent that speaks one of them too goes on in that version (``AgentClient``)
PROTOCOLS_HEADER = "X-HAI-Agent-Protocols"
# any integer parses (so the server can answer an unknown version with a 426 that says which it
# speaks); the schema lists the versions that are accepted
_VERSION_FIELD = Field(default=PROTOCOL_VERSION, json_schema_extra={"enum": sorted(SUPPORTED_VERSIONS)})

__all__ = [
    "AGENT_ROUNDS_VERSION",
    "PROTOCOLS_HEADER",
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


def _json_type_checks(cls: type[BaseModel]) -> tuple:
    """Per model class, once: (key, a number expected, a boolean expected, "list"/"dict" whose
    items are numbers or None) for every field that has such a rule."""
    checks = _JSON_TYPE_CHECKS.get(cls)
    if checks is None:
        out = []
        for name, f in cls.model_fields.items():
            kinds = set(typing.get_args(f.annotation)) or {f.annotation}
            number = bool not in kinds and bool(kinds & {int, float})
            boolean = bool in kinds and not kinds - {bool, type(None)}
            # the items of a list[int|float] / the values of a dict[str, int|float]
            origin, args = typing.get_origin(f.annotation), typing.get_args(f.annotation)
            inner = (set(typing.get_args(args[-1])) or {args[-1]}) if args else set()
            container = ("dict" if origin is dict and len(args) == 2 else "list" if origin is list and len(args) == 1
                         else None)
            items = container if container is not None and bool not in inner and inner & {int, float} else None
            if number or boolean or items:
                out.append((f.alias or name, number, boolean, items))
        checks = _JSON_TYPE_CHECKS[cls] = tuple(out)
    return checks


_JSON_TYPE_CHECKS: dict[type, tuple] = {}


def json_types_only(cls: type[BaseModel], data: object) -> object:
    """A model-level before-validator: JSON true/false where the schema says number, and anything
    but true/false where it says boolean, are refused — pydantic's lax mode would read them as
    1/0 and 0/1/"yes" as booleans (found by schemathesis, issue 13). The rules of each class are
    worked out once (issue 12: this runs for every nested message of every heartbeat)."""
    if isinstance(data, dict):
        for key, number, boolean, items in _json_type_checks(cls):
            value = data.get(key)
            if value is None:
                continue
            if number and isinstance(value, bool):
                raise ValueError(f"{key}: a number is expected, not {str(value).lower()}")
            if boolean and not isinstance(value, bool):
                raise ValueError(f"{key}: true or false is expected, not {value!r}")
            if items is not None:
                values = (value.values() if items == "dict" and isinstance(value, dict) else
                          value if items == "list" and isinstance(value, list) else ())
                if any(isinstance(v, bool) for v in values):
                    raise ValueError(f"{key}: numbers are expected, not true/false")
    return data


_numbers_not_bools = json_types_only


# ids and counters fit the database's columns (an out-of-range number is a 422, not a 500 from
# the driver; found by schemathesis, issue 13)
Id = Annotated[int, Field(ge=0, le=2**63 - 1)]
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]

# PostgreSQL's text holds no NUL character (psycopg refuses to send one: it was a 500 there).
# What names an agent (its node, zone, leaf, address, GPUs) is refused with one: a 422 naming
# the field. What an agent reports having seen (a check's detail, a launch error, a GPU's id in
# a heartbeat, a job's log line) comes from the machine and may hold any byte: a NUL is replaced
# by U+FFFD, so one odd byte never turns every heartbeat of a node into an error (and the node
# into a lost one). The API's own text fields refuse a NUL with the same message
# (hai.schemas.common.Text, the URL's guard).
NUL_MSG = "must not contain NUL characters"


def refuse_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError(NUL_MSG)
    return value


def replace_nul(value: str) -> str:
    return value.replace("\x00", "\ufffd") if "\x00" in value else value


Name = Annotated[str, AfterValidator(refuse_nul)]
Seen = Annotated[str, AfterValidator(replace_nul)]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="ignore")  # newer peers may add fields

    _no_bools = model_validator(mode="before")(classmethod(_numbers_not_bools))


class GpuInfo(_Msg):
    index: int
    uuid: Name
    model: Name
    memory_total_mib: int
    numa_node: int | None = None


class GpuMetrics(_Msg):
    index: int
    uuid: Seen
    util_pct: float = 0.0
    memory_used_mib: int = 0
    memory_total_mib: int = 0
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_uncorrected: int | None = None


class NicInfo(_Msg):
    name: Name  # e.g. mlx5_0
    numa_node: int | None = None


class RankStatus(_Msg):
    rank: int  # global rank
    local_rank: int
    pid: int | None = None
    state: Literal["running", "exited"] = "running"
    exit_code: int | None = None


class CheckpointInfo(_Msg):
    path: Seen
    step: int | None = None
    at: float  # epoch seconds when the checkpoint became safe
    duration_s: float | None = None


class ProgressInfo(_Msg):
    step: int
    total: int | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    at: float


class AttemptStatus(_Msg):
    job_id: Id
    attempt: Count
    ranks: list[RankStatus] = Field(default_factory=list)
    launch_error: Seen | None = None  # the attempt could not be launched at all
    suspend_ready: bool = False  # the job said its checkpoint is safe
    stopped_reason: Seen | None = None  # why the agent stopped ranks (grace expired, watchdog, runtime)
    checkpoint: CheckpointInfo | None = None
    progress: ProgressInfo | None = None
    # Added by the agent (optional, older peers ignore them):
    # every rank of this attempt on this node has ended (or it could not be launched); the status
    # is final and the agent keeps sending it until the attempt is no longer assigned.
    finished: bool = False
    # machine-readable companion of stopped_reason (StopCause: "requested", "suspend",
    # "suspend_timeout", "max_runtime", "log_watchdog", "rank_failed", "unassigned",
    # "not_launched"). A cause this side does not know (a newer peer) stays a plain string.
    stop_cause: StopCause | Seen | None = Field(default=None, union_mode="left_to_right")
    started_at: float | None = None  # epoch seconds when the ranks were launched
    finished_at: float | None = None  # epoch seconds when the last rank here ended
    suspend_requested_at: float | None = None  # when the agent delivered the suspend request
    # issue 13: writes the job could not make for lack of space ("<path>: <error>"), as the SDK
    # reported them (hai.sdk.StorageFull); the server records each once as a job event
    storage_errors: list[Seen] = Field(default_factory=list)


class AgentHello(_Msg):
    """Handshake: sent when the agent starts and whenever the server asks it to re-register."""

    protocol_version: int = _VERSION_FIELD
    node: Name
    zone: Name | None = None
    leaf: Name | None = None
    address: Name  # reachable address of the node (MASTER_ADDR for jobs whose rank 0 is here)
    gpus: list[GpuInfo]
    nics: list[NicInfo] = Field(default_factory=list)
    fake_gpus: bool = False
    agent_version: Name = "0"
    attempts: list[AttemptStatus] = Field(default_factory=list)  # reattached after a restart


class Heartbeat(_Msg):
    protocol_version: int = _VERSION_FIELD
    node: Name
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
    protocol_version: int = _VERSION_FIELD
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
    # issue 12 (version 2; older agents ignore it): run a quick validation round every this many
    # heartbeats, while no other run is under way, and report it without a run id; 0: the
    # server asks for rounds itself (version 1) or wants none from this node now
    quick_every_heartbeats: int = Field(default=0, ge=0)


class LogLine(_Msg):
    job_id: Id
    attempt: Count
    rank: Count
    seq: Count  # per (job, attempt, rank), from 0, so a re-sent batch is not stored twice
    ts: float
    stream: Literal["stdout", "stderr", "system"] = "stdout"
    line: str  # a NUL is stored as U+FFFD (services/logs.clip)


class LogBatch(_Msg):
    protocol_version: int = _VERSION_FIELD
    node: Name
    # lines the agent dropped because its buffer overflowed arrive as a "system" line
    # ("[hai] N lines dropped ...") in the same sequence, so the gap is visible and counted
    lines: list[LogLine] = Field(default_factory=list)


class LogAck(_Msg):
    accepted: int


# issue 10: validator messages (their own module); resolve the forward references above
from hai.protocol.validation import ValidationReport, ValidationRequest  # noqa: E402

Heartbeat.model_rebuild()
ServerReply.model_rebuild()
