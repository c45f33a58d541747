"""A hot statement run on the driver's cursor (issue 12, submissions on PostgreSQL).

A submission on PostgreSQL is one statement (services/jobs._one_statement). Measured on its own
(2,000 in a loop, ``time.process_time``): psycopg's execute and fetch of it 0.16 ms of CPU, the
same statement through SQLAlchemy's ``Connection.execute`` 0.29-0.30 ms (the compiled cache's
look-up, the execution context, the result object and its row processing of ~50 columns). The
statement is still built and compiled by SQLAlchemy, once per dialect, and its parameters go
through SQLAlchemy's own bind processors; only the execution skips the per-call machinery. What
that machinery does besides, this keeps: a driver error is raised as SQLAlchemy raises it
(``IntegrityError``, ``OperationalError``; a disconnect invalidates the pool, as the API's 503
expects), through the connection's own handler; the statement runs on the connection of the
caller's session, so inside its transaction (or in autocommit when the session asked for it)."""

from __future__ import annotations

import collections
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.sql import ClauseElement
from sqlalchemy.types import TypeEngine


class DirectStatement:
    """``statement`` compiled once per dialect; ``one(conn, params)`` runs it on ``conn``'s
    driver cursor and returns its first row as a named tuple, each column converted by the
    result processor of its type in ``types`` (name -> type; a column not named there is
    returned as the driver gives it)."""

    def __init__(self, statement: ClauseElement, types: dict[str, TypeEngine]) -> None:
        self.statement = statement
        self.types = types
        self._compiled: dict[Any, tuple[Any, str, dict]] = {}
        # by dialect: the row's type and result processors, from the first execution's description
        # (psycopg builds the description's objects anew on every access: ~5% of a submission)
        self._rows: dict[Any, tuple[type, list[tuple[int, Any]]]] = {}

    def _for(self, dialect) -> tuple[Any, str, dict]:  # noqa: ANN001
        entry = self._compiled.get(dialect)
        if entry is None:
            compiled = self.statement.compile(dialect=dialect)
            # the processors SQLAlchemy's own execution applies to these parameters
            entry = (compiled, str(compiled), dict(compiled._bind_processors))
            self._compiled[dialect] = entry
        return entry

    def _row_type(self, dialect, cursor) -> tuple[type, list[tuple[int, Any]]]:  # noqa: ANN001
        entry = self._rows.get(dialect)
        if entry is None:
            names = tuple(d.name for d in cursor.description)
            processors = []
            for i, name in enumerate(names):
                t = self.types.get(name)
                p = t.result_processor(dialect, None) if t is not None else None
                if p is not None:
                    processors.append((i, p))
            entry = (collections.namedtuple("DirectRow", names), processors)
            self._rows[dialect] = entry
        return entry

    def one(self, conn: Connection, params: dict) -> Any:  # noqa: ANN401 - a named tuple of the statement's columns
        compiled, sql, processors = self._for(conn.dialect)
        values = compiled.construct_params(params)
        for name, process in processors.items():
            if name in values:
                values[name] = process(values[name])
        cursor = conn.connection.dbapi_connection.cursor()
        try:
            cursor.execute(sql, values)
            raw = cursor.fetchone()
            row_type, result_processors = self._row_type(conn.dialect, cursor)
        except Exception as exc:  # noqa: BLE001 - translated (and the pool invalidated on a disconnect) as SQLAlchemy does
            conn._handle_dbapi_exception(exc, sql, values, cursor, None)
        finally:
            cursor.close()
        if raw is None:
            raise LookupError("the statement returned no row")
        if result_processors:
            raw = list(raw)
            for i, process in result_processors:
                raw[i] = process(raw[i])
        return row_type._make(raw)
