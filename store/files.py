"""The store's files: which Parquet files hold a table's rows, and writing one atomically.

A partitioned table (``spans``, ``logs``) is ``TABLE/date=YYYY-MM-DD/part-*.parquet``, or
``TABLE/collector=N/date=…/part-*.parquet`` in a tree merged from several collectors; compaction
replaces files by a merged one and leaves a note naming what it supersedes; retention (in a
bucket) marks a partition expired before it deletes its files. The location may be a directory or
an ``s3://bucket/prefix`` (lightspan.store.objects): the same names, as objects.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lightspan.store.layout import data_dir, fsync_dir, is_remote
from lightspan.store.schema import SCHEMAS

SUPERSEDES_SUFFIX = ".supersedes.json"
"""Compaction's note beside a merged file ``part-X.parquet``: ``part-X.supersedes.json`` holds
``{"files": [names]}``, the files of the same partition it replaces. Once ``part-X.parquet`` is
there, readers leave those files out; compaction removes them later (lightspan.collector.compact)."""
EXPIRED_MARKER = ".expired"
"""In a bucket, where a partition cannot be renamed away at once: an object of this name in a
partition hides all of it from readers while retention deletes its files (the marker last)."""


def _listing(base: Path) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(directory relative to ``base``, its entries) of every hive directory (``key=value``) under
    ``base``: ``date=…``, or ``collector=…/date=…`` in a tree merged from several collectors."""
    entries, todo = [], [""]
    while todo:
        relative = todo.pop()
        try:
            names = tuple(sorted(os.listdir(base / relative)))
        except FileNotFoundError:        # a partition expired under the listing
            continue
        if relative:
            entries.append((relative, names))
        todo += [os.path.join(relative, n) for n in names if "=" in n and not n.startswith(".")
                 and not n.endswith(".parquet") and not n.endswith(".json")]
    return tuple(sorted(entries))


def table_files(path: str | os.PathLike | None, table: str) -> list[Path] | list[str]:
    """The committed Parquet files of partitioned ``table`` that hold its rows: every
    ``date=*/part-*.parquet`` (at any depth of hive directories) except those a merged file
    supersedes (see ``SUPERSEDES_SUFFIX``).

    Two listings in a row must agree (a directory listing is not a snapshot), so a reader never
    sees a merged file together with the files it replaces, nor neither of them. In a bucket the
    files are ``s3://`` URLs (an S3 listing is strongly consistent, but paged: the same rule).
    """
    root = data_dir(path)
    if is_remote(root):
        return _remote_table_files(f"{root}/{table}")
    base = root / table
    if not base.is_dir():
        return []
    previous = None
    for _ in range(20):
        listing = _listing(base)
        if listing != previous:
            previous = listing
            continue
        try:
            return [base / partition / name for partition, names in listing
                    for name in live_names(names, lambda note: (base / partition / note).read_text())]
        except FileNotFoundError:        # removed since the listing: list again
            previous = None
    raise OSError(f"the files of {base} kept changing over 20 listings")


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


def remote_listing(base: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """:func:`_listing` of a table in a bucket: (partition relative to ``base``, its object names),
    from one listing of the prefix; with the objects' sizes and times as :func:`remote_entries`."""
    return tuple((partition, tuple(sorted(entries))) for partition, entries in remote_entries(base).items())


def remote_entries(base: str) -> dict:
    """{partition relative to ``base``: {object name: objects.Entry}} of every hive partition."""
    from lightspan.store import objects

    found: dict[str, dict] = {}
    for entry in objects.list_files(base):
        relative = entry.url[len(base.rstrip("/")) + 1:]
        partition, _, name = relative.rpartition("/")
        if partition and all("=" in part for part in partition.split("/")):
            found.setdefault(partition, {})[name] = entry
    return dict(sorted(found.items()))


def _remote_table_files(base: str) -> list[str]:
    from lightspan.store import objects

    previous = None
    for _ in range(20):
        listing = remote_listing(base)
        if listing != previous:
            previous = listing
            continue
        try:
            return [f"{base}/{partition}/{name}" for partition, names in listing
                    for name in live_names(names, lambda note: objects.read_bytes(f"{base}/{partition}/{note}"))]
        except FileNotFoundError:        # a note removed since the listing: list again
            previous = None
    raise OSError(f"the objects of {base} kept changing over 20 listings")


def write_table(path: str | os.PathLike | None, table_name: str, table: pa.Table, *,
                partition: str | None = None) -> Path | str:
    """Write one Parquet file into ``table_name/`` atomically (temp file, fsync, rename; in a
    bucket one object written in one request, which readers see whole or not at all)."""
    table = table.cast(SCHEMAS[table_name]) if table_name in SCHEMAS else table
    location = data_dir(path)
    if is_remote(location):
        from lightspan.store import objects

        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        url = "/".join([location, table_name, *([partition] if partition else []), f"part-{uuid.uuid4().hex}.parquet"])
        objects.put_bytes(url, sink.getvalue())
        return url
    root = location / table_name
    if partition:
        root = root / partition
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"part-{uuid.uuid4().hex}.parquet"
    tmp = root / f".{final.name}.tmp"
    pq.write_table(table, tmp, compression="zstd")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    fsync_dir(root)
    return final


def open_input(path: str | os.PathLike):
    """What ``pyarrow.parquet.ParquetFile`` reads a store file from: a local path, or an object."""
    if is_remote(str(path)):
        from lightspan.store import objects

        return objects.open_input(str(path))
    return path
