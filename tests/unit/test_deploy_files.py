"""docker-compose.yml is a valid Compose file describing the production stack."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_compose_file_validates_against_the_compose_spec():
    out = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(REPO / "docker-compose.yml")],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_stack_has_every_part_of_production_mode():
    spec = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = spec["services"]
    assert {"postgres", "redis", "migrate", "api", "scheduler", "worker"} <= set(services)
    assert any(name.startswith("agent") for name in services)
    commands = {name: " ".join(s["command"]) if isinstance(s.get("command"), list) else s.get("command", "") for name, s in services.items()}
    assert commands["migrate"] == "hai migrate"
    assert "hai server" in commands["api"] and "hai scheduler" in commands["scheduler"]
    assert "celery -A hai.tasks worker" in commands["worker"]
    assert services["api"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
