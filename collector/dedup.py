"""Deduplication at write time: the collector never writes a key it has written recently.

OTLP delivery is at-least-once, so the same span can reach the collector twice:

- an exporter retries a request whose acknowledgement it did not see (a timeout, a reset);
- a crash between a flush's Parquet commit and the deletion of its WAL segments replays
  those segments at the next start;
- a flush that failed half-way is retried with all of its rows.

The writer keeps the keys it wrote (``(trace_id, span_id)`` for spans, ``record_id`` for log
records) in :class:`RecentKeys` and drops a row whose key it holds, or that repeats within the
same flush (the first received wins). At start-up the keys are read back from the Parquet files
written within the window and from every file written since the oldest WAL segment left to
replay, so a replay after any downtime writes nothing twice. Compaction deduplicates the files
it merges. The store's views can then read the files without a deduplicating window, which is
what makes a group-by over a million spans take tens of milliseconds instead of hundreds.

What is remembered: at least the keys of the last ``window_s`` seconds, as long as fewer than
``max_keys / 2`` keys arrive in that time; past that rate, at least the last ``max_keys / 2``
keys. A copy re-sent later than that is written again, and is removed when compaction merges
both copies into one file.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from lightspan import store
from lightspan.store.files import partitions

log = logging.getLogger(__name__)

KEY_COLUMNS = {"spans": ("trace_id", "span_id"), "logs": ("record_id",)}


def row_keys(table_name: str, table: pa.Table) -> list:
    """The dedup key of every row: 24 bytes of ids for a span, the record id for a log record."""
    columns = KEY_COLUMNS[table_name]
    if len(columns) == 1:
        return table.column(columns[0]).to_pylist()
    joined = pc.binary_join_element_wise(*(table.column(c) for c in columns), "")
    return [bytes.fromhex(text) for text in joined.to_pylist()]


class RecentKeys:
    """Keys written recently, in two generations: the current one, and the one before it.

    A generation retires when it is ``window_s`` old or holds ``max_keys / 2`` keys; the one
    before it is then forgotten. Not thread-safe: the collector's writer (under its flush lock)
    is the only user.
    """

    def __init__(self, max_keys: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_keys, self.window_s, self._clock = max_keys, window_s, clock
        self._current: set = set()
        self._previous: set = set()
        self._since = clock()

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)

    def __contains__(self, key) -> bool:
        return key in self._current or key in self._previous

    def new_rows(self, keys: list) -> list[bool] | None:
        """Which rows to write: ``None`` when all of them (the common case, checked at C speed),
        else one flag per row: false for a key held already or seen earlier in ``keys``."""
        batch = set(keys)
        if len(batch) == len(keys) and self._current.isdisjoint(batch) and self._previous.isdisjoint(batch):
            return None
        seen: set = set()
        keep = []
        for key in keys:
            keep.append(key not in seen and key not in self)
            seen.add(key)
        return keep

    def add(self, keys: Iterable) -> None:
        """Remember keys just written."""
        half = max(self.max_keys // 2, 1)
        if self._clock() - self._since >= self.window_s or len(self._current) >= half:
            self._previous, self._current, self._since = self._current, set(), self._clock()
        self._current.update(keys)


def recent_files(where: store.Location, base: str, since_epoch_s: float) -> list[str]:
    """The keys of the Parquet files of the partitions under ``base`` written at ``since_epoch_s``
    or later (read back further by the location's clock slack: an object's time is the bucket's)."""
    since = since_epoch_s - where.mtime_slack_s
    return sorted(f"{base}/{partition}/{name}" for partition, entries in partitions(where, base).items()
                  for name, entry in entries.items()
                  if name.startswith("part-") and name.endswith(".parquet") and entry.mtime >= since)


def _connect(where: store.Location) -> duckdb.DuckDBPyConnection:
    """A one-thread connection that can read the files of ``where`` by name."""
    con = duckdb.connect()
    con.execute("SET threads = 1")
    where.register(con)
    return con


def _listing(where: store.Location, files: list[str]) -> str:
    return store.quote_list(str(where.name(f)) for f in files)


def load_keys(table_name: str, where: store.Location, files: list[str], *, received_since_ns: int = 0,
              limit: int | None = None) -> list:
    """The keys stored in ``files`` (keys of ``where``) of rows received at ``received_since_ns``
    or later, newest first, at most ``limit`` (read with DuckDB: only three columns are decoded)."""
    if not files:
        return []
    columns = ", ".join(KEY_COLUMNS[table_name])
    con = _connect(where)
    try:
        table = con.sql(
            f"SELECT {columns} FROM read_parquet({_listing(where, files)}, hive_partitioning=false, union_by_name=true) "
            f"WHERE received_unix_nano >= $since ORDER BY received_unix_nano DESC"
            + (f" LIMIT {int(limit)}" if limit is not None else ""), params={"since": received_since_ns}).to_arrow_table()
    finally:
        con.close()
    return row_keys(table_name, table)


def drop_stored(table_name: str, table: pa.Table, where: store.Location, files: list[str]) -> pa.Table:
    """``table`` without the rows whose key is in ``files`` (keys of ``where``; an anti-join in
    DuckDB, which spills to disk rather than hold a large file's keys in memory)."""
    if not files or not table.num_rows:
        return table
    columns = ", ".join(KEY_COLUMNS[table_name])
    con = _connect(where)
    try:
        con.register("batch", table)
        return con.sql(
            f"SELECT * FROM batch ANTI JOIN (SELECT {columns} FROM read_parquet({_listing(where, files)}, "
            f"hive_partitioning=false, union_by_name=true)) USING ({columns})").to_arrow_table().cast(table.schema)
    finally:
        con.close()


def replay_since(wal_segments: list[Path]) -> float:
    """From when Parquet may hold rows of ``wal_segments`` (left to replay): a second before the
    oldest one's last write, since a flush writes Parquet only after it closed the segment."""
    since = time.time()
    for segment in wal_segments:
        try:
            since = min(since, os.stat(segment).st_mtime - 1.0)
        except FileNotFoundError:
            continue
    return since
