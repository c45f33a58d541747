from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import DateTime, MetaData, TypeDecorator
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.orm import DeclarativeBase

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect):  # noqa: ANN001
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect):  # noqa: ANN001
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Unlikely(FunctionElement):
    """A condition that holds for few rows of its table, said so to SQLite's planner
    (``unlikely(X)``); the condition as it is on other databases, whose statistics tell it. Once
    ANALYZE has run over a deep queue or a long history, SQLite's statistics give a job state
    value thousands of rows, and its planner scanned the whole jobs table for the few active
    jobs instead of searching ix_jobs_state_id (issue 12: 3 ms at 10,000 jobs, 17 ms at 50,000)."""

    name = "unlikely"  # (untyped, as ``func.unlikely``: a Boolean would compare it with 1 on SQLite)
    inherit_cache = True


@compiles(Unlikely)
def _condition(element: Unlikely, compiler, **kw) -> str:  # noqa: ANN001
    return compiler.process(element.clauses, **kw)


@compiles(Unlikely, "sqlite")
def _unlikely(element: Unlikely, compiler, **kw) -> str:  # noqa: ANN001
    return f"unlikely({compiler.process(element.clauses, **kw)})"
