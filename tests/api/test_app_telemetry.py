"""FastAPI's native OpenTelemetry follows ``HAI_HTTP__OPENTELEMETRY`` (issue 12): off by default,
where FastAPI would otherwise look OpenTelemetry's global providers up on every request (each
look-up reading the environment: ~5% of a submission's server CPU); on, it does, and a provider
configured in the process would get the requests' spans."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from opentelemetry import trace

from hai.main import create_app
from hai.services.context import Platform
from hai.settings import Settings


@pytest.mark.parametrize("on", [False, True])
def test_fastapi_looks_the_tracer_provider_up_only_when_telemetry_is_on(tmp_path, monkeypatch, on):
    platform = Platform.from_settings(Settings(data_dir=tmp_path / "hai", frontend_dist=tmp_path / "none",
                                               http={"opentelemetry": on}))
    real, looked = trace.get_tracer_provider, []

    def counted():  # noqa: ANN202
        looked.append(1)
        return real()

    try:
        with TestClient(create_app(platform)) as client:
            monkeypatch.setattr(trace, "get_tracer_provider", counted)
            for _ in range(3):
                assert client.get("/healthz").status_code == 200
    finally:
        platform.close()
    assert (len(looked) >= 3) if on else (looked == [])
