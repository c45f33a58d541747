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
caller's session, so inside its transaction (begun: a Session's connection is; or in autocommit
when the session asked for it).

The same holds on SQLite (positional parameters, in the compiled statement's order), where a
single submission is up to five statements in a transaction (the key's look-up, the admission's
figures, the job, its event, its key): through ``Connection.execute`` SQLAlchemy's per-execute
work was 29% of a submission's instructions in process (benchmarks/submit_inprocess.py).

``first_on`` runs the statement on an asyncio driver connection outside any SQLAlchemy connection
(``hai.db.session.LoopStatements``: a PostgreSQL submission written on the event loop without a
Session, its pool checkout and greenlet hops; 0.49 -> 0.28 ms of CPU in process,
benchmarks/submit_inprocess.py --postgresql --loop); a driver error
is raised as SQLAlchemy's exception (``DBAPIError.instance``), ``connection_invalidated`` where
the dialect calls it a disconnect."""

from __future__ import annotations

import collections
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import ClauseElement
from sqlalchemy.types import TypeEngine


class DirectStatement:
    """``statement`` compiled once per dialect; ``first(conn, params)`` (or ``one``) runs it on
    ``conn``'s driver cursor and returns its first row as a named tuple, each column converted by
    the result processor of its type in ``types`` (name -> type; a column not named there is
    returned as the driver gives it); ``run`` runs one that returns no rows."""

    def __init__(self, statement: ClauseElement, types: dict[str, TypeEngine]) -> None:
        self.statement = statement
        self.types = types
        self._compiled: dict[Any, tuple[Any, str, dict, tuple | None]] = {}
        # by dialect: the row's type and result processors, from the first execution's description
        # (psycopg builds the description's objects anew on every access: ~5% of a submission)
        self._rows: dict[Any, tuple[type, list[tuple[int, Any]]]] = {}

    def _for(self, dialect) -> tuple[Any, str, dict, tuple | None]:  # noqa: ANN001
        entry = self._compiled.get(dialect)
        if entry is None:
            compiled = self.statement.compile(dialect=dialect)
            # the processors SQLAlchemy's own execution applies to these parameters
            order = tuple(compiled.positiontup) if compiled.positional else None  # (SQLite: qmark)
            entry = (compiled, str(compiled), dict(compiled._bind_processors), order)
            self._compiled[dialect] = entry
        return entry

    def _row_type(self, dialect, cursor) -> tuple[type, list[tuple[int, Any]]]:  # noqa: ANN001
        entry = self._rows.get(dialect)
        if entry is None:
            description = [(d[0], d[1]) for d in cursor.description]  # (psycopg: a Column; sqlite3: a tuple)
            names = tuple(name for name, _ in description)
            processors = []
            for i, (name, type_code) in enumerate(description):
                t = self.types.get(name)
                # the dialect's own implementation's processor for the driver's type code (SQLite's
                # DATETIME parses its text; psycopg's numerics), as SQLAlchemy's execution asks it
                p = t._cached_result_processor(dialect, type_code) if t is not None else None
                if p is not None:
                    processors.append((i, p))
            entry = (collections.namedtuple("DirectRow", names), processors)
            self._rows[dialect] = entry
        return entry

    def _values(self, dialect, params: dict) -> tuple[str, Any]:  # noqa: ANN001
        compiled, sql, processors, order = self._for(dialect)
        values = compiled.construct_params(params)
        for name, process in processors.items():
            if name in values:
                values[name] = process(values[name])
        return sql, values if order is None else tuple(values[name] for name in order)

    def _execute(self, conn: Connection, params: dict, fetch: bool) -> tuple[Any, Any, int]:
        """The statement run on ``conn``'s driver cursor: (its first row, raw, or None; that row's
        type and result processors, or None; the cursor's row count); a driver error translated as
        SQLAlchemy translates it."""
        sql, values = self._values(conn.dialect, params)
        cursor = conn.connection.dbapi_connection.cursor()
        try:
            cursor.execute(sql, values)
            raw = cursor.fetchone() if fetch else None
            shape = self._row_type(conn.dialect, cursor) if raw is not None else None
            return raw, shape, cursor.rowcount
        except Exception as exc:  # noqa: BLE001 - translated (and the pool invalidated on a disconnect) as SQLAlchemy does
            conn._handle_dbapi_exception(exc, sql, values, cursor, None)
            raise  # (not reached: the handler raises)
        finally:
            cursor.close()

    def first(self, conn: Connection, params: dict) -> Any:  # noqa: ANN401 - a named tuple of the statement's columns
        """Its first row, or None when it returned none."""
        raw, shape, _ = self._execute(conn, params, fetch=True)
        return self._row(raw, shape)

    async def first_on(self, dialect, driver_connection, params: dict) -> Any:  # noqa: ANN001, ANN401
        """``first`` on ``driver_connection``, an asyncio connection of ``dialect``'s driver
        (psycopg's ``AsyncConnection``) that no SQLAlchemy connection wraps: in whatever
        transaction state it is (autocommit: the statement commits itself)."""
        sql, values = self._values(dialect, params)
        cursor = driver_connection.cursor()
        try:
            await cursor.execute(sql, values)
            return await self._first_of(dialect, cursor)
        except dialect.loaded_dbapi.Error as exc:
            raise translated(dialect, exc, driver_connection, cursor, sql, values) from exc
        finally:
            await cursor.close()

    async def _first_of(self, dialect, cursor) -> Any:  # noqa: ANN001, ANN401
        """The first row of ``cursor``'s result (awaited: an asyncio cursor), converted, or None."""
        raw = await cursor.fetchone()
        return self._row(raw, self._row_type(dialect, cursor) if raw is not None else None)

    @staticmethod
    async def firsts_in_transaction_on(dialect, driver_connection, runs: list[tuple[DirectStatement, dict]]) -> list:  # noqa: ANN001
        """Each ``(statement, params)`` of ``runs`` in order on ``driver_connection`` (as
        ``first_on``), all in one transaction, pipelined (psycopg's pipeline mode: BEGIN, the
        statements and COMMIT sent together, their results read after): the first row of each, or
        None. A statement that fails rolls the transaction back (nothing of ``runs`` is written);
        its driver error is raised as SQLAlchemy raises it, as ``first_on`` raises it."""
        sent = [(statement, *statement._values(dialect, params)) for statement, params in runs]
        cursors = [driver_connection.cursor() for _ in sent]
        sql, values = "", None  # the statement sent or read last (a failure's message names it)
        try:
            async with driver_connection.pipeline():
                async with driver_connection.transaction():
                    for (_, sql, values), cursor in zip(sent, cursors):
                        await cursor.execute(sql, values)
                rows = []
                for (statement, sql, values), cursor in zip(sent, cursors):
                    rows.append(await statement._first_of(dialect, cursor))
        except dialect.loaded_dbapi.Error as exc:
            raise translated(dialect, exc, driver_connection, None, sql, values) from exc
        finally:
            for cursor in cursors:
                await cursor.close()
        return rows

    @staticmethod
    def _row(raw, shape) -> Any:  # noqa: ANN001, ANN401
        if raw is None:
            return None
        row_type, result_processors = shape
        if result_processors:
            raw = list(raw)
            for i, process in result_processors:
                raw[i] = process(raw[i])
        return row_type._make(raw)

    def one(self, conn: Connection, params: dict) -> Any:  # noqa: ANN401 - a named tuple of the statement's columns
        """Its first row; LookupError when it returned none."""
        row = self.first(conn, params)
        if row is None:
            raise LookupError("the statement returned no row")
        return row

    def run(self, conn: Connection, params: dict) -> int:
        """A statement that returns no rows (an INSERT without RETURNING): the rows it wrote."""
        return self._execute(conn, params, fetch=False)[2]


def translated(dialect, exc: Exception, driver_connection=None, cursor=None, sql: str | None = None,  # noqa: ANN001
               values=None) -> DBAPIError:  # noqa: ANN001
    """A driver error on a connection no SQLAlchemy connection wraps (or raised taking one from
    the raw pool: ``driver_connection`` None), as SQLAlchemy raises it (IntegrityError,
    OperationalError, ...), marked ``connection_invalidated`` where the dialect calls it a
    disconnect."""
    lost = dialect.is_disconnect(exc, driver_connection, cursor)
    return DBAPIError.instance(sql, values, exc, dialect.loaded_dbapi.Error, dialect=dialect,
                               connection_invalidated=lost)
