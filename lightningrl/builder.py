"""The transition builder: spans in, LightningRL transitions and a metrics dict out (DESIGN.md §3.4).

The set-based work is SQL in DuckDB over the light span columns. The token lists, nearly all
the bytes, never pass through SQL: pyarrow decodes them once (:mod:`.tokens`), in background
threads while DuckDB works, from the files that hold new spans (a file that turns out to hold
no candidate is dropped, unread if its turn has not come), and the output takes them without a
copy. Python applies the pure credit and advantage functions to whole numpy columns, all
rollouts at once. One build:

1. Scope: every span (a full build), or (an incremental build, :mod:`.watermark`) the rollouts
   with a span received after the watermark plus the ones the last build left pending.
   Spans are grouped by rollout key (rollout id, else trace id) and deduplicated on
   (trace_id, span_id), first copy received wins. A trace counts as a rollout if it has a
   rollout id or a GenAI call span. Rollouts already in ``transitions`` are skipped (the
   anti-join: never emitted twice).
2. Each rollout is kept or dropped with the first reason that applies, in this order:
   ``split`` (not ``config.split``; a rollout without one is ``train``), ``duplicate`` (built
   before, and spans of it were received after that build — a late reward or a re-sent batch
   that is ignored), ``incomplete`` (no ``lightspan.runner`` end span and a span that ended
   within ``grace_s``; reconsidered next build), ``timeout`` / ``failed`` (the runner's outcome;
   a runner span without the outcome attribute is failed iff its status is ERROR; a
   ``lightspan.rollout`` root span with status ERROR is also failed), ``time_window`` (started
   before ``since`` or at/after ``until``), ``no_token_ids`` (no LLM call at all),
   ``agent_mismatch`` (no call of an agent matching ``agent_match``), ``no_token_ids`` (no
   matching call with token ids), ``model_version`` (a matching call with token ids served by a
   version outside [min_model_version, max_model_version]), ``truncated`` (``drop_truncated`` and
   every such call stopped at the length limit), ``no_reward`` (no finite reward),
   ``small_group`` (fewer than ``min_group_size`` rollouts of its task left in this build).
3. An LLM call is a span with token ids or a GenAI operation name (as the ``llm_calls`` view).
   Nested LLM call spans (two instrumentations of one request) collapse into one: the inner
   span with token ids is kept, the others are dropped as ``duplicate`` calls, as is every span
   the instrumentor marked ``lightspan.capture.status = duplicate``. A call belongs to the agent
   of the nearest span, itself included, that is an agent span: one carrying
   ``gen_ai.agent.name``, or ``gen_ai.operation.name = invoke_agent`` (named by its span name
   ``invoke_agent {name}``), or traceloop's ``traceloop.span.kind = agent`` (named by
   ``traceloop.entity.name``), or a traceloop ``task`` span whose entity name is the name of an
   agent span of the same rollout (a LangGraph node that runs an agent's graph: langgraph-
   supervisor's ``supervisor`` and ``create_react_agent`` agents, whose own ``invoke_agent`` span
   is a sibling of the node's spans, not their parent); with none, to the resource's
   ``service.name``.
4. A group is the rollouts of one task among those kept in this build (a rollout without a
   task id is a group of its own). Rollouts already built or still incomplete never join a
   later group: a straggler that completes after its siblings were built is a group of one.
5. A rollout's actions are its calls of a matching agent, ordered by (start, end, span id).
   Rewards are matched to them (``credit.rewards_per_call``), the credit policy gives one
   credit per call, the estimator gives per-call advantages against the group's rollout
   returns (``identical``: the final reward; ``discounted``: G_0). Calls without token ids
   (missing prompt or completion ids, or logprobs not one per completion token) and, with
   ``drop_truncated``, truncated calls keep their place in the credit computation but are
   not emitted.
6. Output ``per_call``: one row per emitted call. ``per_rollout``: the emitted calls of one
   rollout and agent merged into sequences (:mod:`.sequences`); a row carries its first
   call's id, call index, credit and advantage — under ``identical`` that is the rollout's
   advantage; under ``discounted`` the return-to-go from the sequence's first call (a
   sequence is credited with every reward from its start on, none from before it), which is
   G_0 for a sequence that starts at the first call — and the oldest model version of its
   calls (staleness is bounded by the oldest policy that wrote it).

Drop counts are per build. A full build counts every unbuilt rollout again; an incremental
build counts the rollouts it read (new spans, or pending). Two builds must not run at once on
one data dir.

Metrics (one build):

- ``transitions/rollouts``, ``/groups``: rollouts and task groups emitted;
  ``/group_size_mean``: rollouts per emitted group.
- ``transitions/calls``: LLM calls whose completion is trained; ``/sequences``: rows emitted
  (= calls with ``per_call``).
- ``transitions/reward_mean``, ``/reward_std``: the emitted rollouts' final rewards;
  ``/return_mean``: the rollout returns the baselines use (= reward_mean under ``identical``);
  ``/advantage_abs_mean``: mean |Â| over the rows (NaN when nothing was emitted).
- ``transitions/nonzero_advantage``: rows that carry a gradient (|Â| > 0).
- ``transitions/zero_std_groups``: groups whose returns are all equal, so they carry no
  rollout-level learning signal (every Â is 0 under ``identical``).
- ``transitions/completion_tokens``: sampled (mask 1) completion tokens emitted;
  ``/masked_tokens``: completion tokens with mask 0 (``per_rollout``: tool and user turns).
- ``transitions/truncated_calls``: emitted rollouts' matching calls with token ids that stopped
  at the length limit, dropped or not.
- ``transitions/prefix_mismatch/<kind>``: ``per_rollout`` calls that could not extend their
  sequence, by kind (``sequences.classify_mismatch``): ``chat_template``, ``retokenization``,
  ``other``.
- ``transitions/dropped_rollouts/<reason>``: rollouts not emitted, by first reason (above).
- ``transitions/dropped_calls/duplicate``, ``/agent_mismatch``, ``/no_token_ids``,
  ``/truncated``: LLM call spans of *emitted* rollouts that are not trained; with ``/calls``
  they add up to all their LLM call spans.
- ``transitions/duplicate_spans``: re-sent copies of spans among those read (ignored).
- ``transitions/already_built``: rollouts read that earlier builds emitted (skipped).
- ``transitions/spans_read``: span rows read (both copies of a re-sent span count);
  ``/token_files_read``: Parquet files whose token lists were decoded.
- ``transitions/pending_rollouts``: rollouts the next incremental build reads again without a
  new span (``incomplete``, ``small_group``); ``/watermark_unix_nano``: the next watermark.
- ``transitions/build_seconds``: wall time of the build (not the write).
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, field

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lightspan import store
from lightspan.progress import progress
from lightspan.tracing import semconv

from . import watermark as wm
from .advantages import ESTIMATORS
from .config import TransitionsConfig
from .credit import POLICIES, rewards_per_call
from .sequences import MISMATCH_KINDS, merge
from .tokens import Reader, Tokens
from .watermark import Watermark

log = logging.getLogger(__name__)

ROLLOUT_DROP_REASONS = ("split", "duplicate", "incomplete", "failed", "timeout", "time_window",
                        "no_token_ids", "agent_mismatch", "model_version", "truncated", "no_reward",
                        "small_group")
CALL_DROP_REASONS = ("duplicate", "agent_mismatch", "no_token_ids", "truncated")  # _DROPPED_CALLS_SQL order
PENDING_REASONS = ("incomplete", "small_group")
LLM_OPERATIONS = ("chat", "text_completion", "completion", "generate_content")   # as store's llm_calls
TRUNCATED_FINISH = ("length", "max_tokens")

# 1. Rollout keys with a span received after the watermark (row groups are skipped by their
#    received_unix_nano statistics), and the pending ones.
_SCOPE_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_scope AS
SELECT coalesce(rollout_id, trace_id) AS rollout_key FROM {source}
WHERE received_unix_nano > $watermark
UNION
SELECT rollout_key FROM _lrl_pending
"""

