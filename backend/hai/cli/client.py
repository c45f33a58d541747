"""The user-facing commands: talk to the REST API with HAI_SERVER and HAI_TOKEN."""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated, Any, NoReturn

import uuid

import httpx
import tenacity
import typer

from hai.domain.jobs import JobType, Priority
from hai.schemas.jobs import MAX_BATCH_JOBS

DEFAULT_SERVER = "http://127.0.0.1:8080"


def _fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _client() -> httpx.Client:
    server = os.environ.get("HAI_SERVER", DEFAULT_SERVER).rstrip("/")
    token = os.environ.get("HAI_TOKEN")
    if not token:
        _fail("HAI_TOKEN is not set (an API token: `hai admin create-user`, or <data-dir>/admin-token in dev)", 2)
    return httpx.Client(base_url=server, headers={"Authorization": f"Bearer {token}"}, timeout=30.0)


def _explain(resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("detail")
    except ValueError:
        return resp.text or resp.reason_phrase
    if isinstance(detail, list):
        parts = []
        for d in detail:
            loc = ".".join(str(x) for x in d.get("loc", []) if x not in ("body", "query", "path"))
            parts.append(f"{loc}: {d.get('msg')}" if loc else str(d.get("msg")))
        return "; ".join(parts)
    return str(detail)


def _call(method: str, path: str, *, retry_s: float = 0.0, **kwargs: Any) -> httpx.Response:
    """One request; with ``retry_s`` > 0 (a request that is safe to repeat: idempotent, or
    carrying an Idempotency-Key), connection errors are retried with backoff for that long."""
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(httpx.TransportError),
        stop=tenacity.stop_after_delay(retry_s),
        wait=tenacity.wait_exponential(multiplier=0.2, max=5.0),
        reraise=True,
    )
    try:
        with _client() as c:
            resp = retrying(c.request, method, path, **kwargs)
    except httpx.HTTPError as exc:
        _fail(f"cannot reach the server: {exc}")
    if resp.status_code >= 400:
        # a request the server refused as invalid exits 2, like a bad command line
        _fail(f"{resp.status_code}: {_explain(resp)}", 2 if resp.status_code in (400, 422) else 1)
    return resp


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            _fail(f"--env expects KEY=VALUE, got {pair!r}", 2)
        env[key] = value
    return env


