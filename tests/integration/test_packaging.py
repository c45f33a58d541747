"""The package installed the way users install it (the built wheel, not editable), used from
folders that have nothing of the source tree: the Alembic tree and the dashboard travel inside it."""

from __future__ import annotations

import os
import signal
import subprocess
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, inspect

from tests.integration.installed import REPO, two_rank_job_succeeds, Installed, free_port, installed_package, run, tail, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    return installed_package(tmp_path_factory)


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    """An empty working directory, far from the repository."""
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_the_wheel_carries_every_migration_and_the_alembic_environment(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    tree = [p for p in (REPO / "migrations").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert any(p.parent.name == "versions" for p in tree)
    for p in tree:
        shipped = "hai/_shipped/migrations/" + p.relative_to(REPO / "migrations").as_posix()
        assert shipped in names, f"{shipped} missing from {installed.wheel.name}"
        assert zipfile.ZipFile(installed.wheel).read(shipped) == p.read_bytes(), f"{shipped} differs from {p}"
    assert zipfile.ZipFile(installed.wheel).read("hai/_shipped/alembic.ini") == (REPO / "alembic.ini").read_bytes()


def test_hai_version_prints_the_package_version(installed, elsewhere):
    version = tomllib.loads((REPO / "backend" / "pyproject.toml").read_text())["project"]["version"]
    out = run([str(installed.bin / "hai"), "--version"], cwd=elsewhere, env=installed.env())
    assert out.stdout.strip() == f"hai-platform {version}"


def test_hai_migrate_from_any_directory_brings_postgresql_to_head(installed, elsewhere, pg_url):
    out = run([str(installed.bin / "hai"), "migrate"], cwd=elsewhere, env=installed.env(HAI_DB__URL=pg_url))
    assert "database is at head" in out.stdout
    engine = create_engine(pg_url)
    try:
        assert {"jobs", "nodes", "alembic_version"} <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    # and alembic itself, with the shipped configuration, agrees it is at head
    ini = run([str(installed.bin / "python"), "-m", "hai.db.migrate"], cwd=elsewhere, env=installed.env()).stdout.strip()
    assert Path(ini).is_relative_to(installed.venv)
    cur = run([str(installed.bin / "alembic"), "-c", ini, "current"], cwd=elsewhere, env=installed.env(HAI_DB__URL=pg_url))
    heads = run([str(installed.bin / "alembic"), "-c", ini, "heads"], cwd=elsewhere, env=installed.env())
    head = heads.stdout.split()[0]
    assert cur.stdout.split()[0] == head, cur.stdout


def test_alembic_with_the_shipped_ini_upgrades_an_embedded_database(installed, elsewhere):
    ini = run([str(installed.bin / "python"), "-m", "hai.db.migrate"], cwd=elsewhere, env=installed.env()).stdout.strip()
    data = elsewhere / "data"
    run([str(installed.bin / "alembic"), "-c", ini, "upgrade", "head"], cwd=elsewhere, env=installed.env(HAI_DATA_DIR=str(data)))
    engine = create_engine(f"sqlite:///{data / 'hai.db'}")
    try:
        assert {"jobs", "nodes"} <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _serve(installed: Installed, cwd: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = cwd / "server.log"
    proc = subprocess.Popen(
        [str(installed.bin / "hai"), "server", "--port", str(port)],
        cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy():
        if proc.poll() is not None:
            raise AssertionError(f"hai server exited {proc.returncode}: {tail(log)}")
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, timeout=90, what="hai server /healthz")
    return proc, url, log


def _stop(proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM, as a service manager stops it: uvicorn shuts down gracefully, then re-raises the
    signal, so the process ends by SIGTERM after its shutdown completes."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise
    assert proc.returncode in (0, -signal.SIGTERM), tail(log)
    assert "Application shutdown complete" in tail(log, 100_000), tail(log)


def test_installed_server_serves_the_dashboard_the_wheel_carries(installed, elsewhere):
    built = REPO / "frontend" / "dist" / "index.html"
    if not built.exists():
        pytest.skip("frontend/dist is not built (make frontend): the wheel carries no dashboard to serve")
    proc, url, log = _serve(installed, elsewhere, installed.env(HAI_DATA_DIR=str(elsewhere / "data")))
    try:
        r = httpx.get(url + "/", timeout=5)
        assert r.status_code == 200
        assert r.text == built.read_text()
    finally:
        _stop(proc, log)


def test_installed_server_without_a_dashboard_says_how_to_build_it(installed, elsewhere):
    missing = elsewhere / "no-dist"
    env = installed.env(HAI_DATA_DIR=str(elsewhere / "data"), HAI_FRONTEND_DIST=str(missing))
    proc, url, log = _serve(installed, elsewhere, env)
    try:
        r = httpx.get(url + "/", timeout=5)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "npm run build" in r.text and "HAI_FRONTEND_DIST" in r.text
        assert httpx.get(url + "/healthz", timeout=5).status_code == 200  # the API is unaffected
    finally:
        _stop(proc, log)
    assert tail(log, 100_000).count("no built dashboard") == 1, tail(log)


def test_hai_dev_from_an_empty_folder_runs_a_job(installed, elsewhere):
    port = free_port()
    log = elsewhere.parent / "dev.log"
    proc = subprocess.Popen(
        [str(installed.bin / "hai"), "dev", "--port", str(port), "--agents", "2"],
        cwd=elsewhere, env=installed.env(), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    token_file = elsewhere / ".hai" / "admin-token"
    try:
        def ready():
            if proc.poll() is not None:
                raise AssertionError(f"hai dev exited {proc.returncode}: {tail(log)}")
            if not token_file.exists():
                return None
            try:
                nodes = httpx.get(f"{url}/api/v1/nodes", headers={"Authorization": f"Bearer {token_file.read_text().strip()}"}).json()
            except (httpx.HTTPError, ValueError):
                return None
            return isinstance(nodes, list) and sum(n["state"] == "ready" for n in nodes) == 2

        wait_for(ready, timeout=120, what="hai dev and its 2 agents")
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token_file.read_text().strip()}"}, timeout=30) as c:
            two_rank_job_succeeds(c, "from-the-wheel")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    # a clean stop on Ctrl-C: the server shuts down and re-raises the SIGINT (exit 130), after the
    # agents it started have stopped
    assert proc.returncode in (0, 130, -signal.SIGINT), tail(log)
    text_ = tail(log, 1_000_000)
    assert "agent node-01 stopped" in text_ and "agent node-02 stopped" in text_, tail(log)
    assert (elsewhere / ".hai" / "hai.db").exists()  # the schema was made where it ran, from the shipped tree
