"""Compaction and retention of the collector's date partitions (docs/architecture.md, "Storage").

Each flush writes one file per date partition, so a day of ingest is thousands of small files
and every query pays to open them. :func:`compact_partition` merges the small files of one
partition into one, deduplicated on the table's key (as the view does: the first copy
received wins) and sorted by rollout and time, like every file the writer produces.

Everything here works on keys of a :class:`~lightspan.store.Location` under ``base``, the tree of a
table this collector owns (``spans`` in its data directory; ``spans/collector=<id>`` in a bucket
that several collectors share, so none touches another's files: ``store.files.writer_tree``), and
is the same on disk and in a bucket. Readers never see a gap nor a duplicate, because each step is
ordered so that a reader's listing (``store.table_files``) is whole at every moment:

- the merged file is built first (in DuckDB, which spills to disk instead of holding a large
  partition in memory); then a note naming the files it replaces (``part-X.supersedes.json``, see
  ``store.SUPERSEDES_SUFFIX``) is put beside them: readers ignore a note whose merged file is
  absent; only then is the merged file put in place (``Location.put_file``: renamed into the
  partition on disk, uploaded whole in a bucket), the moment every reader's listing leaves the
  replaced files out. A merged file that could not be put whole leaves its note deleted and the
  replaced files live;
- :func:`sweep` removes the replaced files after a grace period, so a query that listed them
  before the merge still reads them, and the note last. A crash anywhere in between leaves a state
  that readers see whole and that the next sweep tidies;
- :func:`expire_partitions` deletes whole date partitions older than the retention limit, each
  out of every reader's listing at once (``Location.remove_tree``: renamed away on disk; in a
  bucket marked expired first, the marker deleted last).

Files of ``LARGE_FILE_BYTES`` or more are left alone: merging them again would rewrite the
whole day on every compaction. Compaction, the sweep and retention run one at a time (the writer's
compaction lock), and no other process writes under ``base``: one listing is whole for them.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import uuid
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import duckdb

from lightspan import store
from lightspan.store.files import EXPIRED_MARKER, live_names, partitions

log = logging.getLogger(__name__)

LARGE_FILE_BYTES = 128 << 20
_SORT = {"spans": "rollout_id, start_time_unix_nano", "logs": "rollout_id, time_unix_nano"}


def _merged_of(note: str) -> str:
    return note[: -len(store.SUPERSEDES_SUFFIX)] + ".parquet"


def _note_of(name: str) -> str:
    return name[: -len(".parquet")] + store.SUPERSEDES_SUFFIX


def small_files(where: store.Location | Path | str, base: str) -> dict[str, list[str]]:
    """Per partition (its key), the keys of its live Parquet files under ``LARGE_FILE_BYTES`` (those
    a merged file supersedes, and temporary files, excluded), from one listing of ``base``."""
    where = store.Location.of(where)
    found: dict[str, list[str]] = {}
    for partition, entries in partitions(where, base).items():
        prefix = f"{base}/{partition}"
        for name in live_names(tuple(sorted(entries)), lambda note: where.read_bytes(f"{prefix}/{note}")):
            if entries[name].size < LARGE_FILE_BYTES:
                found.setdefault(prefix, []).append(f"{prefix}/{name}")
    return {partition: sorted(files) for partition, files in sorted(found.items())}


def compact_partition(where: store.Location | Path | str, table: str, partition: str, files: list[str],
                      scratch: str | os.PathLike | None = None) -> str:
    """Merge ``files`` (keys in partition ``partition`` of ``table``) into one new file that
    supersedes them (they stay until :func:`sweep` removes them); returns its key. ``scratch``: a
    local directory for DuckDB's spill files (and, for a bucket, the merged file before its upload);
    the system's temporary directory when None."""
    where, scratch = store.Location.of(where), Path(scratch or tempfile.gettempdir())
    name = f"part-{uuid.uuid4().hex}"
    final, note = f"{partition}/{name}.parquet", f"{partition}/{name}{store.SUPERSEDES_SUFFIX}"
    superseded = superseded_names(where, partition, [f.rsplit("/", 1)[1] for f in files])
    con = duckdb.connect()
    try:
        con.execute("SET threads = 1")                     # leave the cores to the receivers
        con.execute(f"SET temp_directory = {store.quote(str(scratch / '.tmp'))}")
        where.register(con)
        listing = store.quote_list(str(where.name(f)) for f in files)
        with where.put_file(final, scratch) as tmp:        # readers switch to it when the block ends
            con.execute(f"""
                COPY (SELECT * FROM read_parquet({listing}, hive_partitioning=false, union_by_name=true)
                      QUALIFY {store.dedup_clause(table)}
                      ORDER BY {_SORT[table]})
                TO {store.quote(tmp)} (FORMAT parquet, COMPRESSION zstd)""")
            where.put_bytes(note, json.dumps({"files": superseded}).encode())   # before the merged file
    except BaseException:
        where.delete([note])                               # the replaced files stay live
        raise
    finally:
        con.close()
    return final


