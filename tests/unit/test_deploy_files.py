"""The deploy files: docker-compose.yml is a valid Compose file describing the production stack; the
grafana dashboard asks only for exported metrics; deploy/buildah-storage.sh picks the image build's storage."""

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


def _storage_choice(tmp_path: Path, overlay_mounts: bool, opts: str | None = None) -> str:
    """deploy/buildah-storage.sh's answer with a stand-in `buildah` first on PATH: `from scratch`
    works for either driver; `mount` works for vfs, and for overlay only when ``overlay_mounts``."""
    fake = tmp_path / "bin" / "buildah"
    fake.parent.mkdir(parents=True)
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {tmp_path / "calls"}\n'
        'case "$3" in\n'
        "  from) echo ctr-$2 ;;\n"
        f'  mount) [ "$2" = vfs ] || [ {int(overlay_mounts)} = 1 ] || exit 125; echo /mnt ;;\n'
        "esac\n"
    )
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", **({"BUILDAH_OPTS": opts} if opts else {})}
    out = subprocess.run([str(REPO / "deploy" / "buildah-storage.sh")], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_buildah_storage_is_overlay_where_it_mounts_else_vfs_and_the_probe_container_is_removed(tmp_path):
    assert _storage_choice(tmp_path / "a", overlay_mounts=True) == "--storage-driver overlay"
    assert _storage_choice(tmp_path / "b", overlay_mounts=False) == "--storage-driver vfs"
    for case in ("a", "b"):  # the probe's scratch container removed whether its mount worked or not
        calls = (tmp_path / case / "calls").read_text().splitlines()
        assert calls[-1] == "--storage-driver overlay rm ctr-overlay", calls


def test_buildah_storage_takes_buildah_opts_as_given(tmp_path):
    opts = "--storage-driver vfs --root /srv/containers"
    assert _storage_choice(tmp_path, overlay_mounts=True, opts=opts) == opts
    assert not (tmp_path / "calls").exists()  # nothing probed
