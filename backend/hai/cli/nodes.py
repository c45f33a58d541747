"""`hai nodes`: list nodes with their state and reason, show one (events, latest validation),
drain, undrain and validate (issue 10). Talks to the REST API like the rest of cli/client.py."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from hai.cli.client import _call, _fail, _table

app = typer.Typer(help="nodes: list, show, drain, undrain, validate", invoke_without_command=True,
                  no_args_is_help=False)


@app.callback()
def nodes(ctx: typer.Context, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List nodes with their state and reason."""
    if ctx.invoked_subcommand is not None:
        return
    data = _call("GET", "/api/v1/nodes").json()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    rows = [
        [n["name"], n["zone"], n["leaf"], f"{n['free_gpus']}/{n['gpus']}", n["state"],
         ",".join(str(j) for j in n["running_jobs"]), (n.get("state_reason") or "")[:70]]
        for n in data
    ]
    _table(["NODE", "ZONE", "LEAF", "FREE", "STATE", "JOBS", "REASON"], rows)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _print_run(run: dict) -> None:
    typer.echo(f"validation run {run['id']} ({run['level']}, {run['trigger']}): {run['status']}"
               + (f" — {run['summary']}" if run.get("summary") else ""))
    for c in run.get("checks", []):
        crit = "critical" if c["critical"] else ""
        figure = f"{_fmt(c['value'])} {c['unit']} (threshold {_fmt(c['threshold'])})" if c["value"] is not None else ""
        typer.echo(f"  {c['status']:8} {c['name']:18} {crit:8} {figure}  {c['detail']}".rstrip())


@app.command("show")
def show(name: str, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """One node: state, reason, events, latest validation."""
    n = _call("GET", f"/api/v1/nodes/{name}").json()
    if as_json:
        typer.echo(json.dumps(n, indent=2))
        return
    for key in ("name", "zone", "leaf", "gpus", "free_gpus", "state", "state_reason", "address",
                "last_heartbeat_at", "running_jobs"):
        typer.echo(f"{key:18} {n.get(key)}")
    for e in n.get("events", []):
        typer.echo(f"{'event':18} {e['at']} {e['from_state'] or '-'} -> {e['to_state']} [{e['actor']}]: {e['reason']}")
    if n.get("latest_validation"):
        _print_run(n["latest_validation"])
    else:
        typer.echo("no finished validation run yet")


@app.command("drain")
def drain(name: str, reason: Annotated[str, typer.Option(help="why (required)")]) -> None:
    """Take a node out of scheduling; its jobs move off at their checkpoint (admins)."""
    n = _call("POST", f"/api/v1/nodes/{name}/drain", json={"reason": reason}).json()
    typer.echo(f"node {n['name']}: {n['state']} ({n['state_reason']})")


@app.command("undrain")
def undrain(name: str, force: Annotated[bool, typer.Option("--force", help="skip the validation gate")] = False) -> None:
    """Back to ready after a passing full validation (waits for it); --force skips it (admins)."""
    import httpx

    from hai.cli.client import _client, _explain

    try:
        with _client() as c:
            c.timeout = httpx.Timeout(30.0, read=None)
            resp = c.post(f"/api/v1/nodes/{name}/undrain", json={"force": force})
    except httpx.HTTPError as exc:
        _fail(f"cannot reach the server: {exc}")
    if resp.status_code == 409 and isinstance(resp.json().get("detail"), dict):
        detail = resp.json()["detail"]
        typer.echo(f"error: 409: {detail['message']}", err=True)
        for f in detail["failed_checks"]:
            typer.echo(f"  failed {f['name']}: {_fmt(f['value'])} {f['unit']} (threshold {_fmt(f['threshold'])})"
                       f"  {f['detail']}", err=True)
        raise typer.Exit(1)
    if resp.status_code >= 400:
        _fail(f"{resp.status_code}: {_explain(resp)}", 2 if resp.status_code in (400, 422) else 1)
    n = resp.json()
    typer.echo(f"node {n['name']}: {n['state']} ({n['state_reason']})")


@app.command("validate")
def validate(
    name: str,
    wait: Annotated[bool, typer.Option("--wait", help="wait for the run and print its checks")] = False,
    level: Annotated[str, typer.Option(help="quick | full")] = "full",
    timeout_s: Annotated[float, typer.Option(help="with --wait: give up after this long")] = 1800.0,
) -> None:
    """Run the validator suite on a node now; prints the run's id (admins)."""
    if level not in ("quick", "full"):
        _fail(f"--level must be quick or full, got {level!r}", 2)
    run = _call("POST", f"/api/v1/nodes/{name}/validate", json={"level": level}).json()
    if not wait:
        typer.echo(str(run["id"]))
        return
    deadline = time.monotonic() + timeout_s
    while run["status"] == "pending":
        if time.monotonic() > deadline:
            _fail(f"validation run {run['id']} still pending after {timeout_s:g}s")
        time.sleep(1.0)
        run = _call("GET", f"/api/v1/validations/{run['id']}").json()
    _print_run(run)
    if run["status"] != "passed":
        raise typer.Exit(1)
