"""docker-compose.yml, run as written, without a container engine.

The test reads the file (YAML anchors and merge keys, `${VAR:-default}` / `${VAR:?error}`
interpolation), and runs every service that is built from this repository's image as a real
process of a non-editable install of the package (the built wheel, tests/integration/installed.py),
with that service's `command` and `environment` on top of the image's own ENV (read from
deploy/Dockerfile's runtime stage with a real Dockerfile parser). What an engine would provide is
mapped, and only that: the `postgres` and `redis` services are the test's PostgreSQL (a fresh
database) and Redis; service hostnames in URLs and `--address` become 127.0.0.1; each published
container port becomes a free local port; volumes and the image's data folders become folders
under the test's tmp dir. Services start in the file's `depends_on` order, each waiting for the
conditions it names (`service_completed_successfully`, `service_healthy` via the service's own
healthcheck command, run as written).
"""

from __future__ import annotations

import graphlib
import os
import re
import secrets
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from sqlalchemy import create_engine, text

from tests.integration.installed import REPO, two_rank_job_succeeds, _foreign_path, Installed, free_port, installed_package, tail, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

_VAR = re.compile(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>\w+)")


def interpolate(value, variables: dict[str, str]):  # noqa: ANN001, ANN201
    """Compose's variable substitution: $$, ${VAR}, $VAR, ${VAR:-default}, ${VAR-default},
    ${VAR:?error}, ${VAR?error}."""
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg = m.group("op"), m.group("arg")
        current = variables.get(name)
        unset = current is None or (op is not None and op.startswith(":") and current == "")
        if op and op.endswith("-"):
            return arg if unset else current
        if op and op.endswith("?"):
            if unset:
                raise AssertionError(f"compose refuses to start: {name}: {arg}")
            return current
        return current or ""

    return _VAR.sub(one, value)


def duration_s(text_: str | None, default: float) -> float:
    if not text_:
        return default
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text_))


@dataclass
class Service:
    name: str
    spec: dict
    root: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return self.root / "service.log"


