from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from hai.domain.jobs import Priority
from hai.domain.nodes import NodeState
from hai.protocol.messages import json_types_only, refuse_nul

NO_NUL_PATTERN = "^[^\\x00]*$"  # refuse_nul's rule, stated in the OpenAPI schema


# text a client sends that the database stores: PostgreSQL's text holds no NUL character (psycopg
# refuses to send one, which was a 500 there and a 201 on SQLite); refused alike on every database
# as a 422 naming the field, and stated in the schema
Text = Annotated[str, AfterValidator(refuse_nul), Field(json_schema_extra={"pattern": NO_NUL_PATTERN})]


class UserRead(BaseModel):
    name: str
    group: str
    is_admin: bool


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _json_types = model_validator(mode="before")(classmethod(json_types_only))  # issue 13
    name: Text = Field(min_length=1, max_length=128)
    expires_in_s: float | None = Field(
        default=None, gt=0, le=10 * 366 * 24 * 3600, description="the token is refused after this long (default: never)"
    )


class TokenRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    name: str
    prefix: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    expires_at: datetime | None = None


class TokenCreated(TokenRead):
    token: str = Field(description="the secret; shown only once")


class GpuRead(BaseModel):
    index: int
    uuid: str = ""
    model: str = ""
    util_pct: float | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_uncorrected: int | None = None


class NodeRead(BaseModel):
    name: str
    zone: str
    leaf: str
    gpus: int
    free_gpus: int
    state: NodeState
    state_reason: str
    address: str
    fake_gpus: bool
    last_heartbeat_at: datetime | None
    running_jobs: list[int]
    gpu_util_pct: float | None = Field(None, description="mean utilisation of the GPUs at the latest heartbeat")
    gpus_busy: int = Field(0, description="GPUs at or above the busy threshold at the latest heartbeat")
    gpu_metrics: list[GpuRead] | None = Field(
        None, description="per-GPU inventory and latest figures: always in GET /nodes/{name}; in the list only "
        "with `include=gpu_metrics` (10,000 GPUs at 1,250 nodes: 2 MB)")


class QuotaItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _json_types = model_validator(mode="before")(classmethod(json_types_only))  # issue 13
    group: Text = Field(min_length=1, max_length=64)
    priority: Priority
    user: Text | None = Field(default=None, max_length=64)
    gpus: int = Field(ge=0)


class QuotaList(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _json_types = model_validator(mode="before")(classmethod(json_types_only))  # issue 13
    items: list[QuotaItem]


class Health(BaseModel):
    status: str
    database: str


class ErrorRead(BaseModel):
    """The body of every refusal other than a 422: what went wrong, in words."""

    detail: str


def error_responses(*codes: int) -> dict[int | str, dict]:
    """OpenAPI `responses` for the refusals a route can answer (issue 13: every status the API
    sends is declared, so clients and schemathesis can hold it to its schema)."""
    words = {
        400: "a credential in the query string (tokens go in the Authorization header only)",
        401: "no token, or an invalid, revoked or expired one",
        403: "the token is valid but may not do this",
        404: "no such resource",
        409: "the resource is not in a state that allows this",
        413: "the request body is over HAI_LIMITS__MAX_BODY_BYTES",
        426: "the agent's protocol version is not one the server speaks",
        429: "too many queued jobs, or too many failed authentications (see Retry-After)",
    }
    # JSON even on routes whose own responses are text (the logs): the content is spelled out, as
    # FastAPI would otherwise document the model under the route's media type
    schema = {"$ref": "#/components/schemas/ErrorRead"}
    return {code: {"description": words[code], "content": {"application/json": {"schema": schema}}} for code in codes}
