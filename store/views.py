"""The DuckDB views every reader uses, over the Parquet files of a data directory.

The collector is the only writer of ``spans/`` and ``logs/``; readers (``lightningrl``,
``trainer``, ``dashboards``, ``lightspan sql``, the collector's SQL API) open DuckDB views over
the files, so no reader ever waits on a writer's lock.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

import duckdb

from lightspan.store.files import table_keys
from lightspan.store.location import Location
from lightspan.store.schema import PARTITIONED, REWARD_SCOPE, SCHEMAS

log = logging.getLogger(__name__)
T = TypeVar("T")

LLM_OPERATIONS = ("chat", "completion", "generate_content", "text_completion")
"""The ``operation_name`` values of an LLM call's span: ``tracing.semconv.LLM_OPERATIONS``, copied here
because the store imports no other part (tests/test_layers.py pins the two equal)."""
_LLM_OPERATIONS_SQL = "(" + ", ".join(f"'{op}'" for op in LLM_OPERATIONS) + ")"
NOT_CAPTURED_REASON = (
    "an LLM span without lightspan's capture: the agent's process did not run lightspan's instrumentor on "
    "this call (not started by lightspan rollout or opentelemetry-instrument, lightspan not installed in its "
    "environment, or an LLM client other than openai and anthropic); run it under lightspan rollout, or "
    "send its calls through a lightspan gateway")
"""``capture_reason`` of a rollout whose uncaptured calls carry no ``lightspan.capture.status``."""
_NOT_CAPTURED_SQL = "'" + NOT_CAPTURED_REASON.replace("'", "''") + "'"
REWARD_ORDER = "(coalesce(received_unix_nano, end_time_unix_nano), end_time_unix_nano, span_id)"
"""The order of a rollout's reward spans, the last one final: when the collector received each (a
sender's clock is its own claim: an agent's reward dated 2262 never outranks a person's later score),
then, within one request, the sender's end time. The builder orders its rewards the same way."""

