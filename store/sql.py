"""Read-only SQL over the store's views, as every reader outside the collector's ingest runs it:
a DuckDB connection whose external access is off and locked (:func:`sql_connection`), a time limit
that interrupts a query (:func:`time_limit`), and DuckDB values as JSON (:func:`jsonable`).

The collector's ``/v1/sql``, the web UI's queries and the benchmarks open their connections here.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import math
import threading
from pathlib import Path

import duckdb

from lightspan.store.location import Location
from lightspan.store.schema import TABLES
from lightspan.store.views import connect, quote

SQL_THREADS = 2
SQL_MEMORY_LIMIT = 512 << 20


def sql_connection(data_dir: str | Path, memory_limit: int = SQL_MEMORY_LIMIT) -> duckdb.DuckDBPyConnection:
    """A connection with the store's views whose external access is off and locked, with
    ``memory_limit`` bytes for DuckDB's buffers and no spilling to disk."""
    where = Location.of(data_dir).resolved()
    con = connect(where)         # the views read the data location's Parquet files...
    try:
        con.execute(f"SET memory_limit = '{int(memory_limit)}B'")
        con.execute(f"SET threads = {SQL_THREADS}")
        # no spilling: DuckDB lets a connection read its temp directory (default ``.tmp`` in the
        # working directory) whatever allowed_directories says, so a query could read files there
        con.execute("SET temp_directory = ''")
        allowed = ", ".join(quote(f"{where.name(table)}/") for table in TABLES)
        con.execute(f"SET allowed_directories = [{allowed}]")   # ...and nothing else, once this is off:
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")            # a query cannot SET it back
    except BaseException:
        con.close()
        raise
    return con


class Deadline:
    """A timer that interrupts ``con``'s running query after ``timeout_s`` once started."""

    def __init__(self, con: duckdb.DuckDBPyConnection, timeout_s: float):
        self._con = con
        self._fired = threading.Event()
        self._timer = threading.Timer(timeout_s, self._interrupt)
        self._timer.daemon = True

    def _interrupt(self) -> None:
        self._fired.set()
        try:
            self._con.interrupt()
        except duckdb.Error:   # the query finished and the connection closed meanwhile
            pass

    def start(self) -> None:
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()

    def is_set(self) -> bool:
        """Whether the time ran out (and the query was interrupted)."""
        return self._fired.is_set()


@contextlib.contextmanager
def time_limit(con: duckdb.DuckDBPyConnection, timeout_s: float, *, start: bool = False):
    """A :class:`Deadline` on ``con``, started now with ``start`` (else by ``.start()``), cancelled on exit."""
    deadline = Deadline(con, timeout_s)
    if start:
        deadline.start()
    try:
        yield deadline
    finally:
        deadline.cancel()


def jsonable(value):
    """A DuckDB (or pyarrow ``to_pylist``) value as a strict-JSON one, the one conversion every reader
    that answers JSON uses (``/v1/sql``, the web UI's API, ``lightspan export`` and ``lightspan sql``):

    - a non-finite float (NaN, ±inf) is ``None`` (JSON ``null``): JSON has no NaN, ``null`` is what a
      browser's ``JSON.stringify`` writes for it and what the UI's charts draw as a gap; a query that
      must tell NaN from NULL asks DuckDB (``isnan(x)``, ``isinf(x)``);
    - bytes (a BLOB) are base64 text;
    - maps are objects with string keys, lists and structs stay lists and objects;
    - dates and times are ISO 8601 text, intervals seconds, decimals and UUIDs text, anything else ``str``.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    return str(value)        # decimal.Decimal, uuid.UUID, and whatever else DuckDB gives
