"""Validator messages: the server asks for a run in its reply, the agent answers in a heartbeat
(and, from protocol version 2, reports the periodic quick rounds it runs on its own).

Replay-safe like the rest of the protocol: the server lists every run it still waits for in each
reply (the agent runs each id once and remembers it); the agent repeats a finished report in each
heartbeat until a reply no longer lists that run.
"""

from __future__ import annotations

import zlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hai.protocol.messages import GpuInfo, Seen, _numbers_not_bools

Level = Literal["quick", "full"]
CheckStatus = Literal["passed", "failed", "skipped"]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="ignore")

    _no_bools = model_validator(mode="before")(classmethod(_numbers_not_bools))


def round_phase(node: str, every: int) -> int:
    """Heartbeats by which a node's first periodic quick round comes later than ``every`` (0 to
    every - 1, from its name): nodes that start together do not run their rounds in the same
    second ever after. The server (version 1) and the agent (version 2) spread them alike."""
    return zlib.crc32(node.encode()) % every if every > 0 else 0


class ValidationRequest(_Msg):
    run_id: int
    level: Level = "full"
    # the node's registered inventory: the GPU check compares what it finds against it
    expected_gpus: list[GpuInfo] = Field(default_factory=list)


class CheckResult(_Msg):
    name: Seen
    level: Level
    critical: bool
    status: CheckStatus
    value: float | None = None  # the measured figure (failed and passed)
    threshold: float | None = None  # the limit it was judged against
    unit: Seen = ""
    detail: Seen = ""  # why it failed or was skipped; what it saw
    duration_s: float = 0.0
    data: dict = Field(default_factory=dict)  # structured extras (e.g. the Xid events found)


class ValidationReport(_Msg):
    # None (protocol version 2): a periodic quick round the agent ran on its own
    # (``ServerReply.quick_every_heartbeats``); the server keeps it as a run of trigger
    # ``periodic``, once per node and ``started_at`` (a report sent again is not stored twice),
    # and the agent drops it once a reply to a heartbeat that carried it arrives
    run_id: int | None = None
    level: Level
    started_at: float
    finished_at: float
    checks: list[CheckResult] = Field(default_factory=list)

    @model_validator(mode="after")
    def _own_rounds_are_quick(self) -> "ValidationReport":
        if self.run_id is None and self.level != "quick":
            raise ValueError("a report without a run id is an agent's own periodic round: level quick")
        return self