# The files holding spans received after the watermark: their token lists are decoded early.
_NEW_FILES_SQL = """
SELECT DISTINCT f.fidx FROM {source} s JOIN _lrl_files f ON f.filename = s.filename
WHERE s.received_unix_nano > $watermark
"""

# The light columns of the spans in scope, with the file and row each came from, so that its
# token lists can be fetched later. Then one row per span: the first copy received.
_SPANS_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_spans AS
SELECT f.fidx, s.file_row_number AS frow, s.trace_id, s.span_id, s.parent_span_id, s.name, s.status_code,
       coalesce(s.rollout_id, s.trace_id) AS rollout_key, s.rollout_id IS NOT NULL AS has_rollout_id,
       s.task_id, s.split, s.start_time_unix_nano AS start_ns,
       coalesce(s.end_time_unix_nano, s.start_time_unix_nano) AS end_ns,
       s.operation_name, s.capture_status, s.finish_reasons[1] AS finish_reason, s.service_name,
       -- the agent this span names, if it is an agent span (step 3)
       coalesce(s.agent_name,
                CASE WHEN s.operation_name = $invoke_agent THEN nullif(trim(substr(s.name, 13)), '') END,
                CASE WHEN s.attributes[$tl_kind] = '"agent"' THEN trim(s.attributes[$tl_entity], '"') END
       ) AS agent_label,
       CASE WHEN s.attributes[$tl_kind] = '"task"' THEN trim(s.attributes[$tl_entity], '"') END AS task_label,
       s.reward, s.model_version, s.temperature, s.received_unix_nano,
       CASE WHEN s.name = $runner THEN s.attributes[$outcome] END AS outcome
FROM {source} s JOIN _lrl_files f ON f.filename = s.filename
{where}
"""

# A task span (a LangGraph node) named after an agent of its rollout runs that agent (step 3).
_TASK_AGENTS_SQL = """
UPDATE _lrl_spans s SET agent_label = s.task_label
FROM (SELECT DISTINCT rollout_key, agent_label FROM _lrl_spans WHERE agent_label IS NOT NULL) a
WHERE s.agent_label IS NULL AND s.task_label IS NOT NULL
  AND a.rollout_key = s.rollout_key AND a.agent_label = s.task_label
