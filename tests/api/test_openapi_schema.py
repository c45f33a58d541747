"""The frontend's client is generated from frontend/openapi.json: it must be the server's schema."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from hai.main import create_app

REPO = Path(__file__).resolve().parents[2]


def test_committed_openapi_matches_the_server():
    committed = json.loads((REPO / "frontend" / "openapi.json").read_text())
    assert committed == json.loads(json.dumps(create_app().openapi())), "run `make openapi` and commit the result"


def test_every_endpoint_but_health_and_docs_requires_a_token():
    schema = create_app().openapi()
    open_paths = {p for p, ops in schema["paths"].items() for op in ops.values() if not op.get("security")}
    assert open_paths == {"/healthz"}


def test_generated_client_matches_the_committed_schema(tmp_path):
    """src/api/gen/ is openapi-typescript's output for frontend/openapi.json, untouched (`make openapi`)."""
    frontend = REPO / "frontend"
    generator = frontend / "node_modules" / ".bin" / "openapi-typescript"
    assert generator.exists(), "the frontend's packages are missing: `cd frontend && npm ci` (make test does it)"
    out = tmp_path / "schema.d.ts"
    subprocess.run(
        [str(generator), "openapi.json", "--output", str(out)],
        cwd=frontend, check=True, capture_output=True, timeout=300,
    )
    committed = (frontend / "src" / "api" / "gen" / "schema.d.ts").read_text()
    assert out.read_text() == committed, "src/api/gen/schema.d.ts is stale or edited: run `make openapi` and commit"


def test_no_hand_written_client_beside_the_generated_one():
    """Every module of src/api calling the REST API goes through the generated, typed client."""
    api = REPO / "frontend" / "src" / "api"
    offenders = [
        p.name for p in sorted(api.glob("*.ts"))
        if p.name != "client.ts" and ("globalThis.fetch(" in p.read_text() or "interface " in p.read_text())
    ]
    assert offenders == []
