"""The store's files: which Parquet files hold a table's rows, and writing one atomically.

A partitioned table (``spans``, ``logs``) is ``TABLE/date=YYYY-MM-DD/part-*.parquet``, or
``TABLE/collector=N/date=…/part-*.parquet`` in a bucket several collectors share (each owns its
tree, :func:`writer_tree`); compaction replaces files by a merged one and leaves a note naming what
it supersedes; retention removes a whole partition at once (``Location.remove_tree``: renamed away
on disk; in a bucket marked expired before its files are deleted). Every name here is a key of a
:class:`~lightspan.store.location.Location`, the same on disk and in a bucket.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lightspan.store.layout import is_remote
from lightspan.store.location import Entry, Location
from lightspan.store.schema import SCHEMAS

SUPERSEDES_SUFFIX = ".supersedes.json"
"""Compaction's note beside a merged file ``part-X.parquet``: ``part-X.supersedes.json`` holds
``{"files": [names]}``, the files of the same partition it replaces. Once ``part-X.parquet`` is
there, readers leave those files out; compaction removes them later (lightspan.collector.compact)."""
EXPIRED_MARKER = ".expired"
"""In a bucket, where a partition cannot be renamed away at once: an object of this name in a
partition hides all of it from readers while retention deletes its files (the marker last)."""


def writer_tree(where: Location, writer_id: str) -> str:
    """The tree of each partitioned table that collector ``writer_id`` owns: the whole table in a
    directory (one collector's, beside its WAL), ``collector=<id>`` in a bucket, which several
    collectors share without touching each other's objects."""
    return "" if where.local() is not None else f"collector={writer_id}"


def partitions(where: Location | str | os.PathLike, base: str, *, stat: bool = True) -> dict[str, dict[str, Entry]]:
    """{partition relative to ``base``: {file name: its Entry}} of every hive partition (``key=value``
    directories, not hidden: ``date=…``, or ``collector=…/date=…`` in a tree merged from several
    collectors) under key ``base``, sorted; one listing. A directory on disk with no file is a
    partition with no entries."""
    where = Location.of(where)
    found: dict[str, dict[str, Entry]] = {}
    cut = len(base) + 1
    for entry in where.list(base, stat=stat, dirs=True):
        relative = entry.key[cut:]
        if entry.is_dir:
            if _hive(relative):
                found.setdefault(relative, {})
            continue
        partition, _, name = relative.rpartition("/")
        if partition and _hive(partition):
            found.setdefault(partition, {})[name] = entry
    return dict(sorted(found.items()))


def _hive(relative: str) -> bool:
    return all("=" in part and not part.startswith(".") for part in relative.split("/"))


def _listing(where: Location, base: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(partition, its sorted file names) of every partition under ``base``: names only, no stat."""
    return tuple((partition, tuple(sorted(entries))) for partition, entries in partitions(where, base, stat=False).items())


def table_keys(where: Location, table: str) -> list[str]:
    """The keys of the committed Parquet files of partitioned ``table`` that hold its rows: every
    ``date=*/part-*.parquet`` (at any depth of hive directories) except those a merged file
    supersedes (see ``SUPERSEDES_SUFFIX``).

    Two listings in a row must agree (a directory listing is not a snapshot; an S3 listing is
    strongly consistent but paged), so a reader never sees a merged file together with the files
    it replaces, nor neither of them.
    """
    previous = None
    for _ in range(20):
        listing = _listing(where, table)
        if listing != previous:
            previous = listing
            continue
        try:
            return [f"{table}/{partition}/{name}" for partition, names in listing
                    for name in live_names(names, lambda note: where.read_bytes(f"{table}/{partition}/{note}"))]
        except FileNotFoundError:        # removed since the listing: list again
            previous = None
    raise OSError(f"the files of {where.name(table)} kept changing over 20 listings")


def table_files(path: str | os.PathLike | Location | None, table: str) -> list[Path] | list[str]:
    """The names (paths, or ``s3://`` URLs) of :func:`table_keys`: what a reader opens."""
    where = Location.of(path)
    return [where.name(key) for key in table_keys(where, table)]


def live_names(names, read_note) -> list[str]:
    """The Parquet files of one partition (its entry ``names``) that hold rows: not superseded by
    a merged file that is there (``read_note(name)`` gives a note's text), none once the partition
    is marked expired."""
    if EXPIRED_MARKER in names:
        return []
    superseded = set()
    for name in names:
        merged = name[: -len(SUPERSEDES_SUFFIX)] + ".parquet" if name.endswith(SUPERSEDES_SUFFIX) else None
        if merged in names:
            superseded.update(json.loads(read_note(name))["files"])
    return [n for n in names if n.startswith("part-") and n.endswith(".parquet") and n not in superseded]


def write_table(path: str | os.PathLike | Location | None, table_name: str, table: pa.Table, *,
                partition: str | None = None) -> Path | str:
    """Write one Parquet file into ``table_name/`` (``partition`` under it) atomically: readers see
    all of it or nothing (``Location.put_bytes``). Returns its name."""
    table = table.cast(SCHEMAS[table_name]) if table_name in SCHEMAS else table
    where = Location.of(path)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    key = "/".join([table_name, *([partition] if partition else []), f"part-{uuid.uuid4().hex}.parquet"])
    where.put_bytes(key, sink.getvalue())
    return where.name(key)


def open_input(path: str | os.PathLike):
    """What ``pyarrow.parquet.ParquetFile`` reads a store file from, given its name: a local path
    (memory-mapped), or a random-access file over the object."""
    if is_remote(str(path)):
        url = str(path)
        parent, _, key = url.rpartition("/")
        return Location(parent).open_input(key)
    return str(path)