"""

# Re-sent spans are rare: find them by a 64-bit hash of their ids first (then exactly), and run
# the window only over them.
_DEDUP_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_copies AS
WITH maybe AS (SELECT hash(trace_id, span_id) AS h FROM _lrl_spans GROUP BY 1 HAVING count(*) > 1)
SELECT trace_id, span_id, count(*) AS copies FROM _lrl_spans
WHERE hash(trace_id, span_id) IN (SELECT h FROM maybe)
GROUP BY ALL HAVING count(*) > 1
"""
_DROP_COPIES_SQL = """
DELETE FROM _lrl_spans WHERE (fidx, frow) IN (
    SELECT (s.fidx, s.frow) FROM _lrl_spans s JOIN _lrl_copies USING (trace_id, span_id)
    QUALIFY row_number() OVER (PARTITION BY s.trace_id, s.span_id
                               ORDER BY s.received_unix_nano, s.fidx, s.frow) > 1)
"""

# 2a. Rollouts and the reasons that need no token list.
_ROLLOUTS_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_rollouts AS
WITH roll AS (
    SELECT rollout_key,
           bool_or(has_rollout_id) AS has_rollout_id,
           bool_or(list_contains($ops::VARCHAR[], operation_name) OR capture_status IS NOT NULL) AS has_llm_span,
           min(task_id) AS task_id,
           coalesce(min(split), 'train') AS split,
           min(start_ns) AS start_ns,
           max(end_ns) AS last_end,
           max(received_unix_nano) AS last_received,
           count(*) FILTER (WHERE name = $runner) AS runner_spans,
           -- the worst outcome among runner spans: 2 timeout, 1 failed (or unknown), 0 ok
           max(CASE coalesce(trim(outcome, '"'), CASE WHEN status_code = 'ERROR' THEN 'failed' ELSE 'ok' END)
                   WHEN 'ok' THEN 0 WHEN 'timeout' THEN 2 ELSE 1 END)
               FILTER (WHERE name = $runner) AS outcome,
           bool_or(name = $root AND status_code = 'ERROR') AS root_error
    FROM _lrl_spans
    GROUP BY 1
), built AS (
    SELECT rollout_id, min(created_unix_nano) AS built_at FROM transitions
    WHERE rollout_id IN (SELECT rollout_key FROM roll) GROUP BY 1
)
SELECT r.rollout_key, r.task_id, r.split, b.built_at IS NOT NULL AS built,
       CASE WHEN r.split <> $split THEN 'split'
            WHEN b.built_at IS NOT NULL AND r.last_received > b.built_at THEN 'duplicate'
            WHEN b.built_at IS NOT NULL THEN 'built'
            WHEN r.runner_spans = 0 AND r.last_end >= $cutoff THEN 'incomplete'
            WHEN r.outcome = 2 THEN 'timeout'
            WHEN r.outcome = 1 OR r.root_error THEN 'failed'
            WHEN r.start_ns < $since::BIGINT OR r.start_ns >= $until::BIGINT THEN 'time_window'
       END AS reason
FROM roll r LEFT JOIN built b ON b.rollout_id = r.rollout_key
WHERE r.has_rollout_id OR r.has_llm_span
"""

# Where the token lists of the candidates' spans are: (file, row), by file.
_TOKEN_ROWS_SQL = """
SELECT s.fidx, s.frow FROM _lrl_spans s JOIN _lrl_rollouts r USING (rollout_key)
WHERE r.reason IS NULL ORDER BY s.fidx, s.frow
"""

# 2b. The candidates' LLM calls (token lengths from _lrl_tok); nested duplicates flagged.
_CALLS_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_calls AS
WITH c AS (
    SELECT s.rollout_key, s.trace_id, s.span_id, s.parent_span_id, s.agent_label AS agent_name,
           s.service_name, s.start_ns, s.end_ns, s.model_version, s.temperature,
           coalesce(list_contains($truncated::VARCHAR[], s.finish_reason), false) AS truncated, t.hpos,
           s.capture_status IS NOT DISTINCT FROM 'duplicate' AS marked_duplicate,
           coalesce(t.plen > 0 AND t.clen > 0 AND t.llen = t.clen, false) AS has_tokens
    FROM _lrl_spans s JOIN _lrl_rollouts r USING (rollout_key)
    LEFT JOIN _lrl_tok t USING (fidx, frow)
    WHERE r.reason IS NULL AND (t.hpos IS NOT NULL OR list_contains($ops::VARCHAR[], s.operation_name))
), kids AS (
    SELECT trace_id, parent_span_id AS span_id, bool_or(has_tokens) AS with_tokens FROM c
    WHERE parent_span_id IS NOT NULL GROUP BY ALL
)
-- of nested calls keep one: the innermost with token ids, else the innermost; and never a span
-- the instrumentor marked as enclosing another call (capture.status = duplicate)
SELECT c.* EXCLUDE (marked_duplicate), coalesce(c.agent_name, c.service_name, '') AS agent_key,
       c.marked_duplicate OR k.span_id IS NOT NULL AND (k.with_tokens OR NOT c.has_tokens)
            OR (NOT c.has_tokens AND coalesce(p.has_tokens, false)) AS duplicate
FROM c LEFT JOIN kids k ON k.trace_id = c.trace_id AND k.span_id = c.span_id
LEFT JOIN c p ON p.trace_id = c.trace_id AND p.span_id = c.parent_span_id
"""

