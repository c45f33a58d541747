"""Run Alembic migrations from code (hai dev, hai migrate, tests)."""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config


def alembic_ini() -> Path:
    env = os.environ.get("HAI_ALEMBIC_INI")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "alembic.ini"


def upgrade(url: str, revision: str = "head") -> None:
    cfg = Config(str(alembic_ini()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.upgrade(cfg, revision)


def downgrade(url: str, revision: str = "base") -> None:
    cfg = Config(str(alembic_ini()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.downgrade(cfg, revision)
