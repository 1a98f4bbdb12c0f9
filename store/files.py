"""The store's files: which Parquet files hold a table's rows, and writing one atomically.

A partitioned table (``spans``, ``logs``) is ``TABLE/date=YYYY-MM-DD/part-*.parquet``, or
``TABLE/collector=N/date=…/part-*.parquet`` in a tree merged from several collectors; compaction
replaces files by a merged one and leaves a note naming what it supersedes.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lightspan.store.layout import data_dir, fsync_dir
from lightspan.store.schema import SCHEMAS

SUPERSEDES_SUFFIX = ".supersedes.json"
"""Compaction's note beside a merged file ``part-X.parquet``: ``part-X.supersedes.json`` holds
``{"files": [names]}``, the files of the same partition it replaces. Once ``part-X.parquet`` is
there, readers leave those files out; compaction removes them later (lightspan.collector.compact)."""


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


def table_files(path: str | os.PathLike | None, table: str) -> list[Path]:
    """The committed Parquet files of partitioned ``table`` that hold its rows: every
    ``date=*/part-*.parquet`` (at any depth of hive directories) except those a merged file
    supersedes (see ``SUPERSEDES_SUFFIX``).

    Two listings in a row must agree (a directory listing is not a snapshot), so a reader never
    sees a merged file together with the files it replaces, nor neither of them.
    """
    base = data_dir(path) / table
    if not base.is_dir():
        return []
    previous = None
    for _ in range(20):
        listing = _listing(base)
        if listing != previous:
            previous = listing
            continue
        files = []
        try:
            for partition, names in listing:
                superseded = set()
                for name in names:
                    merged = name[: -len(SUPERSEDES_SUFFIX)] + ".parquet" if name.endswith(SUPERSEDES_SUFFIX) else None
                    if merged in names:
                        superseded.update(json.loads((base / partition / name).read_text())["files"])
                files += [base / partition / n for n in names
                          if n.startswith("part-") and n.endswith(".parquet") and n not in superseded]
        except FileNotFoundError:        # removed since the listing: list again
            previous = None
            continue
        return files
    raise OSError(f"the files of {base} kept changing over 20 listings")


def write_table(path: str | os.PathLike | None, table_name: str, table: pa.Table, *, partition: str | None = None) -> Path:
    """Write one Parquet file into ``table_name/`` atomically (temp file, fsync, rename)."""
    root = data_dir(path) / table_name
    if partition:
        root = root / partition
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"part-{uuid.uuid4().hex}.parquet"
    tmp = root / f".{final.name}.tmp"
    table = table.cast(SCHEMAS[table_name]) if table_name in SCHEMAS else table
    pq.write_table(table, tmp, compression="zstd")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    fsync_dir(root)
    return final
