"""Issue 12: a serving process's collector is tuned once its app has started (``hai.main.
tune_collector``): the objects alive then are frozen out of later collections and the first
generation's threshold is ``HAI_HTTP__GC_THRESHOLD`` (0: Python's defaults, nothing frozen).
The factory that ``hai server --workers N`` hands uvicorn (``hai.main:server_app``) does it; an
app built for a test does not. Each case runs in a fresh interpreter: the collector is per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import gc, json, sys
from fastapi.testclient import TestClient
import hai.main
app = hai.main.server_app() if sys.argv[1] == "factory" else hai.main.create_app()
before = gc.get_threshold()
with TestClient(app) as client:
    healthy = client.get("/healthz").status_code
    print(json.dumps({"before": before, "threshold": gc.get_threshold(), "frozen": gc.get_freeze_count(),
                      "healthz": healthy}))
"""


def _probe(tmp_path: Path, how: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HAI_")}
    environ.update(HAI_DATA_DIR=str(tmp_path), HAI_FRONTEND_DIST=str(tmp_path / "none"), **env)
    out = subprocess.run([sys.executable, "-c", PROBE, how], env=environ, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_server_factory_freezes_the_startup_heap_and_raises_the_first_threshold(tmp_path):  # noqa: ANN001
    got = _probe(tmp_path, "factory")
    assert got["healthz"] == 200
    assert got["before"][0] == 700  # Python's default until the app has started
    assert got["threshold"] == [50_000, got["before"][1], got["before"][2]]
    assert got["frozen"] > 10_000  # modules, mappers, the app: out of every later collection


@pytest.mark.parametrize("how, env", [("factory", {"HAI_HTTP__GC_THRESHOLD": "0"}), ("plain", {})])
def test_zero_or_an_app_built_outside_the_cli_keeps_pythons_collector(tmp_path, how, env):  # noqa: ANN001
    got = _probe(tmp_path, how, **env)
    assert got["healthz"] == 200
    assert got["threshold"] == got["before"] and got["frozen"] == 0


def test_a_configured_threshold_is_used(tmp_path):  # noqa: ANN001
    assert _probe(tmp_path, "factory", HAI_HTTP__GC_THRESHOLD="20000")["threshold"][0] == 20_000
