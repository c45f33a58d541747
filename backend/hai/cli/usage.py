"""`hai usage`: GPU-hours per user or group over a period, in the habit of Slurm's sreport."""

from __future__ import annotations

import json
from datetime import date, datetime, timedelta, timezone
from enum import Enum
from typing import Annotated

import typer

from hai.cli.client import _call, _fail, _table


class By(str, Enum):
    user = "user"
    group = "group"


def _parse_when(value: str, option: str) -> datetime:
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        try:
            when = datetime.combine(date.fromisoformat(value), datetime.min.time())
        except ValueError:
            _fail(f"{option} expects a date (YYYY-MM-DD) or an ISO time, got {value!r}", 2)
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def usage(
    by: Annotated[By, typer.Option(case_sensitive=False, help="group the figures by user or group")] = By.user,
    since: Annotated[str | None, typer.Option(help="start date YYYY-MM-DD (default: 7 days ago)")] = None,
    until: Annotated[str | None, typer.Option(help="end date YYYY-MM-DD (default: now)")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """GPU-hours per user or group (what the jobs' allocations held), largest first."""
    params: dict[str, str] = {"by": by.value}
    start = _parse_when(since, "--since") if since else datetime.now(timezone.utc) - timedelta(days=7)
    params["since"] = start.isoformat()
    if until:
        params["until"] = _parse_when(until, "--until").isoformat()
    data = _call("GET", "/api/v1/usage", params=params).json()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    typer.echo(f"GPU-hours by {data['by']}, {data['since']} .. {data['until']}")
    rows = [[r["key"], f"{r['gpu_hours']:.2f}", str(r["jobs"])] for r in data["rows"]]
    total = sum(r["gpu_hours"] for r in data["rows"])
    _table([data["by"].upper(), "GPU_HOURS", "JOBS"], rows + [["TOTAL", f"{total:.2f}", ""]])


def register(app: typer.Typer) -> None:
    app.command("usage")(usage)
