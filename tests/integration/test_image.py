"""deploy/Dockerfile, built for real, and the image run: `hai --version`, `hai migrate` against
the test PostgreSQL, `hai server` answering /healthz.

Built with `make image`'s script (deploy/build-image.sh): here that is buildah without a daemon
(`--isolation chroot`; overlay storage where the kernel mounts it, else vfs, as
deploy/buildah-storage.sh decides for the build) on base images made from Debian's packages
(deploy/local-base.sh), because no image registry is reachable. The bases are made once per
machine and kept in buildah's storage; the image's layers are cached there too, so a build after
a code change re-runs only the steps below the change. The image is tagged per checkout, so two
checkouts on one machine never build over each other's tag.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import signal
import subprocess
import tomllib

import httpx
import pytest
from alembic.config import Config
from alembic.script import ScriptDirectory
from dockerfile_parse import DockerfileParser
from sqlalchemy import create_engine, text

from tests.integration.installed import REPO, free_port, tail, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

ISOLATION = ["--isolation", "chroot"]
IMAGE = "localhost/hai-platform:test-" + hashlib.sha256(str(REPO).encode()).hexdigest()[:10]


@functools.cache
def buildah() -> list[str]:
    """buildah with the storage options the build script uses (the image lives in that store)."""
    opts = subprocess.run([str(REPO / "deploy" / "buildah-storage.sh")], capture_output=True, text=True, check=True)
    return ["buildah", *opts.stdout.split()]


def test_the_dockerfile_parses_into_the_three_stages_on_base_image_arguments():
    parsed = DockerfileParser(str(REPO / "deploy" / "Dockerfile"))
    froms = [i["value"] for i in parsed.structure if i["instruction"] == "FROM"]
    assert froms == ["${NODE_BASE} AS frontend", "${PYTHON_BASE} AS backend", "${PYTHON_BASE} AS runtime"]
    args = [i["value"] for i in parsed.structure if i["instruction"] == "ARG"]
    assert "PYTHON_BASE=python:3.11-slim" in args and "NODE_BASE=node:20-slim" in args
    assert parsed.baseimage == "python:3.11-slim"  # the default for everyone with a registry


def _buildah_usable() -> str | None:
    """None when buildah can build and run here, else the reason (its own error)."""
    if shutil.which("buildah") is None:
        return "buildah is not installed (.ci/run installs it: apt-get install buildah)"
    out = subprocess.run([*buildah(), "from", "scratch"], capture_output=True, text=True)
    if out.returncode != 0:
        return f"buildah cannot run in this sandbox: {out.stderr.strip()}"
    subprocess.run([*buildah(), "rm", out.stdout.strip()], capture_output=True)
    return None


@pytest.fixture(scope="module")
def container():
    reason = _buildah_usable()
    if reason:
        pytest.skip(reason)
    # the build in the very store this test reads (one probe, not one here and one in the script)
    env = {**os.environ, "HAI_IMAGE": IMAGE, "BUILDAH_OPTS": " ".join(buildah()[1:])}
    build = subprocess.run([str(REPO / "deploy" / "build-image.sh")], cwd=REPO, env=env, capture_output=True, text=True, timeout=1700)
    assert build.returncode == 0, build.stdout[-5000:] + build.stderr[-5000:]
    ctr = subprocess.run([*buildah(), "from", IMAGE], capture_output=True, text=True, check=True).stdout.strip()
    yield ctr
    subprocess.run([*buildah(), "rm", ctr], capture_output=True)


def in_image(ctr: str, *argv: str, env: dict[str, str] | None = None) -> list[str]:
    flags = [f"--env={k}={v}" for k, v in (env or {}).items()]
    return [*buildah(), "run", *ISOLATION, *flags, ctr, "--", *argv]


def test_hai_version_in_the_image(container):
    version = tomllib.loads((REPO / "backend" / "pyproject.toml").read_text())["project"]["version"]
    out = subprocess.run(in_image(container, "hai", "--version"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"hai-platform {version}"


def test_hai_migrate_in_the_image_brings_the_test_postgresql_to_head(container, pg_url):
    out = subprocess.run(in_image(container, "hai", "migrate", env={"HAI_DB__URL": pg_url}),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    head = ScriptDirectory.from_config(Config(str(REPO / "alembic.ini"))).get_current_head()
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == head
    finally:
        engine.dispose()


def test_hai_server_in_the_image_answers_healthz_and_serves_the_dashboard(container, pg_url, tmp_path):
    subprocess.run(in_image(container, "hai", "migrate", env={"HAI_DB__URL": pg_url}), check=True, capture_output=True, timeout=300)
    port = free_port()
    log = tmp_path / "server.log"
    env = {"HAI_DB__URL": pg_url, "HAI_AUTH__BOOTSTRAP_ADMIN_TOKEN": "a" * 32, "HAI_AUTH__BOOTSTRAP_AGENT_TOKEN": "b" * 32}
    # chroot isolation shares this machine's network: the port is a local one
    proc = subprocess.Popen(in_image(container, "hai", "server", "--host", "127.0.0.1", "--port", str(port), env=env),
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            if proc.poll() is not None:
                raise AssertionError(f"hai server in the image exited {proc.returncode}: {tail(log)}")
            try:
                return httpx.get(url + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout=120, what="hai server in the image to answer /healthz")
        page = httpx.get(url + "/", timeout=5)
        assert page.status_code == 200 and '<div id="root">' in page.text, page.text[:500]  # the built dashboard
    finally:
        # buildah run (chroot isolation) ends the command it runs when it is itself signalled
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def gone():
        try:
            httpx.get(url + "/healthz", timeout=1)
            return False
        except httpx.HTTPError:
            return True

    wait_for(gone, timeout=30, what="the server in the image to stop with its buildah run")
