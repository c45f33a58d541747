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


def test_grafana_dashboard_queries_only_metrics_the_server_exports():
    import json
    import re

    dash = json.loads((REPO / "deploy" / "grafana" / "hai-dashboard.json").read_text())

    source = (REPO / "backend" / "hai" / "api" / "metrics.py").read_text()
    exported = set(re.findall(r'GaugeMetricFamily\(\s*"(hai_[a-z_]+)"', source))
    assert {"hai_node_gpu_utilization_percent", "hai_queue_wait_max_seconds"} <= exported
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"hai_[a-z_]+", t["expr"])}
    used |= {m for v in dash["templating"]["list"] for m in re.findall(r"hai_[a-z_]+", v["query"]["query"])}
    assert used and used <= exported, used - exported