# 3. Each call's agent: the nearest span, itself included, that names one; else service.name.
#    The walk up the parent links runs only for calls that name no agent themselves.
_AGENTS_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_agents AS
WITH RECURSIVE walk(trace_id, span_id, up, agent, depth) AS (
    SELECT trace_id, span_id, parent_span_id, NULL::VARCHAR, 0 FROM _lrl_calls
    WHERE agent_name IS NULL AND parent_span_id IS NOT NULL
    UNION ALL
    SELECT w.trace_id, w.span_id, p.parent_span_id, p.agent_label, w.depth + 1
    FROM walk w JOIN _lrl_spans p ON p.trace_id = w.trace_id AND p.span_id = w.up
    WHERE w.agent IS NULL AND w.up IS NOT NULL AND w.depth < 256
)
SELECT trace_id, span_id, any_value(agent) AS agent FROM walk WHERE agent IS NOT NULL GROUP BY ALL
"""
_AGENT_KEY_SQL = """
UPDATE _lrl_calls c SET agent_key = a.agent FROM _lrl_agents a
WHERE a.trace_id = c.trace_id AND a.span_id = c.span_id
"""

_REWARDS_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_rewards AS
SELECT s.rollout_key, s.end_ns AS time_ns, s.span_id, s.reward
FROM _lrl_spans s JOIN _lrl_rollouts r USING (rollout_key)
WHERE r.reason IS NULL AND s.reward IS NOT NULL AND isfinite(s.reward)
"""

# 2c. The remaining reasons, then group sizes among the rollouts still kept.
_FINAL_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_final AS
WITH calls AS (
    SELECT *, list_contains($agents::VARCHAR[], agent_key) AS matched FROM _lrl_calls WHERE NOT duplicate
), per AS (
    SELECT rollout_key,
           count(*) FILTER (WHERE matched) AS matched,
           count(*) FILTER (WHERE matched AND has_tokens) AS with_tokens,
           count(*) FILTER (WHERE matched AND has_tokens AND NOT (truncated AND $drop_truncated)) AS trainable,
           bool_and(coalesce(($vmin::BIGINT IS NULL OR model_version >= $vmin::BIGINT)
                             AND ($vmax::BIGINT IS NULL OR model_version <= $vmax::BIGINT), false))
               FILTER (WHERE matched AND has_tokens) AS in_versions
    FROM calls GROUP BY rollout_key
), rew AS (
    SELECT rollout_key, count(*) AS num_rewards FROM _lrl_rewards GROUP BY rollout_key
), staged AS (
    SELECT r.rollout_key, r.task_id, r.split,
           coalesce('t:' || r.task_id, 'r:' || r.rollout_key) AS group_key,
           coalesce(r.reason,
                    CASE WHEN p.rollout_key IS NULL THEN 'no_token_ids'
                         WHEN p.matched = 0 THEN 'agent_mismatch'
                         WHEN p.with_tokens = 0 THEN 'no_token_ids'
                         WHEN NOT p.in_versions THEN 'model_version'
                         WHEN p.trainable = 0 THEN 'truncated'
                         WHEN w.num_rewards IS NULL THEN 'no_reward' END) AS reason
    FROM _lrl_rollouts r LEFT JOIN per p USING (rollout_key) LEFT JOIN rew w USING (rollout_key)
)
SELECT rollout_key, task_id, split, group_key,
       CASE WHEN reason IS NULL
                 AND count(*) OVER (PARTITION BY group_key, reason IS NULL) < $min_group_size
            THEN 'small_group' ELSE reason END AS reason
FROM staged
"""

_READY_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_ready AS
SELECT rollout_key, task_id, split,
       (row_number() OVER (ORDER BY rollout_key) - 1)::BIGINT AS ridx,
       (dense_rank() OVER (ORDER BY group_key) - 1)::BIGINT AS gidx
FROM _lrl_final WHERE reason IS NULL
"""

_FETCH_CALLS_SQL = """
SELECT k.ridx, c.rollout_key || '/' || c.span_id AS transition_id, c.rollout_key, k.task_id, k.split,
       nullif(c.agent_key, '') AS agent_name, c.agent_key, c.end_ns, c.model_version, c.temperature, c.hpos,
       c.has_tokens AND NOT (c.truncated AND $drop_truncated) AS emit
FROM _lrl_calls c JOIN _lrl_ready k USING (rollout_key)
WHERE NOT c.duplicate AND list_contains($agents::VARCHAR[], c.agent_key)
ORDER BY k.ridx, c.start_ns, c.end_ns, c.span_id, c.trace_id
"""

