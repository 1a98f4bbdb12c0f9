"""Where the collector's writer puts Parquet: its data directory, or its prefix in a bucket.

The writer (lightspan.collector.writer) asks one of two objects with the same methods to write a
partition's file, list the files written lately (dedup), merge small files, sweep what merged files
replaced, and expire old partitions:

- :class:`Directory` — the data directory, as lightspan.collector.compact and .dedup do it
  (temporary names and renames, fsynced);
- :class:`Bucket` — ``s3://bucket/prefix`` (lightspan.store.objects), where this collector owns
  ``TABLE/collector=<id>/`` and nothing else, so collectors sharing a bucket never touch each
  other's objects. An object is written in one request and never renamed; each step is ordered
  so that a reader's listing (``store.table_files``) is whole at every moment:

  - compaction writes the note ``part-X.supersedes.json`` first (readers ignore a note whose
    merged file is absent), then ``part-X.parquet`` (the moment readers switch to it, the role the
    rename has on disk); the merged file is built on local disk first, uploaded whole and its size
    checked, and a merged object that is not whole is deleted before anything else happens;
  - the sweep deletes superseded files after the grace period, then the note;
  - retention writes the partition's ``.expired`` marker first (readers then skip the whole
    partition), deletes its files, the marker last.

The WAL is never in the bucket: a flush's segments are deleted only after its objects are written.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import tempfile
import time
import uuid
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.fs as pafs

from lightspan import store
from lightspan.collector import compact as compaction
from lightspan.collector import dedup
from lightspan.core.config import ConfigError
from lightspan.store import objects
from lightspan.store.files import EXPIRED_MARKER, live_names, remote_entries

log = logging.getLogger(__name__)

CLOCK_SKEW_S = 300.0
"""An object's time is the bucket's clock, not ours: "written since T" reads back this much more."""


_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST}


def writable(directory: Path, field: str) -> None:
    """Make ``directory`` if need be and write (then remove) a file in it: at start-up, before
    anything is written, a directory the collector cannot write to is one ConfigError naming it and
    ``collector.<field>``, not a traceback from the first write. Other errors (a full disk) pass:
    they are answered where they happen (503)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        if exc.errno not in _NOT_WRITABLE:
            raise
        env = f"LIGHTSPAN_COLLECTOR_{field.upper()}"
        raise ConfigError("collector", field, f"the collector cannot write to {directory} ({exc.strerror or exc})",
                          f"make {directory} writable for the collector's user (chown/chmod, or mount it read-write), "
                          f"or set collector.{field} ({env}, --{field.replace('_', '-')}) to a writable directory"
                          ) from None


