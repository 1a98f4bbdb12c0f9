"""Compaction and retention of the collector's date partitions (DESIGN.md §3.2).

Each flush writes one file per date partition, so a day of ingest is thousands of small files
and every query pays to open them. :func:`compact_partition` merges the small files of one
partition into one, deduplicated on the table's key (as the view does: the first copy
received wins) and sorted by rollout and time, like every file the writer produces.

Readers never see a gap or an undeduplicated duplicate: the merged file is written under a
temporary name, fsynced and renamed into the partition *before* the files it replaces are
removed. In between (or forever, after a crash there) a reader sees both copies of each row,
and the views deduplicate them; the next compaction merges the leftovers. The collector
removes the replaced files only after a grace period (``COMPACT_GRACE_S`` in the server), so
a query that listed them just before the merge can still read them.

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

import duckdb

from lightspan.collector import store

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


def small_files(partition: Path) -> list[Path]:
    """The committed Parquet files of a partition under ``LARGE_FILE_BYTES`` (temp files excluded)."""
    files = []
    for path in partition.glob("part-*.parquet"):
        try:
            if path.stat().st_size < LARGE_FILE_BYTES:
                files.append(path)
        except FileNotFoundError:   # removed by a concurrent compaction or retention
            continue
    return sorted(files)


def compact_partition(table: str, partition: Path, files: list[Path], *, remove: bool = True) -> Path:
    """Merge ``files`` (of one partition of ``table``) into one new file, then remove them
    (``remove=False``: the caller removes them later, with :func:`remove_files`).

    Returns the new file. The merge runs in DuckDB, which spills to disk instead of holding a
    large partition in memory.
    """
    final = partition / f"part-{uuid.uuid4().hex}.parquet"
    tmp = partition / f".{final.name}.tmp"
    listing = ", ".join(_quote(str(f)) for f in files)
    con = duckdb.connect()
    try:
        con.execute("SET threads = 1")                     # leave the cores to the receivers
        con.execute(f"SET temp_directory = {_quote(str(partition.parent.parent / '.tmp'))}")
        con.execute(f"""
            COPY (SELECT * FROM read_parquet([{listing}], hive_partitioning=false, union_by_name=true)
                  QUALIFY {store.dedup_clause(table)}
                  ORDER BY {_SORT[table]})
            TO {_quote(str(tmp))} (FORMAT parquet, COMPRESSION zstd)""")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        con.close()
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    store.fsync_dir(partition)
    if remove:                                             # only now: readers never see a gap
        remove_files(files)
    return final


def remove_files(files: list[Path]) -> None:
    """Remove files replaced by a merged one (the views deduplicate them until then)."""
    for path in files:
        path.unlink(missing_ok=True)
    for directory in {path.parent for path in files}:
        if directory.is_dir():
            store.fsync_dir(directory)


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


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"