_FETCH_REWARDS_SQL = """
SELECT k.ridx, w.time_ns, w.reward
FROM _lrl_rewards w JOIN _lrl_ready k USING (rollout_key)
ORDER BY k.ridx, w.time_ns, w.span_id, w.reward
"""

_DROPPED_CALLS_SQL = """
WITH c AS (
    SELECT c.*, list_contains($agents::VARCHAR[], c.agent_key) AS matched
    FROM _lrl_calls c JOIN _lrl_ready k USING (rollout_key)
)
SELECT count(*) FILTER (WHERE duplicate),
       count(*) FILTER (WHERE NOT duplicate AND NOT matched),
       count(*) FILTER (WHERE NOT duplicate AND matched AND NOT has_tokens),
       count(*) FILTER (WHERE NOT duplicate AND matched AND has_tokens AND truncated AND $drop_truncated),
       count(*) FILTER (WHERE NOT duplicate AND matched AND has_tokens AND truncated)
FROM c
"""

_TEMP_TABLES = ("_lrl_scope", "_lrl_spans", "_lrl_copies", "_lrl_rollouts", "_lrl_calls", "_lrl_agents", "_lrl_rewards", "_lrl_final",
                "_lrl_ready")
_REGISTERED = ("_lrl_files", "_lrl_pending", "_lrl_tok")


def span_files(data_dir) -> list[str]:
    """The Parquet files holding ``data_dir``'s spans, as the ``spans`` view reads them."""
    return [str(p) for p in store.table_files(data_dir, "spans")]


def build_transitions(con: duckdb.DuckDBPyConnection, config: TransitionsConfig, *,
                      now_unix_nano: int | None = None) -> tuple[pa.Table, dict]:
    """Build the transitions of every complete, not yet built rollout of ``config.split``.

    ``con`` has the store's views (``store.connect(config.data_dir)``); spans are read from
    ``config.data_dir``'s Parquet files. Returns a table in exactly ``store.TRANSITION_SCHEMA``
    (empty when nothing is ready) and the build's metrics. Reads every span; nothing is
    written: see :func:`build_incremental` and :func:`run`.
    """
    table, metrics, _ = build_incremental(con, config, Watermark(), now_unix_nano=now_unix_nano)
    return table, metrics


def build_incremental(con: duckdb.DuckDBPyConnection, config: TransitionsConfig, since: Watermark, *,
                      now_unix_nano: int | None = None) -> tuple[pa.Table, dict, Watermark]:
    """:func:`build_transitions` over the rollouts changed since ``since``; also returns the next
    watermark, to be saved (``watermark.save``) once the table is written."""
    t0 = time.perf_counter()
    now = time.time_ns() if now_unix_nano is None else int(now_unix_nano)
    try:
        found = _read(con, config, since, now, span_files(config.data_dir))
    finally:
        for name in _TEMP_TABLES:
            con.execute(f"DROP TABLE IF EXISTS {name}")
        for name in _REGISTERED:
            try:
                con.unregister(name)
            except duckdb.Error:
                pass
    if found.num_rollouts:
        table, stats = _assign(found.calls, found.rewards, found.groups, found.tokens, found.num_rollouts, config, now)
    else:
        table, stats = store.TRANSITION_SCHEMA.empty_table(), _empty_stats()
    # never past spans that may still be on their way to Parquet; never backwards
    lag = now - int(config.watermark_lag_s * 1e9)
    next_mark = Watermark(max(since.received_unix_nano, min(found.newest, lag)), tuple(sorted(found.pending)))

    metrics: dict = {"transitions/rollouts": int(found.num_rollouts), **stats,
                     "transitions/truncated_calls": int(found.truncated_calls)}
    for reason in ROLLOUT_DROP_REASONS:
        metrics[f"transitions/dropped_rollouts/{reason}"] = int(found.drops.get(reason, 0))
    for reason in CALL_DROP_REASONS:
        metrics[f"transitions/dropped_calls/{reason}"] = int(found.dropped_calls[reason] or 0)
    for key, value in found.scan.items():
        metrics[f"transitions/{key}"] = int(value)
    metrics["transitions/pending_rollouts"] = len(next_mark.pending)
    metrics["transitions/watermark_unix_nano"] = next_mark.received_unix_nano
    metrics["transitions/build_seconds"] = time.perf_counter() - t0
    return table, metrics, next_mark


@dataclass
class _Found:
    """What the SQL part of one build found; the defaults are an empty read."""

    scan: dict = field(default_factory=lambda: {
        "spans_read": 0, "duplicate_spans": 0, "token_files_read": 0, "already_built": 0})
    newest: int = -1                 # the latest received_unix_nano read
    drops: dict = field(default_factory=dict)
    dropped_calls: dict = field(default_factory=lambda: dict.fromkeys(CALL_DROP_REASONS, 0))
    truncated_calls: int = 0
    pending: list = field(default_factory=list)
    num_rollouts: int = 0
    calls: pa.Table | None = None
    rewards: pa.Table | None = None
    groups: pa.Table | None = None
    tokens: Tokens | None = None


