"""The API's answer when the database is away (issue 13) whatever raised it: SQLAlchemy's errors
and the driver's own, should one reach a route untranslated (``db.session.LoopStatements`` once
let psycopg's through and the API answered 500 while PostgreSQL was down). A query's bug stays a
500."""

from __future__ import annotations

import logging

import psycopg
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.exc import IntegrityError, OperationalError

from hai.api import errors

RAISED = {
    "sqlalchemy-operational": lambda: OperationalError("SELECT 1", {}, Exception("connection refused")),
    "driver-operational": lambda: psycopg.OperationalError(
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: Connection refused'),
    "driver-admin-shutdown": lambda: psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
    "sqlalchemy-integrity": lambda: IntegrityError("INSERT", {}, Exception("duplicate key")),
    "driver-integrity": lambda: psycopg.errors.UniqueViolation("duplicate key value violates unique constraint"),
}


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    errors.install(app)

    @app.post("/raise/{name}")
    def _raise(name: str) -> None:
        raise RAISED[name]()

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("name", ["sqlalchemy-operational", "driver-operational", "driver-admin-shutdown"])
def test_the_database_away_is_a_503_with_retry_after(client, name: str, caplog) -> None:  # noqa: ANN001
    with caplog.at_level(logging.WARNING, logger="hai.api.errors"):
        r = client.post(f"/raise/{name}")
    assert r.status_code == 503, r.text
    assert r.json() == {"detail": errors.DB_UNAVAILABLE}
    assert r.headers["retry-after"] == str(errors.DB_RETRY_AFTER_S)
    untranslated = [rec for rec in caplog.records if "untranslated" in rec.getMessage()]
    # the driver's own error is also logged as the bug it is (the path that let it through)
    assert bool(untranslated) == name.startswith("driver"), [rec.getMessage() for rec in caplog.records]


@pytest.mark.parametrize("name", ["sqlalchemy-integrity", "driver-integrity"])
def test_a_querys_error_stays_a_500(client, name: str) -> None:  # noqa: ANN001
    r = client.post(f"/raise/{name}")
    assert r.status_code == 500
    assert not errors.database_unavailable(RAISED[name]())
