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

from lightspan.store.files import table_files
from lightspan.store.layout import data_dir
from lightspan.store.schema import PARTITIONED, SCHEMAS

log = logging.getLogger(__name__)
T = TypeVar("T")

_LLM_OPERATIONS = "('chat', 'text_completion', 'completion', 'generate_content')"
NOT_CAPTURED_REASON = (
    "an LLM span without lightspan's capture: the agent's process did not run lightspan's instrumentor on "
    "this call (not started by lightspan rollout or opentelemetry-instrument, lightspan not installed in its "
    "environment, or an LLM client other than openai and anthropic); run it under lightspan rollout, or "
    "send its calls through a lightspan gateway")
"""``capture_reason`` of a rollout whose uncaptured calls carry no ``lightspan.capture.status``."""
_NOT_CAPTURED_SQL = "'" + NOT_CAPTURED_REASON.replace("'", "''") + "'"

# Views over the base tables. ``rollout_key`` is lightspan.rollout.id, else the trace id: without
# a root span every chat call is its own trace (docs/architecture.md, "Attributes").
_VIEWS = {
    # One row per LLM call, whatever the capture path: of LLM spans nested for one call (two
    # instrumentations; an agent's client span and the gateway's span of the same call, joined by
    # traceparent) the innermost with token ids is kept, as the transition builder keeps it.
    "llm_calls": f"""
        WITH c AS (
            SELECT *, coalesce(rollout_id, trace_id) AS rollout_key
            FROM spans
            WHERE (prompt_token_ids IS NOT NULL OR operation_name IN {_LLM_OPERATIONS})
              -- marked by the instrumentor: another span carries this call
              AND capture_status IS DISTINCT FROM 'duplicate'
        ), kids AS (
            SELECT trace_id, parent_span_id AS span_id, bool_or(prompt_token_ids IS NOT NULL) AS with_tokens
            FROM c WHERE parent_span_id IS NOT NULL GROUP BY ALL
        )
        SELECT c.* FROM c
        LEFT JOIN kids k ON k.trace_id = c.trace_id AND k.span_id = c.span_id
        LEFT JOIN (SELECT trace_id, span_id FROM c WHERE prompt_token_ids IS NOT NULL) p
               ON p.trace_id = c.trace_id AND p.span_id = c.parent_span_id
        WHERE (k.span_id IS NULL OR NOT (k.with_tokens OR c.prompt_token_ids IS NULL))
          AND NOT (c.prompt_token_ids IS NULL AND p.span_id IS NOT NULL)""",
    # who gave each reward and why (lightspan.reward.*): a reward span without a source is the agent's
    "rewards": """
        SELECT coalesce(rollout_id, trace_id) AS rollout_key, rollout_id, task_id, split,
               trace_id, span_id, coalesce(reward_name, 'reward') AS reward_name, reward,
               end_time_unix_nano AS time_unix_nano,
               coalesce(json_extract_string(attributes['lightspan.reward.source'], '$'), 'agent') AS source,
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
                   -- the last reward that scores the whole rollout; with only calls scored, the last of those
                   coalesce(arg_max(reward, end_time_unix_nano) FILTER (WHERE reward IS NOT NULL
                                AND attributes['lightspan.reward.call_span_id'] IS NULL),
                            arg_max(reward, end_time_unix_nano) FILTER (WHERE reward IS NOT NULL)) AS final_reward,
                   bool_or(status_code = 'ERROR') AS has_error,
                   min(start_time_unix_nano) AS start_time_unix_nano,
                   max(end_time_unix_nano) AS end_time_unix_nano,
                   max(model_version) AS model_version,
                   -- the named policies that served its calls (lightspan.policy.name), sorted; [] for none
                   coalesce(list_sort(list_distinct(list(policy) FILTER (WHERE policy IS NOT NULL))), []) AS policies,
                   -- the runner's outcome span (lightspan rollout): ok, failed or timeout, and the exit code
                   any_value(json_extract_string(attributes['lightspan.rollout.outcome'], '$'))
                       FILTER (WHERE name = 'lightspan.runner') AS outcome,
                   any_value(TRY_CAST(attributes['lightspan.rollout.exit_code'] AS BIGINT))
                       FILTER (WHERE name = 'lightspan.runner') AS exit_code,
                   -- why a rollout trains or not: a failed or timed-out rollout is never a reward of 0
                   CASE WHEN outcome IN ('failed', 'timeout') THEN outcome
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
    # one row per rollout and named policy that served one of its calls: that policy's versions
    # among them (a policy's calls of one rollout may span a sync) and the rollout's outcome
    "policy_rollouts": """
        SELECT p.rollout_key, p.policy, r.task_id, r.split, p.num_llm_calls, p.min_model_version,
               p.model_version, r.final_reward, r.status, r.start_time_unix_nano
        FROM (SELECT rollout_key, policy, count(*) AS num_llm_calls, min(model_version) AS min_model_version,
                     max(model_version) AS model_version
              FROM llm_calls WHERE policy IS NOT NULL GROUP BY ALL) p
        JOIN rollouts r USING (rollout_key)""",
    # the judge's and a person's scores of the same rollout (the latest of each), where both exist
    "reward_agreement": """
        SELECT rollout_key, any_value(task_id) AS task_id,
               arg_max(reward, time_unix_nano) FILTER (WHERE source = 'judge') AS judge,
               arg_max(reward, time_unix_nano) FILTER (WHERE source = 'human') AS human
        FROM rewards WHERE call_span_id IS NULL GROUP BY rollout_key
        HAVING judge IS NOT NULL AND human IS NOT NULL""",
}


def _glob(root, table: str) -> str | None:
    base = root / table
    if not base.is_dir() or not any(base.rglob("*.parquet")):
        return None
    return str(base / "**" / "*.parquet")


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
    root = data_dir(path)
    con = duckdb.connect(database)
    for table, schema in SCHEMAS.items():
        con.register(f"_{table}_empty", schema.empty_table())
        source = f"SELECT * FROM _{table}_empty"
        if table in PARTITIONED:         # a snapshot of the files: see table_files
            files = table_files(root, table)
            if files:
                listing = ", ".join(quote(str(f)) for f in files)
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
    for sql in _MACROS:
        con.execute(sql)
    for name, sql in _DERIVED.items():
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


def quote(text: str) -> str:
    """``text`` as a SQL string literal."""
    return "'" + str(text).replace("'", "''") + "'"



def quote_list(items) -> str:
    """A SQL list literal of strings: ``['a', 'b']``."""
    return "[" + ", ".join(quote(i) for i in items) + "]"
