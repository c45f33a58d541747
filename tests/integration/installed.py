"""The package as users install it: the wheel that `python -m build backend` makes (sdist first,
then the wheel from the unpacked sdist), installed, not editable, into a throwaway virtualenv.

Built once per test session and shared by the tests that need it (test_packaging, test_compose).
Its dependencies come from pip's usual sources (this machine's pip configuration: caches and
local mirrors); the `hai` package itself comes only from the built wheel, which the fixture
checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.conftest import free_port, wait_for  # noqa: F401  (re-exported: the suite's one copy)

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Installed:
    venv: Path
    wheel: Path

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment: this venv first on PATH, nothing of the caller's HAI_* settings or
        virtualenv."""
        base = {k: v for k, v in os.environ.items() if not k.startswith(("HAI_", "VIRTUAL_ENV", "PYTHON"))}
        base["PATH"] = os.pathsep.join([str(self.bin), *_foreign_path()])
        base["PYTHONUNBUFFERED"] = "1"
        return {**base, **extra}


def _foreign_path() -> list[str]:
    """The caller's PATH less any folder holding another `hai` (the worktree's editable .venv)."""
    return [p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep) if p and not (Path(p) / "hai").exists()]


_lock = threading.Lock()
_cache: dict[str, Installed] = {}


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def installed_package(tmp_path_factory) -> Installed:  # noqa: ANN001
    """Build the sdist and wheel from backend/, install the wheel into a fresh venv (once per
    session: pytest's tmp_path_factory)."""
    with _lock:
        if "it" in _cache:
            return _cache["it"]
        root = tmp_path_factory.mktemp("installed")
        dist = root / "dist"
        run([sys.executable, "-m", "build", str(REPO / "backend"), "--outdir", str(dist)], timeout=600)
        # the build must not leave copies in the source tree (one copy of the migrations)
        assert not (REPO / "backend" / "hai" / "_shipped").exists()
        (wheel,) = dist.glob("hai_platform-*.whl")
        venv = root / "venv"
        run([sys.executable, "-m", "venv", str(venv)])
        run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)], timeout=600)
        it = Installed(venv=venv, wheel=wheel)
        where = run([str(it.bin / "python"), "-c", "import hai; print(hai.__file__)"], cwd=root, env=it.env()).stdout.strip()
        assert Path(where).is_relative_to(venv), f"hai imported from {where}, not from the installed wheel"
        _cache["it"] = it
        return it


def tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def two_rank_job_succeeds(c, name: str) -> None:  # noqa: ANN001  (an httpx.Client signed in as admin)
    """Submit a 2-node command job through REST and check it succeeds with both ranks' logs."""
    r = c.post("/api/v1/jobs", json={"name": name, "nodes": 2, "command": ["bash", "-c", "echo rank $RANK of $WORLD_SIZE"]})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    job = wait_for(lambda: (j := c.get(f"/api/v1/jobs/{job_id}").json())["state"] in {"succeeded", "failed", "cancelled"} and j,
                   timeout=120, what="the job to end")
    assert job["state"] == "succeeded", job
    # an agent reports a rank finished only once the rank's last lines are delivered, so a job that
    # ended has all its output (read once, no waiting)
    logs = c.get(f"/api/v1/jobs/{job_id}/logs").text
    assert "[rank 0] rank 0 of 2" in logs.splitlines() and "[rank 1] rank 1 of 2" in logs.splitlines(), logs