def _read(con, config: TransitionsConfig, since: Watermark, now: int, files: list[str]) -> _Found:
    """Step 1: the spans in scope, deduplicated, into ``_lrl_spans``; then :func:`_select`."""
    found = _Found(newest=since.received_unix_nano, pending=list(since.pending))
    if not files:
        return found
    source = (f"read_parquet({store.quote_list(files)}, filename=true, file_row_number=true, "
              f"union_by_name=true, hive_partitioning=false)")
    source = f"({store.with_all_columns(con, 'spans', f'SELECT * FROM {source}')})"
    con.register("_lrl_files", pa.table({"filename": files, "fidx": np.arange(len(files))}))
    reader = Reader(files)
    try:
        where = ""
        if since.received_unix_nano >= 0:      # incremental: only what changed
            con.register("_lrl_pending", pa.table({"rollout_key": pa.array(found.pending, pa.string())}))
            con.execute(_SCOPE_SQL.format(source=source), {"watermark": since.received_unix_nano})
            if not con.execute("SELECT count(*) FROM _lrl_scope").fetchall()[0][0]:
                return found
            where = "WHERE coalesce(s.rollout_id, s.trace_id) IN (SELECT rollout_key FROM _lrl_scope)"
            reader.prefetch(f for (f,) in con.execute(_NEW_FILES_SQL.format(source=source),
                                                      {"watermark": since.received_unix_nano}).fetchall())
        else:
            reader.prefetch(range(len(files)))
        # the files' token lists decode in the background while DuckDB reads the light columns
        con.execute(_SPANS_SQL.format(source=source, where=where),
                    {"runner": semconv.SPAN_RUNNER, "outcome": semconv.ROLLOUT_OUTCOME,
                     "invoke_agent": semconv.OPERATION_INVOKE_AGENT, "tl_kind": semconv.TRACELOOP_SPAN_KIND,
                     "tl_entity": semconv.TRACELOOP_ENTITY_NAME})
        read, newest = con.execute("SELECT count(*), max(received_unix_nano) FROM _lrl_spans").fetchall()[0]
        con.execute(_DEDUP_SQL)
        copies = con.execute("SELECT sum(copies - 1) FROM _lrl_copies").fetchall()[0][0]
        if copies:
            con.execute(_DROP_COPIES_SQL)
        con.execute(_TASK_AGENTS_SQL)
        found.scan.update(spans_read=int(read or 0), duplicate_spans=int(copies or 0))
        found.newest = max(found.newest, -1 if newest is None else int(newest))
        _select(con, config, now, reader, found)
    finally:
        reader.close()
    return found


def _select(con, config: TransitionsConfig, now: int, reader: Reader, found: _Found) -> None:
    """Steps 2–5 in SQL over ``_lrl_spans``: the calls, rewards and groups of the ready rollouts."""
    con.execute(_ROLLOUTS_SQL, {
        "runner": semconv.SPAN_RUNNER, "root": semconv.SPAN_ROLLOUT, "split": config.split,
        "ops": list(LLM_OPERATIONS), "cutoff": now - int(config.grace_s * 1e9),
        "since": config.since_unix_nano, "until": config.until_unix_nano})
    found.scan["already_built"] = con.execute("SELECT count(*) FROM _lrl_rollouts WHERE built").fetchall()[0][0]

    where = con.sql(_TOKEN_ROWS_SQL).to_arrow_table()
    fidx = where.column("fidx").to_numpy()
    found.tokens, lengths = reader.read(fidx, where.column("frow").to_numpy())
    found.scan["token_files_read"] = len(np.unique(fidx))
    con.register("_lrl_tok", lengths)
    con.execute(_CALLS_SQL, {"ops": list(LLM_OPERATIONS), "truncated": list(TRUNCATED_FINISH)})
    if con.execute("SELECT count(*) FROM _lrl_calls WHERE agent_name IS NULL").fetchall()[0][0]:
        con.execute(_AGENTS_SQL)
        con.execute(_AGENT_KEY_SQL)
    con.execute(_REWARDS_SQL)
    names = [row[0] for row in con.execute(
        "SELECT DISTINCT agent_key FROM _lrl_calls WHERE NOT duplicate ORDER BY 1").fetchall()]
    pattern = re.compile(config.agent_match)
    agents = [n for n in names if pattern.search(n)] if config.agent_match else names
    con.execute(_FINAL_SQL, {"agents": agents, "min_group_size": config.min_group_size,
                             "drop_truncated": config.drop_truncated,
                             "vmin": config.min_model_version, "vmax": config.max_model_version})
    con.execute(_READY_SQL)
    found.drops = dict(con.execute(
        "SELECT reason, count(*) FROM _lrl_final WHERE reason IS NOT NULL GROUP BY reason").fetchall())
    found.drops.pop("built", None)         # done before: skipped, counted as already_built
    found.pending = [row[0] for row in con.execute(
        "SELECT rollout_key FROM _lrl_final WHERE list_contains($reasons::VARCHAR[], reason)",
        {"reasons": list(PENDING_REASONS)}).fetchall()]
    found.num_rollouts = con.execute("SELECT count(*) FROM _lrl_ready").fetchall()[0][0]
    params = {"agents": agents, "drop_truncated": config.drop_truncated}
    found.calls = con.sql(_FETCH_CALLS_SQL, params=params).to_arrow_table()
    found.rewards = con.sql(_FETCH_REWARDS_SQL).to_arrow_table()
    found.groups = con.sql("SELECT gidx FROM _lrl_ready ORDER BY ridx").to_arrow_table()
    *counts, found.truncated_calls = con.execute(_DROPPED_CALLS_SQL, params).fetchall()[0]
    found.dropped_calls = dict(zip(CALL_DROP_REASONS, counts))


