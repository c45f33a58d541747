"""Real PostgreSQL and Redis. `make test` exports HAI_TEST_DATABASE_URL / HAI_TEST_REDIS_URL
(scripts/test-services.sh); each test module gets its own fresh database on that server."""

from __future__ import annotations

import os
import uuid

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

DEFAULT_DB = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def server_db_url() -> str:
    return os.environ.get("HAI_TEST_DATABASE_URL") or DEFAULT_DB


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = os.environ.get("HAI_TEST_REDIS_URL") or DEFAULT_REDIS
    redis.Redis.from_url(url).ping()  # fail loudly if the configured Redis is not there
    return url


def _fresh_database(server_db_url: str):  # noqa: ANN202
    """Yield the URL of a new, empty database on the server of ``server_db_url``; drop it after."""
    name = f"hai_it_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server_db_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield make_url(server_db_url).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def pg_url(server_db_url: str):
    """A fresh, empty PostgreSQL database for one test; dropped afterwards."""
    yield from _fresh_database(server_db_url)


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request, tmp_path):  # noqa: ANN001, ANN201
    """A session factory on a migrated database, once SQLite and once PostgreSQL."""
    from hai.db.migrate import upgrade
    from sqlalchemy.orm import sessionmaker

    url = f"sqlite:///{tmp_path / 'hai.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    upgrade(url)
    engine = create_engine(url)
    yield sessionmaker(engine, expire_on_commit=False)
    engine.dispose()


@pytest.fixture
def second_pg_url(server_db_url: str):
    """Another fresh database beside ``pg_url`` (two platforms compared side by side)."""
    yield from _fresh_database(server_db_url)


@pytest.fixture
def replicas(pg_url: str, redis_url: str, tmp_path):  # noqa: ANN001, ANN201
    """``replicas(n, **settings)``: n platforms on one migrated PostgreSQL database and one Redis,
    standing for n processes (API replicas, the scheduler); closed after the test."""
    from hai.db.migrate import upgrade
    from hai.services.context import Platform
    from hai.settings import Settings

    made = []

    def make(n: int, **settings):  # noqa: ANN003, ANN202
        upgrade(pg_url)
        for i in range(n):
            s = Settings(data_dir=tmp_path / f"replica{len(made)}", frontend_dist=tmp_path / "none",
                         db={"url": pg_url}, redis={"url": redis_url}, **settings)
            made.append(Platform.from_settings(s))
        return made[-n:]

    yield make
    for p in made:
        p.close()


@pytest.fixture
def pg_platform(pg_url, tmp_path):
    """The platform on a fresh PostgreSQL database, migrated, without Redis; nodes are not found
    lost while a test pauses (``lost_after_s`` an hour)."""
    from hai.db.migrate import upgrade
    from hai.services.context import Platform
    from hai.settings import Settings

    upgrade(pg_url)
    settings = Settings(data_dir=tmp_path, db={"url": pg_url}, frontend_dist=tmp_path / "none",
                        agent={"lost_after_s": 3600})
    p = Platform.from_settings(settings)
    yield p
    p.close()


@pytest.fixture
def pg_api(pg_platform):
    """The app on ``pg_platform`` behind a test client, with the test users (tests.conftest.Api)."""
    from fastapi.testclient import TestClient

    from hai.main import create_app
    from tests.conftest import Api

    with TestClient(create_app(pg_platform)) as client:
        yield Api(client, pg_platform)
