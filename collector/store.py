"""The store: the Parquet schema of spans and the DuckDB views every reader uses.

The collector is the only writer of ``spans/``; readers (``lightningrl``, ``trainer``,
``dashboards``, ``lightspan sql``) open DuckDB views over the Parquet globs, so no reader ever
waits on a writer's lock (DESIGN.md §3.2). Importing this module pulls in only duckdb and
pyarrow: never the receivers, gRPC or a web server.

Layout of a data directory::

    spans/date=YYYY-MM-DD/part-*.parquet      one row per span, hive-partitioned by date
    logs/date=YYYY-MM-DD/part-*.parquet       one row per OTLP log record (GenAI events), by date
    transitions/part-*.parquet                 written by ``lightspan transitions build``
    train_steps/part-*.parquet                 written by ``lightspan train``
    wal/                                       the collector's write-ahead log
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

DEFAULT_DATA_DIR = "./lightspan-data"
log = logging.getLogger(__name__)
T = TypeVar("T")


def data_dir(path: str | os.PathLike | None = None) -> Path:
    """The data directory: ``path``, else ``$LIGHTSPAN_DATA_DIR``, else ``./lightspan-data``."""
    return Path(path or os.environ.get("LIGHTSPAN_DATA_DIR") or DEFAULT_DATA_DIR)


_EVENT = pa.struct([("time_unix_nano", pa.int64()), ("name", pa.string()), ("attributes", pa.string())])
_LINK = pa.struct([("trace_id", pa.string()), ("span_id", pa.string()), ("attributes", pa.string())])

SPAN_SCHEMA = pa.schema([
    ("trace_id", pa.string()),               # 32 lowercase hex
    ("span_id", pa.string()),                # 16 lowercase hex
    ("parent_span_id", pa.string()),         # null for a root span
    ("name", pa.string()),
    ("kind", pa.string()),                   # INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER
    ("service_name", pa.string()),
    ("scope_name", pa.string()),
    ("start_time_unix_nano", pa.int64()),
    ("end_time_unix_nano", pa.int64()),
    ("status_code", pa.string()),            # UNSET, OK, ERROR
    ("status_message", pa.string()),
    # rollout grouping: span attribute first, else resource attribute
    ("rollout_id", pa.string()),
    ("task_id", pa.string()),
    ("split", pa.string()),
    # GenAI
    ("operation_name", pa.string()),
    ("request_model", pa.string()),
    ("response_model", pa.string()),
    ("temperature", pa.float64()),           # gen_ai.request.temperature; null = the server's default
    ("input_tokens", pa.int64()),
    ("output_tokens", pa.int64()),
    ("finish_reasons", pa.list_(pa.string())),
    ("agent_name", pa.string()),
    ("input_messages", pa.string()),         # JSON text as the instrumentation wrote it
    ("output_messages", pa.string()),
    # RL
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("completion_token_ids", pa.list_(pa.int32())),   # choice 0
    ("completion_logprobs", pa.list_(pa.float32())),  # choice 0, sampled-token logprobs
    ("num_choices", pa.int32()),
    ("model_version", pa.int64()),
    ("capture_status", pa.string()),
    ("reward", pa.float64()),
    ("reward_name", pa.string()),
    # everything else
    ("attributes", pa.map_(pa.string(), pa.string())),           # JSON-encoded values
    ("resource_attributes", pa.map_(pa.string(), pa.string())),  # JSON-encoded values
    ("events", pa.list_(_EVENT)),
    ("links", pa.list_(_LINK)),
    ("received_unix_nano", pa.int64()),
])
"""One row per span. Promoted columns are what readers filter or join on."""

TRANSITION_SCHEMA = pa.schema([
    ("transition_id", pa.string()),          # rollout_key/span_id: unique per LLM call
    ("rollout_id", pa.string()),             # lightspan.rollout.id, else the trace id
    ("task_id", pa.string()),
    ("split", pa.string()),
    ("agent_name", pa.string()),
    ("call_index", pa.int32()),              # 0-based position of the call in its rollout
    ("num_calls", pa.int32()),
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("completion_token_ids", pa.list_(pa.int32())),
    ("completion_logprobs", pa.list_(pa.float32())),
    ("model_version", pa.int64()),
    ("temperature", pa.float64()),           # sampling temperature of the (first) call; null = 1
    ("reward", pa.float64()),                # the rollout's reward
    ("credit", pa.float64()),                # the reward this call received (credit policy)
    ("advantage", pa.float64()),
    ("credit_policy", pa.string()),
    ("advantage_estimator", pa.string()),
    ("build_id", pa.string()),
    ("created_unix_nano", pa.int64()),
    # per-rollout output: 1 where the model sampled the completion token, 0 where it did not
    # (tool output, user turn, template tokens); null = all ones (one call per transition)
    ("completion_mask", pa.list_(pa.int8())),
])

TRAIN_STEP_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("step", pa.int64()),
    ("policy_version", pa.int64()),          # the version the step produced
    ("time_unix_nano", pa.int64()),
    ("num_transitions", pa.int64()),
    ("num_tokens", pa.int64()),
    ("reward_mean", pa.float64()),
    ("advantage_abs_mean", pa.float64()),
    ("loss", pa.float64()),
    ("clip_ratio", pa.float64()),
    ("is_ratio_mean", pa.float64()),
    ("entropy", pa.float64()),
    ("kl", pa.float64()),
    ("staleness_mean", pa.float64()),
    ("skipped_stale", pa.int64()),
    ("step_seconds", pa.float64()),
    ("sync_seconds", pa.float64()),
    ("sync_max_abs_logprob_diff", pa.float64()),
])

LOG_SCHEMA = pa.schema([
    ("time_unix_nano", pa.int64()),          # the record's time, else its observed time, else receipt
    ("observed_time_unix_nano", pa.int64()),
    ("severity_number", pa.int32()),         # 0 unspecified, 1-4 TRACE ... 21-24 FATAL
    ("severity_text", pa.string()),
    ("body", pa.string()),                   # the body AnyValue as JSON text ("\"text\"", {...}, ...)
    ("event_name", pa.string()),             # LogRecord.event_name, else the event.name attribute
    ("trace_id", pa.string()),               # 32 lowercase hex, null when the record has none
    ("span_id", pa.string()),
    ("service_name", pa.string()),
    ("scope_name", pa.string()),
    # rollout grouping: record attribute first, else resource attribute (as for spans)
    ("rollout_id", pa.string()),
    ("task_id", pa.string()),
    ("split", pa.string()),
    ("attributes", pa.map_(pa.string(), pa.string())),           # JSON-encoded values
    ("resource_attributes", pa.map_(pa.string(), pa.string())),  # JSON-encoded values
    ("record_id", pa.string()),              # hash of resource + scope + record: the dedup key
    ("received_unix_nano", pa.int64()),
])
"""One row per OTLP log record. Logs have no ids, so a content hash deduplicates re-sent ones."""

_TABLES = {"spans": SPAN_SCHEMA, "transitions": TRANSITION_SCHEMA, "train_steps": TRAIN_STEP_SCHEMA,
           "logs": LOG_SCHEMA}
TABLES = tuple(_TABLES)
"""The base tables: one directory each under the data directory."""

# tables written by the collector: hive-partitioned by date, deduplicated on these keys when
# written (at-least-once delivery: the first copy received wins; see collector/dedup.py)
PARTITIONED = {"spans": ("trace_id", "span_id"), "logs": ("record_id",)}

# Views over the base tables. ``rollout_key`` is lightspan.rollout.id, else the trace id: without
# a root span every chat call is its own trace (DESIGN.md §3.1).
_VIEWS = {
    "llm_calls": """
        SELECT *, coalesce(rollout_id, trace_id) AS rollout_key
        FROM spans
        WHERE (prompt_token_ids IS NOT NULL
               OR operation_name IN ('chat', 'text_completion', 'completion', 'generate_content'))
          -- an enclosing span of a second instrumentation: the inner span carries the call
          AND capture_status IS DISTINCT FROM 'duplicate'""",
    "rewards": """
        SELECT coalesce(rollout_id, trace_id) AS rollout_key, rollout_id, task_id, split,
               trace_id, span_id, coalesce(reward_name, 'reward') AS reward_name, reward,
               end_time_unix_nano AS time_unix_nano
        FROM spans WHERE reward IS NOT NULL""",
    "rollouts": """
        SELECT coalesce(rollout_id, trace_id) AS rollout_key,
               any_value(task_id) FILTER (WHERE task_id IS NOT NULL) AS task_id,
               any_value(split) FILTER (WHERE split IS NOT NULL) AS split,
               any_value(service_name) AS service_name,
               count(*) AS num_spans,
               count(*) FILTER (WHERE prompt_token_ids IS NOT NULL) AS num_llm_calls,
               arg_max(reward, end_time_unix_nano) FILTER (WHERE reward IS NOT NULL) AS final_reward,
               bool_or(status_code = 'ERROR') AS has_error,
               min(start_time_unix_nano) AS start_time_unix_nano,
               max(end_time_unix_nano) AS end_time_unix_nano,
               max(model_version) AS model_version
        FROM spans GROUP BY 1""",
}


SUPERSEDES_SUFFIX = ".supersedes.json"
"""Compaction's note beside a merged file ``part-X.parquet``: ``part-X.supersedes.json`` holds
``{"files": [names]}``, the files of the same partition it replaces. Once ``part-X.parquet`` is
there, readers leave those files out; compaction removes them later (collector/compact.py)."""


def _glob(root: Path, table: str) -> str | None:
    base = root / table
    if not base.is_dir() or not any(base.rglob("*.parquet")):
        return None
    return str(base / "**" / "*.parquet")


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


def connect(path: str | os.PathLike | None = None, *, database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the views ``spans``, ``llm_calls``, ``rollouts``, ``rewards``,
    ``transitions``, ``train_steps`` and ``logs`` over the Parquet files of data directory ``path``.

    The views read the files as they are: the collector writes ``spans`` deduplicated on
    (trace_id, span_id) and ``logs`` on record_id (collector/dedup.py), so no view pays for a
    deduplicating window. ``spans`` and ``logs`` read the files committed when the connection
    opened (:func:`table_files`): open a connection per query or task to see newer ones. A table
    with no files yet is an empty view with the right columns.
    """
    root = data_dir(path)
    con = duckdb.connect(database)
    for table, schema in _TABLES.items():
        con.register(f"_{table}_empty", schema.empty_table())
        source = f"SELECT * FROM _{table}_empty"
        if table in PARTITIONED:         # a snapshot of the files: see table_files
            files = table_files(root, table)
            if files:
                listing = ", ".join(_quote(str(f)) for f in files)
                source = (f"SELECT * EXCLUDE (date) FROM read_parquet([{listing}], hive_partitioning=true, "
                          f"union_by_name=true)")
                source = with_all_columns(con, table, source)
                if any(len(f.relative_to(root / table).parts) > 2 for f in files):
                    # a tree merged from several collectors (collector=<n>/date=…): a batch
                    # retried to another collector is in it twice, so this view deduplicates
                    source += f" QUALIFY {dedup_clause(table)}"
        elif (glob := _glob(root, table)) is not None:
            source = f"SELECT * FROM read_parquet('{glob}', hive_partitioning=false, union_by_name=true)"
            source = with_all_columns(con, table, source)
        con.execute(f"CREATE OR REPLACE VIEW {table} AS {source}")
    for name, sql in _VIEWS.items():
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {sql}")
    return con