def _empty_stats() -> dict:
    nan = math.nan
    stats = {"transitions/calls": 0, "transitions/sequences": 0, "transitions/groups": 0,
             "transitions/reward_mean": nan, "transitions/reward_std": nan,
             "transitions/return_mean": nan, "transitions/advantage_abs_mean": nan,
             "transitions/nonzero_advantage": 0, "transitions/zero_std_groups": 0,
             "transitions/group_size_mean": nan, "transitions/completion_tokens": 0,
             "transitions/masked_tokens": 0}
    stats.update({f"transitions/prefix_mismatch/{kind}": 0 for kind in MISMATCH_KINDS})
    return stats


def _assign(calls: pa.Table, rewards: pa.Table, groups: pa.Table, tokens: Tokens, num_rollouts: int,
            config: TransitionsConfig, now: int) -> tuple[pa.Table, dict]:
    """Credit and advantages for the ready rollouts' calls (sorted by rollout, then call order),
    then the output rows of ``config.output``."""
    stats = _empty_stats()
    group_of = groups.column("gidx").to_numpy()
    call_ridx = calls.column("ridx").to_numpy()
    reward_ridx = rewards.column("ridx").to_numpy()
    reward_v = rewards.column("reward").to_numpy()
    co = np.searchsorted(call_ridx, np.arange(num_rollouts + 1))
    ro = np.searchsorted(reward_ridx, np.arange(num_rollouts + 1))

    final = reward_v[ro[1:] - 1]     # R_i: the rollout's last reward by time (each has one)
    r_t = rewards_per_call(calls.column("end_ns").to_numpy(), rewards.column("time_ns").to_numpy(), reward_v,
                           call_rollout=call_ridx, reward_rollout=reward_ridx)
    credit = POLICIES[config.credit](r_t, final, config.gamma, rollout_index=call_ridx)
    ret = credit[co[:-1]]            # the return from the first action: R (identical), G_0 (discounted)
    advantage = ESTIMATORS[config.advantage](ret, group_of, epsilon=config.epsilon,
                                             credit=credit, rollout_index=call_ridx)

    emit = calls.column("emit").to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(emit)
    kept_ridx = call_ridx[rows]
    num_calls = np.bincount(kept_ridx, minlength=num_rollouts)
    call_index = np.arange(len(rows)) - np.searchsorted(kept_ridx, kept_ridx, side="left")
    version = calls.column("model_version").cast(pa.float64()).to_numpy(zero_copy_only=False)[rows]

    first, lists, seq_version, masked = _OUTPUTS[config.output](calls, tokens, rows, kept_ridx, version, stats)
    prompt, completion, logprobs, mask = lists

    out = calls.take(pa.array(rows[first]))
    n = len(first)
    seq_ridx = kept_ridx[first]
    columns = {
        "transition_id": out.column("transition_id"),
        "rollout_id": out.column("rollout_key"),
        "task_id": out.column("task_id"),
        "split": out.column("split"),
        "agent_name": out.column("agent_name"),
        "call_index": pa.array(call_index[first], pa.int32()),
        "num_calls": pa.array(num_calls[seq_ridx], pa.int32()),
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "completion_logprobs": logprobs,
        "model_version": pa.array(seq_version, pa.float64(), from_pandas=True).cast(pa.int64()),
        "temperature": out.column("temperature"),
        "reward": pa.array(final[seq_ridx], pa.float64()),
        "credit": pa.array(credit[rows[first]], pa.float64()),
        "advantage": pa.array(advantage[rows[first]], pa.float64()),
        "credit_policy": pa.array([config.credit] * n, pa.string()),
        "advantage_estimator": pa.array([config.advantage] * n, pa.string()),
        "build_id": pa.array([uuid.uuid4().hex] * n, pa.string()),
        "created_unix_nano": pa.array(np.full(n, now, dtype=np.int64), pa.int64()),
        "completion_mask": mask,
    }
    table = pa.table({f.name: columns[f.name].cast(f.type) for f in store.TRANSITION_SCHEMA},
                     schema=store.TRANSITION_SCHEMA)

    adv = advantage[np.sort(rows[first])]      # call order: sums do not depend on the files
    sizes = np.bincount(group_of)
    high, low = np.full(len(sizes), -np.inf), np.full(len(sizes), np.inf)
    np.maximum.at(high, group_of, ret)
    np.minimum.at(low, group_of, ret)
    stats.update({
        "transitions/calls": len(rows),
        "transitions/sequences": n,
        "transitions/groups": len(sizes),
        "transitions/reward_mean": float(final.mean()),
        "transitions/reward_std": float(final.std()),
        "transitions/return_mean": float(ret.mean()),
        "transitions/advantage_abs_mean": float(np.abs(adv).mean()) if n else math.nan,
        "transitions/nonzero_advantage": int(np.count_nonzero(adv)),
        "transitions/zero_std_groups": int(np.sum(high == low)),  # every advantage 0 under identical
        "transitions/group_size_mean": float(sizes.mean()),
        "transitions/completion_tokens": int(pc.sum(pc.list_value_length(completion)).as_py() or 0) - masked,
        "transitions/masked_tokens": masked,
    })
    return table, stats