def submit(
    command: Annotated[list[str], typer.Argument(help="the program and its arguments (after --)")],
    name: Annotated[str | None, typer.Option(help="job name (default: the program)")] = None,
    nodes: Annotated[int, typer.Option(min=1)] = 1,
    gpus_per_node: Annotated[int, typer.Option(min=1, max=8)] = 8,
    priority: Annotated[Priority, typer.Option(case_sensitive=False)] = Priority.NORMAL,
    env: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable")] = None,
    job_type: Annotated[JobType, typer.Option("--type", case_sensitive=False)] = JobType.COMMAND,
    max_runtime_s: Annotated[float | None, typer.Option()] = None,
    suspend_grace_s: Annotated[float | None, typer.Option()] = None,
    tag: Annotated[list[str] | None, typer.Option(help="repeatable")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    idempotency_key: Annotated[
        str | None,
        typer.Option(help="sent as Idempotency-Key (default: a new UUID); a retry with it never makes a second job"),
    ] = None,
    retry_s: Annotated[
        float, typer.Option(min=0, help="retry connection errors this long, with the same Idempotency-Key")
    ] = 60.0,
    array: Annotated[
        int | None,
        typer.Option(min=1, max=MAX_BATCH_JOBS,
                     help="submit N jobs like this one in one request (all or none), named NAME-0 .. NAME-<N-1>, "
                     "each with HAI_ARRAY_INDEX (0 .. N-1) and HAI_ARRAY_SIZE (N) in its environment, as Slurm's "
                     "--array; prints one id per line"),
    ] = None,
) -> None:
    """Submit a job; prints its id. Lost connections are retried with the same Idempotency-Key,
    so a retry after a server crash returns the job already created, never a second one."""
    body: dict[str, Any] = {
        "name": name or os.path.basename(command[0]) or "job",
        "command": command,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "priority": priority.value,
        "env": _parse_env(env or []),
        "job_type": job_type.value,
        "tags": tag or [],
    }
    if max_runtime_s is not None:
        body["max_runtime_s"] = max_runtime_s
    if suspend_grace_s is not None:
        body["suspend_grace_s"] = suspend_grace_s
    headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
    if array is not None:
        batch = [body | {"name": f"{body['name'][:120]}-{i}",
                         "env": body["env"] | {"HAI_ARRAY_INDEX": str(i), "HAI_ARRAY_SIZE": str(array)}}
                 for i in range(array)]
        made = _call("POST", "/api/v1/jobs/batch", json={"jobs": batch}, headers=headers, retry_s=retry_s).json()
        typer.echo(json.dumps(made["jobs"], indent=2) if as_json else "\n".join(str(j["id"]) for j in made["jobs"]))
        return
    job = _call("POST", "/api/v1/jobs", json=body, headers=headers, retry_s=retry_s).json()
    typer.echo(json.dumps(job, indent=2) if as_json else str(job["id"]))


def _fmt_row(cols: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()


def _table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    typer.echo(_fmt_row(headers, widths))
    for r in rows:
        typer.echo(_fmt_row(r, widths))


def jobs(
    state: Annotated[list[str] | None, typer.Option(help="filter by state, repeatable")] = None,
    user: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """List jobs, newest first."""
    params: list[tuple[str, str | int]] = [("limit", limit)] + [("state", s) for s in state or []]
    if user:
        params.append(("user", user))
    data = _call("GET", "/api/v1/jobs", params=params).json()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    rows = [
        [str(j["id"]), j["name"][:32], j["user"], j["state"], j["priority"], f"{j['nodes']}x{j['gpus_per_node']}",
         (j.get("pending_reason") or "")[:60]]
        for j in data["items"]
    ]
    _table(["ID", "NAME", "USER", "STATE", "PRIORITY", "GPUS", "REASON"], rows)


def job(job_id: int, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Show one job."""
    j = _call("GET", f"/api/v1/jobs/{job_id}").json()
    if as_json:
        typer.echo(json.dumps(j, indent=2))
        return
    for key in ("id", "name", "user", "group", "state", "priority", "nodes", "gpus_per_node", "job_type",
                "created_at", "started_at", "finished_at", "exit_code", "failure_reason", "attempt",
                "suspensions", "pending_reason", "placement_reason"):
        if j.get(key) is not None:
            typer.echo(f"{key:16} {j[key]}")
    for p in j.get("placement", []):
        typer.echo(f"{'placement':16} {p['node']} (zone {p['zone']}, leaf {p['leaf']}) GPUs {p['gpus']}")
    for e in j.get("events", []):
        typer.echo(f"{'event':16} {e['at']} {e['from_state'] or '-'} -> {e['to_state']}: {e['reason']}")


def logs(
    job_id: int,
    follow: Annotated[bool, typer.Option("-f", "--follow")] = False,
    rank: Annotated[int | None, typer.Option()] = None,
    attempt: Annotated[int | None, typer.Option()] = None,
    grep: Annotated[str | None, typer.Option("--grep", "-q")] = None,
    timestamps: Annotated[bool, typer.Option("--timestamps", "-t")] = False,
) -> None:
    """Print a job's logs; -f follows until the job ends (exit code 1 when the server ends the
    follow first: its follow limit, or it is stopping)."""
    params: dict[str, Any] = {"timestamps": timestamps}
    for k, v in (("rank", rank), ("attempt", attempt), ("q", grep)):
        if v is not None:
            params[k] = v
    if not follow:
        sys.stdout.write(_call("GET", f"/api/v1/jobs/{job_id}/logs", params=params).text)
        return
    from httpx_sse import connect_sse

    with _client() as c:
        c.timeout = httpx.Timeout(30.0, read=None)
        with connect_sse(c, "GET", f"/api/v1/jobs/{job_id}/logs", params={**params, "follow": True}) as source:
            if source.response.status_code >= 400:
                source.response.read()
                _fail(f"{source.response.status_code}: {_explain(source.response)}", 1)
            for event in source.iter_sse():
                if event.event == "log":
                    typer.echo(event.data)
                elif event.event == "end":
                    typer.echo(f"-- job {job_id} ended: {event.data}", err=True)
                    return
                elif event.event == "limit":  # the server ended the follow before the job ended
                    typer.echo(f"-- following job {job_id} stopped: {event.data}", err=True)
                    raise typer.Exit(1)


def _action(job_id: int, action: str) -> None:
    j = _call("POST", f"/api/v1/jobs/{job_id}/{action}").json()
    typer.echo(f"job {j['id']}: {j['state']}")


def cancel(job_id: int) -> None:
    """Cancel a job (stops every rank)."""
    _action(job_id, "cancel")


def suspend(job_id: int) -> None:
    """Suspend a job at its next checkpoint; it stays held until `hai resume`."""
    _action(job_id, "suspend")


def resume(job_id: int) -> None:
    """Queue a suspended job again; it resumes from its last checkpoint."""
    _action(job_id, "resume")


def me() -> None:
    """Who the token belongs to."""
    typer.echo(json.dumps(_call("GET", "/api/v1/me").json()))


def register(app: typer.Typer) -> None:
    for fn in (submit, jobs, job, logs, cancel, suspend, resume, me):
        app.command(fn.__name__)(fn)
    from hai.cli import nodes  # issue 10: `hai nodes` with show/drain/undrain/validate

    app.add_typer(nodes.app, name="nodes")
