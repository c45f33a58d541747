"""The frontend's client is generated from frontend/openapi.json: it must be the server's schema."""

from __future__ import annotations

import json
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