def _per_call(calls, tokens: Tokens, rows, kept_ridx, version, stats):
    """One row per emitted call, in the order the token lists were read (one copy, or none)."""
    hpos = _hpos(calls, rows)
    first = np.argsort(hpos, kind="stable")
    lists = [tokens.take(c, hpos[first]) for c in ("prompt_token_ids", "completion_token_ids", "completion_logprobs")]
    return first, lists + [pa.nulls(len(rows), pa.list_(pa.int8()))], version[first], 0


def _per_rollout(calls, tokens: Tokens, rows, kept_ridx, version, stats):
    """One row per sequence of one rollout and agent (:func:`.sequences.merge`), in call order."""
    hpos = _hpos(calls, rows)
    agent = pc.dictionary_encode(calls.column("agent_key")).combine_chunks().indices.to_numpy()[rows]
    order = np.lexsort((np.arange(len(rows)), agent, kept_ridx))      # an agent's calls together
    m = merge(tokens.flat("prompt_token_ids", np.int32), tokens.flat("completion_token_ids", np.int32),
              tokens.flat("completion_logprobs", np.float32), tokens.base,
              hpos[order], kept_ridx[order] * (int(agent.max(initial=0)) + 1) + agent[order])
    stats.update({f"transitions/prefix_mismatch/{k}": v for k, v in m.mismatches.items()})
    first = order[m.first]
    offsets = pa.array(m.offsets)
    lists = [tokens.take("prompt_token_ids", hpos[first])] + [
        pa.ListArray.from_arrays(offsets, pa.array(values)) for values in (m.tokens, m.logprobs, m.mask)]
    # the oldest policy version among a sequence's calls (NaN, i.e. unknown, if any is unknown)
    seq_version = np.minimum.reduceat(version[order], m.first) if len(first) else version[:0]
    return first, lists, seq_version, len(m.mask) - int(m.mask.sum())


_OUTPUTS = {"per_call": _per_call, "per_rollout": _per_rollout}
"""The output modes (config ``output``): (calls, tokens, rows, ...) -> (first call of each row, the
four list columns, model version, masked tokens)."""


def _hpos(calls: pa.Table, rows: np.ndarray) -> np.ndarray:
    """Where the token lists of the calls ``rows`` are in the build's :class:`.tokens.Tokens`."""
    return calls.column("hpos").to_numpy(zero_copy_only=False)[rows].astype(np.int64)



def run(config: TransitionsConfig, *, now_unix_nano: int | None = None) -> dict:
    """One build over ``config.data_dir``: write the new transitions (if any), then (incremental)
    the watermark, and return the metrics. A crash in between costs a re-read, never a duplicate."""
    since = wm.load(config) if config.incremental else Watermark()

    def build():
        con = store.connect(config.data_dir)
        try:
            return build_incremental(con, config, since, now_unix_nano=now_unix_nano)
        finally:
            con.close()

    with progress(f"transitions build ({config.split})") as bar:
        table, metrics, next_mark = store.retry_vanished(build)
        bar.update(f"{metrics['transitions/rollouts']} rollouts, {table.num_rows} rows, "
                   f"{metrics['transitions/spans_read']} spans read")
        bar.advance(table.num_rows)
    if table.num_rows:
        path = store.write_table(config.data_dir, "transitions", table)
        log.info("wrote %d transitions (%d calls) of %d rollouts in %d groups to %s (reward mean %.4f)",
                 table.num_rows, metrics["transitions/calls"], metrics["transitions/rollouts"],
                 metrics["transitions/groups"], path, metrics["transitions/reward_mean"])
    else:
        log.info("no complete rollout to build in %s (%d spans read)", config.data_dir,
                 metrics["transitions/spans_read"])
    if config.incremental and next_mark != since:
        wm.save(config, next_mark)
    dropped = {k.removeprefix("transitions/"): v for k, v in metrics.items()
               if k.startswith("transitions/dropped_") and v}
    if dropped:
        log.info("dropped: %s", ", ".join(f"{k}={v}" for k, v in sorted(dropped.items())))
    return metrics