class Directory:
    """The data directory (one collector's own)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def describe(self) -> str:
        return str(self.root)

    def check(self) -> None:
        """Nothing to reach: the directory must be writable (:func:`writable`)."""
        writable(self.root, "data_dir")

    def write(self, table: str, part: pa.Table, day: str) -> None:
        store.write_table(self.root, table, part, partition=f"date={day}")

    def recent_files(self, table: str, since_epoch_s: float) -> list:
        return dedup.recent_files(self.root, table, since_epoch_s)

    def small_files(self, table: str) -> dict:
        return compaction.small_files(self.root, table)

    def compact_partition(self, table: str, partition, files: list) -> None:
        compaction.compact_partition(table, partition, files)

    def sweep(self, table: str, grace_s: float) -> int:
        return compaction.sweep(self.root, table, grace_s)

    def expire(self, table: str, retention_days: int) -> list[str]:
        return compaction.expire_partitions(self.root, table, retention_days)


class Bucket:
    """``TABLE/collector=<collector_id>/`` under ``s3://bucket/prefix``; ``scratch`` is a local
    directory for merged files before their upload (beside the WAL)."""

    def __init__(self, location: str, collector_id: str, scratch: Path):
        self.location, self.collector_id, self.scratch = location.rstrip("/"), collector_id, Path(scratch)

    def describe(self) -> str:
        return f"{self.location} (as collector={self.collector_id})"

    def base(self, table: str) -> str:
        return f"{self.location}/{table}/collector={self.collector_id}"

    def check(self) -> None:
        """Fail at start-up, naming the bucket, when it cannot be reached."""
        objects.check(self.location)

    def write(self, table: str, part: pa.Table, day: str) -> None:
        store.write_table(self.location, table, part, partition=f"collector={self.collector_id}/date={day}")

    def _entries(self, table: str) -> dict[str, dict[str, objects.Entry]]:
        return remote_entries(self.base(table))

    def recent_files(self, table: str, since_epoch_s: float) -> list[str]:
        since = since_epoch_s - CLOCK_SKEW_S
        return sorted(e.url for entries in self._entries(table).values() for name, e in entries.items()
                      if name.startswith("part-") and name.endswith(".parquet") and e.mtime >= since)

    def small_files(self, table: str) -> dict[str, list[str]]:
        """Per partition, its live files under ``LARGE_FILE_BYTES``."""
        found: dict[str, list[str]] = {}
        for partition, entries in self._entries(table).items():
            prefix = f"{self.base(table)}/{partition}"
            # one listing is whole here: this collector is the only writer of its prefix, and its
            # compaction, sweep and retention run one at a time (the writer's compaction lock)
            for name in live_names(tuple(sorted(entries)), lambda note: objects.read_bytes(f"{prefix}/{note}")):
                if entries[name].size < compaction.LARGE_FILE_BYTES:
                    found.setdefault(prefix, []).append(entries[name].url)
        return {p: sorted(f) for p, f in sorted(found.items())}

    def compact_partition(self, table: str, partition: str, files: list[str]) -> str:
        """Merge ``files`` into one object that supersedes them (see the module docstring)."""
        self.scratch.mkdir(parents=True, exist_ok=True)
        name = f"part-{uuid.uuid4().hex}"
        final, note = f"{partition}/{name}.parquet", f"{partition}/{name}{store.SUPERSEDES_SUFFIX}"
        names = [f.rsplit("/", 1)[1] for f in files]
        superseded = self._superseded_names(partition, names)
        fd, tmp = tempfile.mkstemp(prefix=".merge-", suffix=".parquet", dir=self.scratch)
        os.close(fd)
        con = duckdb.connect()
        try:
            con.execute("SET threads = 1")
            con.execute(f"SET temp_directory = {store.quote(str(self.scratch / '.tmp'))}")
            objects.register(con)
            con.execute(f"""
                COPY (SELECT * FROM read_parquet({store.quote_list(files)}, hive_partitioning=false, union_by_name=true)
                      QUALIFY {store.dedup_clause(table)}
                      ORDER BY {compaction._SORT[table]})
                TO {store.quote(tmp)} (FORMAT parquet, COMPRESSION zstd)""")
            objects.put_bytes(note, json.dumps({"files": superseded}).encode())
            size = os.path.getsize(tmp)
            try:
                pafs.copy_files(tmp, objects.path_of(final), destination_filesystem=objects.filesystem())
                uploaded = objects.filesystem().get_file_info(objects.path_of(final)).size
                if uploaded != size:
                    raise OSError(f"{final}: {uploaded} bytes uploaded of {size}")
            except BaseException:
                objects.delete([final, note])         # the replaced files stay live
                raise
        finally:
            con.close()
            Path(tmp).unlink(missing_ok=True)
        return final

    def _superseded_names(self, partition: str, names: list[str]) -> list[str]:
        """As compact.superseded_names: a merged file merged again brings what it superseded."""
        found, todo = set(), list(names)
        while todo:
            name = todo.pop()
            if name in found:
                continue
            found.add(name)
            try:
                note = objects.read_bytes(f"{partition}/{name[: -len('.parquet')]}{store.SUPERSEDES_SUFFIX}")
            except FileNotFoundError:
                continue
            todo += json.loads(note)["files"]
        return sorted(found)

    def sweep(self, table: str, grace_s: float, now: float | None = None) -> int:
        """Delete the files merged files superseded ``grace_s`` ago or more, then their notes."""
        now = time.time() if now is None else now
        removed = 0
        for partition, entries in self._entries(table).items():
            prefix = f"{self.base(table)}/{partition}"
            for name, entry in sorted(entries.items()):
                if not name.endswith(store.SUPERSEDES_SUFFIX) or now - entry.mtime < grace_s:
                    continue
                merged = name[: -len(store.SUPERSEDES_SUFFIX)] + ".parquet"
                try:
                    if merged in entries:
                        gone = json.loads(objects.read_bytes(entry.url))["files"]
                        objects.delete([f"{prefix}/{n}" for n in gone if n in entries])
                        objects.delete([f"{prefix}/{n[: -len('.parquet')]}{store.SUPERSEDES_SUFFIX}" for n in gone
                                        if f"{n[: -len('.parquet')]}{store.SUPERSEDES_SUFFIX}" in entries])
                        removed += sum(n in entries for n in gone)
                    objects.delete([entry.url])                 # the files went first
                except FileNotFoundError:
                    continue
        return removed

    def expire(self, table: str, retention_days: int, now: datetime | None = None) -> list[str]:
        """Delete this collector's partitions whose day ended ``retention_days`` ago or more."""
        if retention_days <= 0:
            return []
        now = now or datetime.now(timezone.utc)
        cutoff = now - timedelta(days=retention_days)
        removed = []
        for partition, entries in self._entries(table).items():
            try:
                day = date.fromisoformat(partition[len("date="):])
            except ValueError:
                continue
            if datetime(day.year, day.month, day.day, tzinfo=timezone.utc) + timedelta(days=1) > cutoff:
                continue
            marker = f"{self.base(table)}/{partition}/{EXPIRED_MARKER}"
            objects.put_bytes(marker, b"")                      # readers skip the partition from here
            objects.delete([e.url for n, e in entries.items() if n != EXPIRED_MARKER])
            objects.delete([marker])
            removed.append(partition)
        return removed
