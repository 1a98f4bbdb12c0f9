"""Where things are in a data directory. Standard library only: the agent side reads it too.

::

    spans/date=YYYY-MM-DD/part-*.parquet      one row per span, hive-partitioned by date
    logs/date=YYYY-MM-DD/part-*.parquet       one row per OTLP log record (GenAI events), by date
    transitions/part-*.parquet                 written by ``lightspan transitions build``
    train_steps/part-*.parquet                 written by ``lightspan train``
    deployments/part-*.parquet                 canary decisions (lightspan.store.deployments)
    policy.json                                the served policy (lightspan.store.policy)
    wal/                                       the collector's write-ahead log
    rollout-logs/, checkpoints/                each rollout's output; the trainer's checkpoints

A data location may also be an S3-compatible bucket, ``s3://bucket/prefix`` (lightspan.store.objects):
the same tables and ``policy.json`` as objects under the prefix; the collector's WAL stays on its
local disk (its ``wal_dir``), and each collector writes under ``TABLE/collector=<id>/date=…/``.
Every part reaches a location's files through :class:`lightspan.store.location.Location`.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "LIGHTSPAN_DATA_DIR"
DEFAULT_DATA_DIR = "./lightspan-data"
"""The data directory when neither a config field nor ``$LIGHTSPAN_DATA_DIR`` names one."""
REMOTE_SCHEME = "s3://"
WAL_DIR = "wal"
ROLLOUT_LOGS_DIR = "rollout-logs"
CHECKPOINTS_DIR = "checkpoints"


def is_remote(location) -> bool:
    """Whether a data location is a bucket (``s3://bucket/prefix``), not a directory. The store's
    own question (lightspan.store.location): nothing outside ``store/`` asks it."""
    return isinstance(location, str) and location.startswith(REMOTE_SCHEME)


def bucket_path(url: str) -> str:
    """``s3://bucket/key`` → ``bucket/key``, the path pyarrow's S3 filesystem takes."""
    if not is_remote(url):
        raise ValueError(f"{url!r} is not an {REMOTE_SCHEME}bucket/prefix URL")
    path = str(url)[len(REMOTE_SCHEME):].strip("/")
    if not path or path.startswith("/"):
        raise ValueError(f"{url!r} names no bucket: use {REMOTE_SCHEME}BUCKET/PREFIX")
    return path


def data_dir(path=None) -> Path | str:
    """The data location: ``path``, else ``$LIGHTSPAN_DATA_DIR``, else ``./lightspan-data``. A
    directory is a ``Path``; a bucket stays its ``s3://bucket/prefix`` string (never a local path);
    a :class:`~lightspan.store.location.Location` gives its root."""
    from lightspan.store.location import Location

    if isinstance(path, Location):
        return path.root
    location = path or os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR
    if is_remote(location):
        return location.rstrip("/")
    if str(location).startswith("s3:/"):
        # an s3:// URL that went through Path() ("s3:/bucket"): never a local directory instead
        raise ValueError(f"{str(location)!r} is a bucket URL that lost a '/': pass it as the string s3://BUCKET/PREFIX")
    return Path(location)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