# Views over the base tables. ``rollout_key`` is lightspan.rollout.id, else the trace id: without
# a root span every chat call is its own trace (docs/architecture.md, "Attributes").
_VIEWS = {
    # One row per LLM call, whatever the capture path: of LLM spans nested for one call (two
    # instrumentations; an agent's client span and the gateway's span of the same call, joined by
    # traceparent) the innermost with token ids is kept, as the transition builder keeps it.
    "llm_calls": f"""
        WITH c AS (
            SELECT *, coalesce(rollout_id, trace_id) AS rollout_key,
                   -- per trace, over its LLM spans: their parents, the parents of those with token
                   -- ids, and those with token ids (a window on the trace id: a filter on the trace
                   -- ids of a rollout still reaches the Parquet scan, as no join would let it)
                   list(parent_span_id) OVER t AS _parents,
                   list(parent_span_id) FILTER (WHERE prompt_token_ids IS NOT NULL) OVER t AS _token_parents,
                   list(span_id) FILTER (WHERE prompt_token_ids IS NOT NULL) OVER t AS _token_spans
            FROM spans
            WHERE (prompt_token_ids IS NOT NULL OR operation_name IN {_LLM_OPERATIONS_SQL})
              -- marked by the instrumentor: another span carries this call
              AND capture_status IS DISTINCT FROM 'duplicate'
            WINDOW t AS (PARTITION BY trace_id)
        )
        SELECT * EXCLUDE (_parents, _token_parents, _token_spans) FROM c
        -- an enclosing span stays only when it has token ids and none of the spans inside it has
        WHERE (NOT list_contains(_parents, span_id)
               OR NOT (list_contains(_token_parents, span_id) OR prompt_token_ids IS NULL))
          -- a span without token ids inside one with them describes the same call
          AND NOT (prompt_token_ids IS NULL AND coalesce(list_contains(_token_spans, parent_span_id), false))""",
    # who gave each reward and why (lightspan.reward.*). The source is what the collector knows: a
    # reward the API wrote (its scope, which no OTLP span may claim) says who posted it; any other
    # reward span is the agent's, whatever it claims. received_unix_nano orders them (REWARD_ORDER).
    "rewards": f"""
        SELECT coalesce(rollout_id, trace_id) AS rollout_key, rollout_id, task_id, split,
               trace_id, span_id, coalesce(reward_name, 'reward') AS reward_name, reward,
               end_time_unix_nano AS time_unix_nano,
               coalesce(received_unix_nano, end_time_unix_nano) AS received_unix_nano,
               CASE WHEN scope_name = '{REWARD_SCOPE}'
                    THEN coalesce(json_extract_string(attributes['lightspan.reward.source'], '$'), 'api')
                    ELSE 'agent' END AS source,
               json_extract_string(attributes['lightspan.reward.call_span_id'], '$') AS call_span_id,
               json_extract_string(attributes['lightspan.reward.comment'], '$') AS comment,
               json_extract_string(attributes['lightspan.reward.correction'], '$') AS correction,
               json_extract_string(attributes['lightspan.reward.judge.model'], '$') AS judge_model,
               json_extract_string(attributes['lightspan.reward.rubric.sha256'], '$') AS rubric_sha256
        FROM spans WHERE reward IS NOT NULL""",
    # num_uncaptured_calls: LLM calls that cannot be trained as captured (capture status not ok, or
    # none at all); capture_problem / capture_reason: the most common such status, and why + the fix
    "rollouts": f"""
        WITH r AS (
            SELECT coalesce(rollout_id, trace_id) AS rollout_key,
                   any_value(task_id) FILTER (WHERE task_id IS NOT NULL) AS task_id,
                   any_value(split) FILTER (WHERE split IS NOT NULL) AS split,
                   any_value(service_name) AS service_name,
                   count(*) AS num_spans,
                   count(*) FILTER (WHERE prompt_token_ids IS NOT NULL) AS num_llm_calls,
                   -- the last reward received that scores the whole rollout; with only calls scored, the
                   -- last of those (REWARD_ORDER: never the sender's clock first)
                   coalesce(arg_max(reward, {REWARD_ORDER}) FILTER (WHERE reward IS NOT NULL
                                AND attributes['lightspan.reward.call_span_id'] IS NULL),
                            arg_max(reward, {REWARD_ORDER}) FILTER (WHERE reward IS NOT NULL)) AS final_reward,
                   bool_or(status_code = 'ERROR') AS has_error,
                   min(start_time_unix_nano) AS start_time_unix_nano,
                   max(end_time_unix_nano) AS end_time_unix_nano,
                   max(model_version) AS model_version,
                   -- the named policies that served its calls (lightspan.policy.name), sorted; [] for none
                   coalesce(list_sort(list_distinct(list(policy) FILTER (WHERE policy IS NOT NULL))), []) AS policies,
                   -- the runner's outcome span (lightspan rollout): ok, failed, timeout or infra, and the exit code
                   any_value(json_extract_string(attributes['lightspan.rollout.outcome'], '$'))
                       FILTER (WHERE name = 'lightspan.runner') AS outcome,
                   any_value(TRY_CAST(attributes['lightspan.rollout.exit_code'] AS BIGINT))
                       FILTER (WHERE name = 'lightspan.runner') AS exit_code,
                   -- how its process ended (exit, exception, timeout, signal, unknown), the signal or
                   -- the exception's type, if one; lost_spans: its spans the collector never
                   -- acknowledged (the runner counted them)
                   any_value(json_extract_string(attributes['lightspan.rollout.end'], '$'))
                       FILTER (WHERE name = 'lightspan.runner') AS ended,
                   any_value(TRY_CAST(attributes['lightspan.rollout.signal'] AS BIGINT))
                       FILTER (WHERE name = 'lightspan.runner') AS end_signal,
                   any_value(json_extract_string(attributes['lightspan.rollout.exception.type'], '$'))
                       FILTER (WHERE name = 'lightspan.runner') AS end_exception,
                   any_value(TRY_CAST(attributes['lightspan.rollout.spans.lost'] AS BIGINT))
                       FILTER (WHERE name = 'lightspan.runner') AS lost_spans,
                   -- why a rollout trains or not: a failed or timed-out rollout is never a reward of 0, and
                   -- an infrastructure failure (infra) is not the policy's: pass@k leaves it out
                   CASE WHEN outcome IN ('failed', 'timeout', 'infra') THEN outcome
                        WHEN final_reward IS NOT NULL THEN 'rewarded' ELSE 'unrewarded' END AS status
            FROM spans GROUP BY 1
        ), problems AS (
            SELECT rollout_key, coalesce(capture_status, 'not_captured') AS problem, count(*) AS n,
                   any_value(json_extract_string(attributes['lightspan.capture.reason'], '$')) AS reason
            FROM llm_calls WHERE capture_status IS DISTINCT FROM 'ok' GROUP BY 1, 2
        ), u AS (
            SELECT rollout_key, sum(n) AS num_uncaptured_calls, arg_max(problem, n) AS capture_problem,
                   arg_max(coalesce(reason, CASE WHEN problem = 'not_captured' THEN {_NOT_CAPTURED_SQL} END),
                           n) AS capture_reason
            FROM problems GROUP BY 1
        )
        SELECT r.*, coalesce(u.num_uncaptured_calls, 0)::BIGINT AS num_uncaptured_calls, u.capture_problem,
               u.capture_reason
        FROM r LEFT JOIN u USING (rollout_key)""",
}
# pass@k (at least one of k tries succeeds) and pass^k (all k succeed: reliability, as in
# tau-bench) per task, policy version and split, with the unbiased estimators of Chen et al. 2021
# over the n rollouts whose outcome is known (rewarded, failed or timed out: a failure counts
# against, a rollout with no reward yet does not count) of which c reached ``threshold``.
_MACROS = [
    """CREATE OR REPLACE MACRO binom(a, b) AS
           CASE WHEN b < 0 OR b > a THEN 0.0 ELSE round(exp(lgamma(a + 1) - lgamma(b + 1) - lgamma(a - b + 1))) END""",
    """CREATE OR REPLACE MACRO pass_k(threshold := 1.0) AS TABLE
       WITH runs AS (
           SELECT task_id, model_version, coalesce(split, 'train') AS split, count(*) AS n,
                  count(*) FILTER (WHERE final_reward >= threshold) AS c
           FROM rollouts WHERE task_id IS NOT NULL AND status IN ('rewarded', 'failed', 'timeout')
           GROUP BY ALL)
       SELECT task_id, model_version, split, n, c, k,
              1 - binom(n - c, k) / binom(n, k) AS pass_at_k, binom(c, k) / binom(n, k) AS pass_hat_k
       FROM runs, unnest(range(1, n + 1)) AS t(k)""",
]
_DERIVED = {
    "pass_at_k": "SELECT * FROM pass_k()",
    # every gen_ai.evaluation.result event the collector made a reward of (collector/evaluations.py):
    # value null = a label without a value, stored and not trained on (not in the rewards view)
    "evaluations": f"""
        SELECT coalesce(rollout_id, trace_id) AS rollout_key, rollout_id, task_id,
               coalesce(reward_name, 'reward') AS name, reward AS value,
               json_extract_string(attributes['gen_ai.evaluation.score.label'], '$') AS label,
               TRY_CAST(attributes['gen_ai.evaluation.score.value'] AS DOUBLE) AS score,
               json_extract_string(attributes['lightspan.reward.comment'], '$') AS explanation,
               json_extract_string(attributes['lightspan.reward.source'], '$') AS source,
               json_extract_string(attributes['lightspan.reward.evaluator'], '$') AS evaluator,
               json_extract_string(attributes['lightspan.reward.evaluated.trace_id'], '$') AS evaluated_trace_id,
               json_extract_string(attributes['lightspan.reward.evaluated.span_id'], '$') AS evaluated_span_id,
               json_extract_string(attributes['lightspan.reward.call_span_id'], '$') AS call_span_id,
               json_extract_string(attributes['gen_ai.response.id'], '$') AS response_id,
               end_time_unix_nano AS time_unix_nano,
               coalesce(received_unix_nano, end_time_unix_nano) AS received_unix_nano
        FROM spans WHERE scope_name = '{REWARD_SCOPE}' AND attributes['gen_ai.evaluation.name'] IS NOT NULL""",
    # one row per rollout and named policy that served one of its calls: that policy's versions
    # among them (a policy's calls of one rollout may span a sync) and the rollout's outcome
    "policy_rollouts": """
        SELECT p.rollout_key, p.policy, r.task_id, r.split, p.num_llm_calls, p.min_model_version,
               p.model_version, r.final_reward, r.status, r.start_time_unix_nano
        FROM (SELECT rollout_key, policy, count(*) AS num_llm_calls, min(model_version) AS min_model_version,
                     max(model_version) AS model_version
              FROM llm_calls WHERE policy IS NOT NULL GROUP BY ALL) p
        JOIN rollouts r USING (rollout_key)""",
    # the judge's and a person's scores of the same rollout (the latest received of each), where both exist
    "reward_agreement": """
        SELECT rollout_key, any_value(task_id) AS task_id,
               arg_max(reward, (received_unix_nano, time_unix_nano, span_id)) FILTER (WHERE source = 'judge') AS judge,
               arg_max(reward, (received_unix_nano, time_unix_nano, span_id)) FILTER (WHERE source = 'human') AS human
        FROM rewards WHERE call_span_id IS NULL GROUP BY rollout_key
        HAVING judge IS NOT NULL AND human IS NOT NULL""",
    # reward drift: the mean rollout reward each source gave per policy version (each rollout's
    # latest score from each source); a judge that drifts from people as the policy learns shows here
    "reward_drift": """
        WITH latest AS (
            SELECT rollout_key, source, arg_max(reward, (received_unix_nano, time_unix_nano, span_id)) AS reward
            FROM rewards WHERE call_span_id IS NULL GROUP BY ALL)
        SELECT r.model_version, coalesce(r.split, 'train') AS split, l.source, count(*) AS rollouts,
               avg(l.reward) AS reward_mean
        FROM latest l JOIN rollouts r USING (rollout_key) GROUP BY ALL""",
}


