"""Run Alembic migrations from code (hai dev, hai migrate, tests).

Where the Alembic configuration is, in order: ``HAI_ALEMBIC_INI``; the copy an installed package
carries (``hai/_shipped/alembic.ini`` with ``migrations/`` beside it, put there by the build, see
backend/setup.py); the repository's ``alembic.ini`` (an editable install, a source checkout).
``python -m hai.db.migrate`` prints the path, for ``alembic -c "$(python -m hai.db.migrate)" ...``.
"""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import make_url

_PACKAGE = Path(__file__).resolve().parents[1]  # .../hai


class AlembicTreeMissing(RuntimeError):
    pass


def alembic_ini() -> Path:
    env = os.environ.get("HAI_ALEMBIC_INI")
    if env:
        return Path(env)
    candidates = [_PACKAGE / "_shipped" / "alembic.ini", _PACKAGE.parents[1] / "alembic.ini"]
    for ini in candidates:
        if ini.is_file() and (ini.parent / "migrations" / "env.py").is_file():
            return ini
    raise AlembicTreeMissing(
        "no Alembic environment found (looked for " + ", ".join(str(c) for c in candidates)
        + "); reinstall the package from a wheel built from the repository, or set HAI_ALEMBIC_INI"
    )


def _config(url: str) -> Config:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)  # embedded mode: a fresh data dir
    cfg = Config(str(alembic_ini()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(_config(url), revision)


if __name__ == "__main__":  # pragma: no cover
    print(alembic_ini())
