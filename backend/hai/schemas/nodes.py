"""Node health schemas (issue 10): node detail with events, drain/undrain bodies, validation runs."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hai.domain.nodes import NodeState
from hai.protocol.messages import json_types_only
from hai.schemas.common import GpuRead, NodeRead, Text


class NodeEventRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    at: datetime
    from_state: NodeState | None
    to_state: NodeState
    actor: str
    reason: str
    detail: dict[str, Any] | None = None


class ValidationCheckRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    name: str
    level: str
    critical: bool
    status: str  # passed | failed | skipped
    value: float | None
    threshold: float | None
    unit: str
    detail: str
    duration_s: float
    data: dict[str, Any] = Field(default_factory=dict)


class ValidationRunRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    node: str = Field(validation_alias="node_name")
    level: str
    trigger: str
    status: str  # pending | passed | failed | expired
    requested_by: str
    requested_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    summary: str
    checks: list[ValidationCheckRead]


class NodeDetail(NodeRead):
    gpu_metrics: list[GpuRead]  # type: ignore[assignment] - always here (optional in the list)
    state_changed_at: datetime | None = None
    state_detail: dict[str, Any] | None = None
    events: list[NodeEventRead]
    latest_validation: ValidationRunRead | None = None


class NodeDrain(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _json_types = model_validator(mode="before")(classmethod(json_types_only))  # issue 13
    reason: Text = Field(min_length=1, max_length=400, description="why the node is taken out (required)")

    @field_validator("reason")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("a reason is required")
        return v.strip()


class NodeUndrain(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _json_types = model_validator(mode="before")(classmethod(json_types_only))  # issue 13
    force: bool = Field(default=False, description="skip the validation gate (recorded as forced)")


class NodeValidate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _json_types = model_validator(mode="before")(classmethod(json_types_only))  # issue 13
    level: Literal["quick", "full"] = "full"


class FailedCheckRead(BaseModel):
    name: str
    value: float | None
    threshold: float | None
    unit: str
    detail: str


class ChecksFailedDetail(BaseModel):
    message: str
    failed_checks: list[FailedCheckRead]


class ChecksFailedError(BaseModel):
    """The 409 body of a refused undrain."""

    detail: ChecksFailedDetail