def connect(path: str | os.PathLike | None = None, *, database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the views ``spans``, ``llm_calls``, ``rollouts``, ``rewards``,
    ``transitions``, ``train_steps`` and ``logs`` over the Parquet files of data directory ``path``
    (and the derived ``pass_at_k``, ``reward_agreement``, ``policy_rollouts``).

    The views read the files as they are: the collector writes ``spans`` deduplicated on
    (trace_id, span_id) and ``logs`` on record_id (lightspan.collector.dedup), so no view pays for a
    deduplicating window. ``spans`` and ``logs`` read the files committed when the connection
    opened (:func:`table_files`): open a connection per query or task to see newer ones. A table
    with no files yet is an empty view with the right columns.
    """
    where = Location.of(path)
    con = duckdb.connect(database)
    where.register(con)                  # read_parquet('s3://…') for readers that name files
    for table, schema in SCHEMAS.items():
        con.register(f"_{table}_empty", schema.empty_table())
        source = f"SELECT * FROM _{table}_empty"
        if table in PARTITIONED:         # a snapshot of the files: see table_keys
            keys = table_keys(where, table)
            if keys:
                source = _files_source(con, where, table, keys, hive=True)
                if len(_collectors(table, keys)) > 1:
                    # a tree merged from several collectors (collector=<n>/date=…): a batch
                    # retried to another collector is in it twice, so this view deduplicates
                    source += f" QUALIFY {dedup_clause(table)}"
        elif (files := _flat_files(where, table)) is not None:
            source = _files_source(con, where, table, files, hive=False)
        con.execute(f"CREATE OR REPLACE VIEW {table} AS {source}")
    for name, sql in _VIEWS.items():
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {sql}")
    for sql in _MACROS:
        con.execute(sql)
    for name, sql in _DERIVED.items():
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {sql}")
    return con


def _files_source(con, where: Location, table: str, files: list[str] | str, *, hive: bool) -> str:
    """A query over ``files`` of ``table`` (keys, or a glob DuckDB expands when a query runs), with
    every column of its schema."""
    if where.local() is None:
        # in a bucket, a pyarrow dataset over the objects, with the table's schema (a column older
        # files lack reads as null): DuckDB pushes projections and filters into its scan, and no
        # file's footer is fetched before a query needs it (see lightspan.store.objects); on disk
        # DuckDB's own Parquet reader is the faster (bench/README.md, "The store in a bucket")
        import pyarrow.dataset as ds

        name = f"_{table}_files"
        con.register(name, ds.dataset([where.fs_path(key) for key in files], schema=SCHEMAS[table],
                                      format="parquet", filesystem=where.fs))
        return f"SELECT * FROM {name}"
    listing = quote(files) if isinstance(files, str) else "[" + ", ".join(quote(str(where.name(k))) for k in files) + "]"
    if hive:
        source = f"SELECT * EXCLUDE (date) FROM read_parquet({listing}, hive_partitioning=true, union_by_name=true)"
    else:
        source = f"SELECT * FROM read_parquet({listing}, hive_partitioning=false, union_by_name=true)"
    return with_all_columns(con, table, source)


def _collectors(table: str, keys: list[str]) -> set[str]:
    """The collectors whose trees ``keys`` come from ("" for a collector's own ``date=…`` tree)."""
    found = set()
    for key in keys:
        parts = key[len(table) + 1:].split("/")
        found.add(parts[0] if len(parts) > 2 else "")
    return found


def _flat_files(where: Location, table: str) -> list[str] | str | None:
    """What an unpartitioned table (``transitions``, ``train_steps``) reads, None when it has no
    file: on disk DuckDB's glob of every Parquet file under its directory (expanded when a query
    runs, so a long-lived connection sees files written since); in a bucket, where a glob would cost
    a listing per query, the keys of its ``part-*.parquet`` objects now."""
    directory = where.local(table)
    if directory is not None:
        if not directory.is_dir() or not any(directory.rglob("*.parquet")):
            return None
        return str(directory / "**" / "*.parquet")
    depth = table.count("/") + 1
    files = [e.key for e in where.list(table, stat=False)
             if e.key.count("/") == depth and e.key.rsplit("/", 1)[-1].startswith("part-") and e.key.endswith(".parquet")]
    return sorted(files) or None


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
        except (duckdb.IOException, duckdb.InvalidInputException, FileNotFoundError) as exc:
            if attempt == attempts or not any(m in str(exc) for m in _VANISHED):
                raise
            log.info("a Parquet file vanished under a read (compaction); reading again (%d/%d)", attempt, attempts)
    raise AssertionError("unreachable")


# a globbed file gone: "No such file"; a file of a connection's listing gone: "No files found";
# an object of a bucket's listing gone: pyarrow's "Path does not exist" / NoSuchKey
_VANISHED = ("No such file", "No files found", "Path does not exist", "NoSuchKey")


def dedup_clause(table: str) -> str:
    """The QUALIFY condition that keeps one row per dedup key of a partitioned table (compaction
    applies it to the files it merges)."""
    return f"row_number() OVER (PARTITION BY {', '.join(PARTITIONED[table])} ORDER BY received_unix_nano) = 1"


def quote(text: str) -> str:
    """``text`` as a SQL string literal."""
    return "'" + str(text).replace("'", "''") + "'"



def quote_list(items) -> str:
    """A SQL list literal of strings: ``['a', 'b']``."""
    return "[" + ", ".join(quote(i) for i in items) + "]"