class ComposeRun:
    def __init__(self, *, spec: dict, image_env: dict[str, str], installed: Installed, tmp: Path, pg_url: str, redis_url: str,
                 image_user: str = "root"):
        self.spec, self.installed, self.tmp = spec, installed, tmp
        services = spec["services"]
        # services built from this repository run as processes; the others are the test's servers
        self.ours = {n: s for n, s in services.items() if "build" in s}
        self.external = {"postgres": pg_url, "redis": redis_url}
        assert set(services) - set(self.ours) == set(self.external), "compose has services this test does not know"
        self.ports: dict[tuple[str, int], int] = {}  # (service, container port) -> local port
        for name, s in self.ours.items():
            for p in s.get("ports", []):
                self.ports[(name, int(str(p).rsplit(":", 1)[-1]))] = free_port()
        self.services: dict[str, Service] = {}
        for name, s in self.ours.items():
            svc = Service(name=name, spec=s, root=tmp / name)
            svc.root.mkdir(parents=True)
            # what an engine mounts, and the image's own writable folders
            mounts = [str(v).split(":", 1)[1] for v in s.get("volumes", [])] + [image_env["HAI_DATA_DIR"], "/var/lib/hai-agent"]
            svc.argv = self.rewrite_argv(list(s["command"]), svc, mounts)
            env = {**image_env, **{k: str(v) for k, v in (s.get("environment") or {}).items()}}
            # the image's venv is this install's; the base image's own PATH is this machine's
            env["PATH"] = env["PATH"].replace("/opt/venv/bin", str(installed.bin)).rstrip(os.pathsep)
            env["PATH"] = os.pathsep.join([env["PATH"], *_foreign_path()])
            if image_user not in ("root", "0") and "user" not in s and os.geteuid() == 0:
                # the container would run as the image's USER, not root; these processes run as
                # this machine's root, which a root agent with no user map refuses: tell it what
                # it would be in the container (ranks as its own, non-root, user)
                env["HAI_AGENT_RANKS_AS_AGENT_USER"] = "1"
            svc.env = installed.env(**{k: self.rewrite_value(v, svc, mounts) for k, v in env.items()}, HOME=str(svc.root))
            self.services[name] = svc
        graph = {n: [d for d in (s.get("depends_on") or {}) if d in self.ours] for n, s in self.ours.items()}
        self.order = list(graphlib.TopologicalSorter(graph).static_order())

    # -- what the engine would have provided --------------------------------------------------
    def _hostport(self, m: re.Match, svc: Service) -> str:
        host, port = m.group("host"), int(m.group("port"))
        target = svc.name if host in ("127.0.0.1", "localhost", "0.0.0.0") else host
        if (target, port) in self.ports:
            return f"127.0.0.1:{self.ports[(target, port)]}"
        return m.group(0)

    def rewrite_value(self, value: str, svc: Service, mounts: list[str]) -> str:
        try:
            parts = urlsplit(value)
        except ValueError:
            parts = None
        if parts is not None and parts.scheme and parts.hostname in self.external:
            return self.external[parts.hostname]
        value = re.sub(r"(?P<host>[\w.-]+):(?P<port>\d+)", lambda m: self._hostport(m, svc), value)
        for target in sorted(mounts, key=len, reverse=True):
            if value == target or value.startswith(target + "/"):
                return str(svc.root) + value
        return value

    def rewrite_argv(self, argv: list[str], svc: Service, mounts: list[str]) -> list[str]:
        out = []
        for i, arg in enumerate(argv):
            prev = argv[i - 1] if i else ""
            if prev == "--port" and (svc.name, int(arg)) in self.ports:
                arg = str(self.ports[(svc.name, int(arg))])
            elif prev == "--address" and arg in self.ours:
                arg = "127.0.0.1"
            else:
                arg = self.rewrite_value(arg, svc, mounts)
            out.append(arg)
        return out

    # -- running ----------------------------------------------------------------------------
    def start(self, svc: Service, argv: list[str] | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            argv or svc.argv, cwd=svc.root, env=svc.env, stdout=svc.log.open("a"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def healthy(self, svc: Service) -> bool:
        check = svc.spec["healthcheck"]
        test = [self.rewrite_value(a, svc, []) for a in check["test"]]
        kind, args = test[0], test[1:]
        argv = args if kind == "CMD" else ["sh", "-c", args[0]]
        assert kind in ("CMD", "CMD-SHELL"), test
        try:
            return subprocess.run(argv, cwd=svc.root, env=svc.env, capture_output=True,
                                  timeout=duration_s(check.get("timeout"), 30)).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def wait_condition(self, dep: str, condition: str) -> None:
        if dep in self.external:
            return  # the test's own PostgreSQL and Redis are up (their fixtures checked)
        svc = self.services[dep]
        if condition == "service_completed_successfully":
            code = svc.proc.wait(120)
            assert code == 0, f"{dep} exited {code}: {tail(svc.log)}"
        elif condition == "service_healthy":
            check = svc.spec["healthcheck"]
            budget = duration_s(check.get("start_period"), 0) + duration_s(check.get("interval"), 30) * check.get("retries", 3)

            def ok():
                if svc.proc.poll() is not None:
                    raise AssertionError(f"{dep} exited {svc.proc.returncode}: {tail(svc.log)}")
                return self.healthy(svc)

            wait_for(ok, timeout=max(budget, 60), interval=0.5, what=f"{dep} healthy (its healthcheck)")
        else:
            assert condition == "service_started", condition

    def up(self) -> None:
        for name in self.order:
            svc = self.services[name]
            for dep, cond in (svc.spec.get("depends_on") or {}).items():
                self.wait_condition(dep, cond.get("condition", "service_started"))
            svc.proc = self.start(svc)

    def down(self) -> dict[str, int]:
        """Stop in reverse dependency order, as `docker compose down`: SIGTERM, then the
        service's stop_grace_period (10 s by default) before SIGKILL."""
        codes = {}
        for name in reversed(self.order):
            svc = self.services[name]
            if svc.proc is None:
                continue
            if svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
                try:
                    svc.proc.wait(duration_s(svc.spec.get("stop_grace_period"), 10))
                except subprocess.TimeoutExpired:
                    os.killpg(svc.proc.pid, signal.SIGKILL)
                    svc.proc.wait(10)
                    codes[name] = "killed after the grace period"
                    continue
            codes[name] = svc.proc.returncode
        return codes

    def kill_all(self) -> None:
        for svc in self.services.values():
            if svc.proc is not None and svc.proc.poll() is None:
                os.killpg(svc.proc.pid, signal.SIGKILL)
                svc.proc.wait(10)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    return installed_package(tmp_path_factory)


def test_the_compose_stack_runs_as_written_and_a_job_succeeds(installed, tmp_path, pg_url, redis_url):
    admin_token, agent_token = secrets.token_hex(16), secrets.token_hex(16)
    variables = {"HAI_ADMIN_TOKEN": admin_token, "HAI_AGENT_TOKEN": agent_token}
    spec = interpolate(yaml.safe_load((REPO / "docker-compose.yml").read_text()), variables)
    image = DockerfileParser(str(REPO / "deploy" / "Dockerfile"))
    image_env = dict(image.envs)  # the last (runtime) stage's ENV ($PATH of the base resolves to "")
    image_user = [i["value"] for i in image.structure if i["instruction"] == "USER"][-1]
    compose = ComposeRun(spec=spec, image_env=image_env, installed=installed, tmp=tmp_path / "stack",
                         pg_url=pg_url, redis_url=redis_url, image_user=image_user)
    assert compose.order.index("migrate") < compose.order.index("api") < compose.order.index("agent-1")
    agents = [n for n in compose.order if n.startswith("agent")]
    assert len(agents) == 2
    api = compose.services["api"]
    url = f"http://127.0.0.1:{compose.ports[('api', 8080)]}"
    try:
        compose.up()
        assert compose.services["migrate"].proc.returncode == 0  # waited for by api's depends_on
        assert compose.healthy(api)

        # scheduler: leads (its log says so, and it holds the advisory lock in this database)
        sched = compose.services["scheduler"]
        wait_for(lambda: "scheduler: leading" in tail(sched.log, 100_000), timeout=60, what="the scheduler to lead")
        engine = create_engine(pg_url)
        try:
            with engine.connect() as conn:
                held = conn.execute(text(
                    "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
                    "WHERE l.locktype = 'advisory' AND l.granted AND d.datname = current_database()"
                )).scalar()
            assert held == 1
        finally:
            engine.dispose()

        # worker: beat is embedded, and the worker runs what beat sends
        worker = compose.services["worker"]
        wait_for(lambda: re.search(r"Task hai\.tasks\.reap_lost_nodes\[[^\]]+\] succeeded", tail(worker.log, 1_000_000)),
                 timeout=90, what="beat to send reap_lost_nodes and the worker to run it")
        assert "beat: Starting..." in tail(worker.log, 1_000_000)

        # both agents register
        headers = {"Authorization": f"Bearer {admin_token}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            def registered():
                nodes = c.get("/api/v1/nodes").json()
                return sorted(n["name"] for n in nodes if n["state"] == "ready") == ["agent-1", "agent-2"] and nodes

            nodes = wait_for(registered, timeout=90, what="agent-1 and agent-2 to register")
            assert all(n["zone"] == "A" for n in nodes)

            two_rank_job_succeeds(c, "compose")

        for name in compose.order:
            if name != "migrate":
                assert compose.services[name].proc.poll() is None, f"{name} died: {tail(compose.services[name].log)}"
        codes = compose.down()
    except BaseException:
        compose.kill_all()
        for svc in compose.services.values():
            print(f"---- {svc.name}: {svc.argv}\n{tail(svc.log)}")
        raise
    # stopped cleanly: each on its own within its grace period; uvicorn re-raises the SIGTERM it
    # handled after a complete shutdown, the others exit 0
    assert codes == {**{n: 0 for n in codes}, "api": -signal.SIGTERM}, codes
    assert "Application shutdown complete" in tail(api.log, 1_000_000)
