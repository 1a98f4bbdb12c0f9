"""The store: the data contract every reader and writer of lightspan's data shares.

- :mod:`~lightspan.store.layout` — the data directory and what lives where in it;
- :mod:`~lightspan.store.location` — a data location, a directory or ``s3://bucket/prefix``, as one
  type (``Location.of(path)``): its files listed, read, put atomically, deleted;
- :mod:`~lightspan.store.policy` — ``policy.json``, the served policy version (one writer, one reader);
- :mod:`~lightspan.store.schema` — the Parquet schemas of spans, logs, transitions, train steps;
- :mod:`~lightspan.store.files` — which files hold a table's rows; atomic writes;
- :mod:`~lightspan.store.views` — DuckDB views (``spans``, ``llm_calls``, ``rollouts``, ``rewards``, …);
- :mod:`~lightspan.store.objects` — what a location in an S3-compatible bucket needs: the filesystem, its endpoint.

The collector is the only writer of spans and logs; every reader opens DuckDB views over the
Parquet files, so none waits on a writer's lock. Importing the store never pulls in the
receivers, gRPC or a web server. ``layout``, ``location`` and ``policy`` need only the standard
library (the rollout runner reads the served version inside an agent's environment); the names below that need
pyarrow or duckdb are imported on first use.
"""

from __future__ import annotations

import importlib

from lightspan.store import policy
from lightspan.store.layout import DATA_DIR_ENV, DEFAULT_DATA_DIR, data_dir, fsync_dir
from lightspan.store.location import Location

# name -> module: pyarrow and duckdb load when one of these is first used, not at import
_LAZY = {
    "SPAN_SCHEMA": "schema", "LOG_SCHEMA": "schema", "TRANSITION_SCHEMA": "schema",
    "TRAIN_STEP_SCHEMA": "schema", "SCHEMAS": "schema", "TABLES": "schema", "PARTITIONED": "schema",
    "REWARD_SCOPE": "schema", "REWARD_ORDER": "views",
    "SUPERSEDES_SUFFIX": "files", "table_files": "files", "write_table": "files", "open_input": "files",
    "connect": "views", "with_all_columns": "views", "retry_vanished": "views", "dedup_clause": "views",
    "quote": "views", "quote_list": "views",
}

__all__ = ["DATA_DIR_ENV", "DEFAULT_DATA_DIR", "data_dir", "fsync_dir", "Location", "policy", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