def with_all_columns(con: duckdb.DuckDBPyConnection, table: str, source: str) -> str:
    """``source`` (a query over ``table``'s files) plus a typed NULL for each schema column the
    files predate: a column added later reads as null in older stores."""
    have = {row[0] for row in con.execute(f"DESCRIBE {source}").fetchall()}
    missing = [(name, kind) for name, kind, *_ in con.execute(f"DESCRIBE _{table}_empty").fetchall()
               if name not in have]
    if not missing:
        return source
    nulls = ", ".join(f'NULL::{kind} AS "{name}"' for name, kind in missing)
    return f"SELECT *, {nulls} FROM ({source})"


def retry_vanished(fn: Callable[[], T], *, attempts: int = 5) -> T:
    """``fn()``, run again when a Parquet file it globbed vanished before it was read.

    Readers never lock: the collector's compaction and retention remove files that a reader's
    glob may have listed a moment before. A read is cheap to repeat and sees the new files then.
    """
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except duckdb.IOException as exc:
            # a globbed file gone: "No such file"; a file of a connection's listing gone: "No files found"
            if attempt == attempts or not any(m in str(exc) for m in ("No such file", "No files found")):
                raise
            log.info("a Parquet file vanished under a read (compaction); reading again (%d/%d)", attempt, attempts)
    raise AssertionError("unreachable")


def dedup_clause(table: str) -> str:
    """The QUALIFY condition that keeps one row per dedup key of a partitioned table (compaction
    applies it to the files it merges)."""
    return f"row_number() OVER (PARTITION BY {', '.join(PARTITIONED[table])} ORDER BY received_unix_nano) = 1"


def write_table(path: str | os.PathLike | None, table_name: str, table: pa.Table, *, partition: str | None = None) -> Path:
    """Write one Parquet file into ``table_name/`` atomically (temp file, fsync, rename)."""
    root = data_dir(path) / table_name
    if partition:
        root = root / partition
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"part-{uuid.uuid4().hex}.parquet"
    tmp = root / f".{final.name}.tmp"
    table = table.cast(_TABLES[table_name]) if table_name in _TABLES else table
    pq.write_table(table, tmp, compression="zstd")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    fsync_dir(root)
    return final


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
