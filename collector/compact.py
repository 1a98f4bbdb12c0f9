"""Compaction and retention of the collector's date partitions (docs/architecture.md, "Storage").

Each flush writes one file per date partition, so a day of ingest is thousands of small files
and every query pays to open them. :func:`compact_partition` merges the small files of one
partition into one, deduplicated on the table's key (as the view does: the first copy
received wins) and sorted by rollout and time, like every file the writer produces.

Readers never see a gap nor a duplicate: the merged file is written under a temporary name and
fsynced; then a note naming the files it replaces (``part-X.supersedes.json``, see
``store.SUPERSEDES_SUFFIX``) is committed beside it; only then is the merged file renamed into
the partition. From that moment every reader's listing (``store.table_files``) leaves the
replaced files out. :func:`sweep` removes them after a grace period, so a query that listed
them before the merge still reads them, and the note last. A crash anywhere in between leaves
a state that readers see whole and that the next sweep tidies.

Files of ``LARGE_FILE_BYTES`` or more are left alone: merging them again would rewrite the
whole day on every compaction.

:func:`expire_partitions` deletes whole date partitions older than the retention limit: each
is renamed out of the table directory first (atomic: readers see all of it or none), then
removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import json
import time

import duckdb

from lightspan import store

log = logging.getLogger(__name__)

LARGE_FILE_BYTES = 128 << 20
_SORT = {"spans": "rollout_id, start_time_unix_nano", "logs": "rollout_id, time_unix_nano"}
_TRASH = ".trash"


def partitions(root: Path, table: str) -> list[Path]:
    """The ``date=YYYY-MM-DD`` directories of ``table``, oldest first."""
    base = root / table
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if p.is_dir() and p.name.startswith("date="))


def small_files(root: Path, table: str) -> dict[Path, list[Path]]:
    """Per partition, its live Parquet files under ``LARGE_FILE_BYTES`` (those a merged file
    supersedes, and temp files, excluded), from one listing of the table."""
    found: dict[Path, list[Path]] = {}
    for path in store.table_files(root, table):
        try:
            if path.stat().st_size < LARGE_FILE_BYTES:
                found.setdefault(path.parent, []).append(path)
        except FileNotFoundError:   # removed by a concurrent compaction or retention
            continue
    return {partition: sorted(files) for partition, files in sorted(found.items())}


def compact_partition(table: str, partition: Path, files: list[Path]) -> Path:
    """Merge ``files`` (of one partition of ``table``) into one new file that supersedes them
    (they stay on disk until :func:`sweep` removes them). Returns the new file.

    The merge runs in DuckDB, which spills to disk instead of holding a large partition in memory.
    """
    final = partition / f"part-{uuid.uuid4().hex}.parquet"
    tmp = partition / f".{final.name}.tmp"
    note = partition / (final.name[: -len(".parquet")] + store.SUPERSEDES_SUFFIX)
    note_tmp = partition / f".{note.name}.tmp"
    listing = ", ".join(store.quote(str(f)) for f in files)
    con = duckdb.connect()
    try:
        con.execute("SET threads = 1")                     # leave the cores to the receivers
        con.execute(f"SET temp_directory = {store.quote(str(partition.parent.parent / '.tmp'))}")
        con.execute(f"""
            COPY (SELECT * FROM read_parquet([{listing}], hive_partitioning=false, union_by_name=true)
                  QUALIFY {store.dedup_clause(table)}
                  ORDER BY {_SORT[table]})
            TO {store.quote(str(tmp))} (FORMAT parquet, COMPRESSION zstd)""")
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        with open(note_tmp, "w") as fh:
            json.dump({"files": superseded_names(partition, [f.name for f in files])}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(note_tmp, note)
        store.fsync_dir(partition)                         # the note is durable before the merged file
    except BaseException:
        tmp.unlink(missing_ok=True)
        note_tmp.unlink(missing_ok=True)
        note.unlink(missing_ok=True)
        raise
    finally:
        con.close()
    os.replace(tmp, final)                                 # readers switch to the merged file here
    store.fsync_dir(partition)
    return final


def superseded_names(partition: Path, names: list[str]) -> list[str]:
    """``names`` and, for each merged file among them whose replaced files are still on disk,
    those files too (transitively): merging a merged file again supersedes what it superseded,
    so a sweep that removes it removes them as well."""
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        note = partition / (name[: -len(".parquet")] + store.SUPERSEDES_SUFFIX)
        try:
            todo += json.loads(note.read_text())["files"]
        except FileNotFoundError:
            continue
    return sorted(found)


def sweep(root: Path, table: str, grace_s: float, now: float | None = None) -> int:
    """Remove the files that merged files superseded ``grace_s`` seconds ago or more, then their
    notes; a note whose merged file never appeared (a crash before it) goes alone. Returns the
    number of files removed."""
    now = time.time() if now is None else now
    removed = 0
    for partition in partitions(root, table):
        changed = False
        for note in sorted(partition.glob("part-*" + store.SUPERSEDES_SUFFIX)):
            try:
                if now - note.stat().st_mtime < grace_s:
                    continue
                merged = partition / (note.name[: -len(store.SUPERSEDES_SUFFIX)] + ".parquet")
                if merged.exists():
                    for name in json.loads(note.read_text())["files"]:
                        path = partition / name
                        if path.exists():
                            path.unlink()
                            removed += 1
                        # a merged file merged again: its own note goes with it (its files are
                        # in this note too, see superseded_names)
                        (partition / (name[: -len(".parquet")] + store.SUPERSEDES_SUFFIX)).unlink(missing_ok=True)
                    store.fsync_dir(partition)             # the files go before their note
                note.unlink()
                changed = True
            except FileNotFoundError:
                continue
        if changed:
            store.fsync_dir(partition)
    return removed


def expire_partitions(root: Path, table: str, retention_days: int, now: datetime | None = None) -> list[str]:
    """Delete the partitions of ``table`` whose whole day ended ``retention_days`` or more ago.

    Returns the names of the partitions removed. ``retention_days`` 0 keeps everything.
    """
    if retention_days <= 0:
        return []
    now = now or datetime.now(timezone.utc)
    cutoff = now - timedelta(days=retention_days)
    removed = []
    for partition in partitions(root, table):
        try:
            day = date.fromisoformat(partition.name[len("date="):])
        except ValueError:
            continue
        day_end = datetime(day.year, day.month, day.day, tzinfo=timezone.utc) + timedelta(days=1)
        if day_end > cutoff:
            break                                          # sorted: every later partition is newer
        trash = root / _TRASH / f"{table}-{partition.name}-{uuid.uuid4().hex}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partition, trash)                       # atomic: out of every reader's glob at once
        store.fsync_dir(partition.parent)
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(partition.name)
    return removed