def superseded_names(where: store.Location | Path | str, partition: str, names: list[str]) -> list[str]:
    """``names`` and, for each merged file among them whose replaced files are still there, those
    files too (transitively): merging a merged file again supersedes what it superseded, so a sweep
    that removes it removes them as well."""
    where, found, todo = store.Location.of(where), set(), list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            todo += json.loads(where.read_bytes(f"{partition}/{_note_of(name)}"))["files"]
        except FileNotFoundError:
            continue
    return sorted(found)


def sweep(where: store.Location | Path | str, base: str, grace_s: float, now: float | None = None) -> int:
    """Remove the files that merged files superseded ``grace_s`` seconds ago or more, then their
    notes; a note whose merged file never appeared (a crash before it) goes alone. Returns the
    number of files removed."""
    where, now = store.Location.of(where), time.time() if now is None else now
    removed = 0
    for partition, entries in partitions(where, base).items():
        prefix, present = f"{base}/{partition}", set(entries)
        for note, entry in sorted(entries.items()):
            if not note.endswith(store.SUPERSEDES_SUFFIX) or now - entry.mtime < grace_s:
                continue
            try:
                if _merged_of(note) in present:
                    # a merged file merged again: its own note goes with it (its files are in this
                    # note too, see superseded_names)
                    gone = [n for n in json.loads(where.read_bytes(f"{prefix}/{note}"))["files"] if n in present]
                    gone_notes = [_note_of(n) for n in gone if _note_of(n) in present]
                    where.delete([f"{prefix}/{n}" for n in gone + gone_notes])
                    removed += len(gone)
                    present -= {*gone, *gone_notes}
                where.delete([f"{prefix}/{note}"])          # the files went first
                present.discard(note)
            except FileNotFoundError:
                continue
    return removed


def expire_partitions(where: store.Location | Path | str, base: str, retention_days: int, now: datetime | None = None) -> list[str]:
    """Delete the partitions ``date=…`` under ``base`` whose whole day ended ``retention_days`` or
    more ago. Returns their names (``date=…``). ``retention_days`` 0 keeps everything."""
    if retention_days <= 0:
        return []
    where, now = store.Location.of(where), now or datetime.now(timezone.utc)
    cutoff = now - timedelta(days=retention_days)
    removed = []
    for partition in partitions(where, base, stat=False):
        try:
            day = date.fromisoformat(partition[len("date="):]) if partition.startswith("date=") else None
        except ValueError:
            continue
        if day is None:
            continue
        if datetime(day.year, day.month, day.day, tzinfo=timezone.utc) + timedelta(days=1) > cutoff:
            continue
        where.remove_tree(f"{base}/{partition}", marker=EXPIRED_MARKER)
        removed.append(partition)
    return removed
