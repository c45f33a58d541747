"""The `hai` command."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Annotated

import typer

from hai.cli import client
from hai.cli import usage as usage_cli

app = typer.Typer(no_args_is_help=True, add_completion=False, help="HAI platform: GPU-cluster job scheduling")
admin_app = typer.Typer(no_args_is_help=True, help="administration (talks to the database directly)")
app.add_typer(admin_app, name="admin")
client.register(app)
usage_cli.register(app)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"hai-platform {version('hai-platform')}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="print the package version")
    ] = False,
) -> None:
    """HAI platform: GPU-cluster job scheduling"""


def _logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _settings(data_dir: Path | None = None):  # noqa: ANN202
    from hai.settings import Settings

    return Settings(data_dir=data_dir) if data_dir is not None else Settings()


@app.command()
def server(
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8080,
    data_dir: Annotated[Path | None, typer.Option(help="embedded mode: where SQLite lives")] = None,
    topology: Annotated[Path | None, typer.Option(help="CSV node,gpus,leaf,zone")] = None,
    workers: Annotated[int, typer.Option(min=1, max=256, help="worker processes (production: as many as cores; "
                                         "needs PostgreSQL and Redis so that they share state)")] = 1,
) -> None:
    """Run the API server (production: HAI_DB__URL, HAI_REDIS__URL)."""
    import uvicorn

    from hai.api.http_protocol import HTTP_PROTOCOL
    from hai.main import create_app
    from hai.services.context import Platform

    _logging()
    settings = _settings(data_dir)
    platform = Platform.from_settings(settings)
    _bootstrap(platform, topology)
    if workers == 1:
        from hai.cli.dev import StoppingServer, run_then

        # (the platform closed also on SIGTERM: ``run_then``)
        run_then(StoppingServer(uvicorn.Config(create_app(platform, tune_gc=True), host=host, port=port,
                                               log_level="info", access_log=settings.http.access_log,
                                               http=HTTP_PROTOCOL), platform),
                 platform.close)
        return
    if settings.database_url.startswith("sqlite") or not settings.redis.url:
        typer.echo("--workers above 1 needs HAI_DB__URL (PostgreSQL) and HAI_REDIS__URL: the worker processes "
                   "share the database and wake each other through Redis", err=True)
        platform.close()
        raise typer.Exit(2)
    platform.close()
    if data_dir is not None:
        os.environ["HAI_DATA_DIR"] = str(data_dir)
    # each worker process builds its own app and platform from the environment
    # a worker that is slow to answer the supervisor's ping (a loaded host) is not dead: 60 s, not 5;
    # keep-alive 75 s: agents reuse their connection every heartbeat (uvicorn closes idle ones after 5 s)
    uvicorn.run("hai.main:server_app", factory=True, workers=workers, host=host, port=port, log_level="info",
                access_log=settings.http.access_log, timeout_worker_healthcheck=60, timeout_keep_alive=75,
                http=HTTP_PROTOCOL)


def _bootstrap(platform, topology: Path | None) -> None:  # noqa: ANN001
    from sqlalchemy.exc import IntegrityError

    # issue 13: replicas starting at once race to create the same bootstrap rows; the loser
    # finds them made by the winner on its next try
    for attempt in range(5):
        try:
            return _bootstrap_once(platform, topology)
        except IntegrityError:
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))


def _bootstrap_once(platform, topology: Path | None) -> None:  # noqa: ANN001
    from hai.services import auth
    from hai.services import nodes as node_service

    creds = platform.settings.auth
    with platform.sessions() as session:
        if creds.bootstrap_admin_token:
            auth.ensure_user_token(
                session=session, name="admin", group="admin", is_admin=True, secret=creds.bootstrap_admin_token
            )
        if creds.bootstrap_agent_token:
            auth.ensure_agent_token(session=session, secret=creds.bootstrap_agent_token)
        if topology is not None:
            node_service.load_topology(session=session, path=topology)


@app.command()
def scheduler(
    data_dir: Annotated[Path | None, typer.Option()] = None,
) -> None:
    """Run the scheduler loop (one leader at a time; a second replica waits)."""
    from hai.services.context import Platform
    from hai.services.runner import SchedulerLoop

    _logging()
    platform = Platform.from_settings(_settings(data_dir))
    loop = SchedulerLoop(platform)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: loop.stop.set())
    loop.run()
    platform.close()


@app.command()
def agent(
    server: Annotated[str, typer.Option(help="the API server's URL (or several, comma-separated: the agent moves to the next one when one is down)")],
    token: Annotated[str, typer.Option(envvar="HAI_AGENT_TOKEN", help="the node credential")],
    node: Annotated[str, typer.Option(help="this node's name")],
    zone: Annotated[str | None, typer.Option()] = None,
    leaf: Annotated[str | None, typer.Option()] = None,
    fake_gpus: Annotated[int | None, typer.Option(min=1, max=64, help="use N fake GPUs instead of NVML")] = None,
    gpus: Annotated[str | None, typer.Option(help="use only these NVML GPU indices, e.g. 0,1")] = None,
    state_dir: Annotated[Path, typer.Option()] = Path("/var/lib/hai-agent"),
    address: Annotated[str | None, typer.Option(help="address other nodes reach this one at")] = None,
    checkpoint_root: Annotated[str | None, typer.Option(help="where per-job checkpoint folders live")] = None,
    user_map: Annotated[str | None, typer.Option(
        envvar="HAI_AGENT_USER_MAP",
        help="file mapping platform users to Unix accounts: ranks run as the submitter (production; "
             "the agent runs as root). Without it ranks run as the agent's own user")] = None,
    ranks_as_agent_user: Annotated[bool, typer.Option(
        envvar="HAI_AGENT_RANKS_AS_AGENT_USER",
        help="development only: with no --user-map, run ranks as the agent's own user even when that is root "
             "(without this flag a root agent with no user map refuses to start)")] = False,
    kill_grace_s: Annotated[float, typer.Option(min=0, help="SIGTERM to SIGKILL")] = 10.0,
    stop_jobs_on_exit: Annotated[bool, typer.Option(help="stop running jobs when the agent exits")] = False,
    inject_faults: Annotated[list[str] | None, typer.Option(
        "--inject-fault", help="fake GPUs only: a hardware fault KIND[@SECONDS] (xid:N, ecc, gpu-missing, slow-gemm), repeatable")] = None,
) -> None:
    """Run the node agent."""
    from hai.agent.faults import BadFaultSpec, parse_fault
    from hai.agent.main import AgentOptions, run_agent
    from hai.agent.users import root_without_user_map

    refusal = root_without_user_map(os.geteuid(), user_map, ranks_as_agent_user)
    if refusal:
        typer.echo(f"hai agent: {refusal}", err=True)
        raise typer.Exit(2)

    for spec in inject_faults or []:
        if fake_gpus is None:
            raise typer.BadParameter("--inject-fault needs --fake-gpus", param_hint="--inject-fault")
        try:
            parse_fault(spec)
        except BadFaultSpec as e:
            raise typer.BadParameter(str(e), param_hint="--inject-fault") from None

    indices = None
    if gpus:
        try:
            indices = [int(x) for x in gpus.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter(f"--gpus expects indices like 0,1; got {gpus!r}") from None
    _logging()
    run_agent(AgentOptions(
        server=server, token=token, node=node, zone=zone, leaf=leaf, fake_gpus=fake_gpus,
        state_dir=str(state_dir), address=address, gpu_indices=indices, checkpoint_root=checkpoint_root,
        user_map=user_map, ranks_as_agent_user=ranks_as_agent_user,
        kill_grace_s=kill_grace_s, stop_jobs_on_exit=stop_jobs_on_exit,
        inject_faults=tuple(inject_faults) if inject_faults else None,
    ))


@app.command()
def kubernetes(
    data_dir: Annotated[Path | None, typer.Option()] = None,
) -> None:
    """Run the Kubernetes execution backend (HAI_EXECUTOR=kubernetes; HAI_KUBERNETES__*)."""
    from hai.services.context import Platform

    settings = _settings(data_dir)
    if settings.executor != "kubernetes":
        typer.echo("HAI_EXECUTOR is not 'kubernetes': the agents run the jobs", err=True)
        raise typer.Exit(2)
    from hai.integrations.kubernetes.backend import start_backend

    _logging()
    platform = Platform.from_settings(settings)
    backend = start_backend(platform)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: backend.stop_event.set())
    while not backend.stop_event.wait(1.0):
        pass
    backend.close()
    platform.close()


@app.command()
def dev(
    port: Annotated[int, typer.Option()] = 8080,
    agents: Annotated[int, typer.Option(min=0, max=64)] = 4,
    data_dir: Annotated[Path, typer.Option()] = Path(".hai"),
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    gpus_per_agent: Annotated[int, typer.Option(min=1, max=8)] = 8,
) -> None:
    """API server + scheduler + N fake-GPU agents on embedded SQLite, in one command."""
    from hai.cli.dev import run_dev

    _logging()
    run_dev(port=port, agents=agents, data_dir=data_dir, host=host, gpus_per_agent=gpus_per_agent)


@app.command()
def migrate(data_dir: Annotated[Path | None, typer.Option()] = None) -> None:
    """Bring the database schema up to date (alembic upgrade head)."""
    from hai.db.migrate import upgrade

    upgrade(_settings(data_dir).database_url)
    typer.echo("database is at head")


@app.command()
def openapi(out: Annotated[Path | None, typer.Option()] = None) -> None:
    """Print the OpenAPI schema (the frontend's client is generated from it)."""
    from hai.main import create_app

    text = json.dumps(create_app().openapi(), indent=2, sort_keys=True) + "\n"
    if out:
        out.write_text(text)
    else:
        typer.echo(text, nl=False)


@admin_app.command("create-user")
def create_user(
    name: str,
    group: Annotated[str, typer.Option()],
    admin: Annotated[bool, typer.Option("--admin")] = False,
    data_dir: Annotated[Path | None, typer.Option()] = None,
) -> None:
    """Create a user; prints their first API token."""
    from hai.services import auth
    from hai.services.context import Platform
    from hai.services.errors import ServiceError

    platform = Platform.from_settings(_settings(data_dir))
    try:
        with platform.sessions() as session:
            _user, secret = auth.create_user(session=session, name=name, group=group, is_admin=admin)
    except ServiceError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None
    finally:
        platform.close()
    typer.echo(secret)


@admin_app.command("create-agent-token")
def create_agent_token(
    name: Annotated[str, typer.Option()] = "agents",
    data_dir: Annotated[Path | None, typer.Option()] = None,
) -> None:
    """Create a node credential for agents; prints it."""
    from hai.services import auth
    from hai.services.context import Platform

    platform = Platform.from_settings(_settings(data_dir))
    with platform.sessions() as session:
        typer.echo(auth.create_agent_token(session=session, name=name))
    platform.close()


from hai.cli import sim as sim_cli  # noqa: E402

app.add_typer(sim_cli.topology_app, name="topology")
app.command("sim")(sim_cli.sim)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    app()

