"""Where things are in a data directory. Standard library only: the agent side reads it too.

::

    spans/date=YYYY-MM-DD/part-*.parquet      one row per span, hive-partitioned by date
    logs/date=YYYY-MM-DD/part-*.parquet       one row per OTLP log record (GenAI events), by date
    transitions/part-*.parquet                 written by ``lightspan transitions build``
    train_steps/part-*.parquet                 written by ``lightspan train``
    policy.json                                the served policy (lightspan.store.policy)
    wal/                                       the collector's write-ahead log
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "LIGHTSPAN_DATA_DIR"
DEFAULT_DATA_DIR = "./lightspan-data"
"""The data directory when neither a config field nor ``$LIGHTSPAN_DATA_DIR`` names one."""
WAL_DIR = "wal"
ROLLOUT_LOGS_DIR = "rollout-logs"


def data_dir(path: str | os.PathLike | None = None) -> Path:
    """The data directory: ``path``, else ``$LIGHTSPAN_DATA_DIR``, else ``./lightspan-data``."""
    return Path(path or os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
