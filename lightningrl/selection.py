"""The SQL part of a build: the spans in scope, the rollouts kept and why the others are not, and
the calls, rewards and groups of the ready rollouts, read from Parquet with DuckDB.

Steps 1-4 of the build (lightningrl/builder.py's module docstring): :func:`read_spans` takes the
light span columns of the rollouts in scope into temp tables (``_lrl_*``), deduplicates
re-sent spans, has the token lists of the candidates' spans decoded (:mod:`.tokens`, in
background threads while DuckDB works) and leaves in a :class:`Found` what the assignment
(:mod:`.assignment`) needs: the calls in action order, the rewards and the group of each ready
rollout, the drop counts and the rollouts still pending. :func:`drop_temp` removes the temp
tables and registered arrays from the connection afterwards.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import duckdb
import numpy as np
import pyarrow as pa

from lightspan import store
from lightspan.store.policies import owner
from lightspan.tracing import semconv

from .config import TransitionsConfig
from .tokens import Reader, Tokens
from .watermark import Watermark

ROLLOUT_DROP_REASONS = ("split", "duplicate", "incomplete", "failed", "timeout", "time_window",
                        "no_token_ids", "agent_mismatch", "other_policy", "model_version", "truncated",
                        "no_reward", "small_group")
CALL_DROP_REASONS = ("duplicate", "agent_mismatch", "no_token_ids", "other_policy",
                     "truncated")  # _DROPPED_CALLS_SQL order
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
       s.reward, s.model_version, s.policy AS served_policy, s.temperature, s.received_unix_nano,
       CASE WHEN s.name = $runner THEN s.attributes[$outcome] END AS outcome,
       -- a reward that scores one call (a person's, in the web UI) names it
       CASE WHEN s.reward IS NOT NULL THEN json_extract_string(s.attributes[$reward_call], '$') END AS reward_call
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
    -- built for this policy (the pass's; null: the unnamed one)
    SELECT rollout_id, min(created_unix_nano) AS built_at FROM transitions
    WHERE rollout_id IN (SELECT rollout_key FROM roll) AND policy IS NOT DISTINCT FROM $policy::VARCHAR
    GROUP BY 1
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
           s.service_name, s.start_ns, s.end_ns, s.model_version, s.served_policy, s.temperature,
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
-- a reward naming a call counts at that call's end, so it is the call's reward (credit.rewards_per_call)
SELECT s.rollout_key, coalesce(c.end_ns, s.end_ns) AS time_ns, s.span_id, s.reward,
       s.reward_call IS NOT NULL AS per_call
FROM _lrl_spans s JOIN _lrl_rollouts r USING (rollout_key)
LEFT JOIN _lrl_spans c ON c.span_id = s.reward_call AND c.rollout_key = s.rollout_key
WHERE r.reason IS NULL AND s.reward IS NOT NULL AND isfinite(s.reward)
"""

# 2c. The remaining reasons, then group sizes among the rollouts still kept.
_FINAL_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_final AS
WITH calls AS (
    SELECT *, list_contains($agents::VARCHAR[], agent_key) AS matched, {own} AS own
    FROM _lrl_calls WHERE NOT duplicate
), per AS (
    SELECT rollout_key,
           count(*) FILTER (WHERE matched) AS matched,
           count(*) FILTER (WHERE matched AND has_tokens) AS with_tokens,
           count(*) FILTER (WHERE matched AND has_tokens AND own) AS served_here,
           count(*) FILTER (WHERE matched AND has_tokens AND own AND NOT (truncated AND $drop_truncated)) AS trainable,
           bool_and(coalesce(($vmin::BIGINT IS NULL OR model_version >= $vmin::BIGINT)
                             AND ($vmax::BIGINT IS NULL OR model_version <= $vmax::BIGINT), false))
               FILTER (WHERE matched AND has_tokens AND own) AS in_versions
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
                         WHEN p.served_here = 0 THEN 'other_policy'
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
       c.has_tokens AND {own} AND NOT (c.truncated AND $drop_truncated) AS emit
FROM _lrl_calls c JOIN _lrl_ready k USING (rollout_key)
WHERE NOT c.duplicate AND list_contains($agents::VARCHAR[], c.agent_key)
ORDER BY k.ridx, c.start_ns, c.end_ns, c.span_id, c.trace_id
"""

_FETCH_REWARDS_SQL = """
SELECT k.ridx, w.time_ns, w.reward, w.per_call
FROM _lrl_rewards w JOIN _lrl_ready k USING (rollout_key)
ORDER BY k.ridx, w.time_ns, w.span_id, w.reward
"""

_DROPPED_CALLS_SQL = """
WITH c AS (
    SELECT c.*, list_contains($agents::VARCHAR[], c.agent_key) AS matched, {own} AS own
    FROM _lrl_calls c JOIN _lrl_ready k USING (rollout_key)
)
SELECT count(*) FILTER (WHERE duplicate),
       count(*) FILTER (WHERE NOT duplicate AND NOT matched),
       count(*) FILTER (WHERE NOT duplicate AND matched AND NOT has_tokens),
       count(*) FILTER (WHERE NOT duplicate AND matched AND has_tokens AND NOT own),
       count(*) FILTER (WHERE NOT duplicate AND matched AND has_tokens AND own AND truncated AND $drop_truncated),
       count(*) FILTER (WHERE NOT duplicate AND matched AND has_tokens AND own AND truncated)
FROM c
"""

# A call served by another named policy (lightspan.policy.name) is not this policy's sample: its
# logprobs are another adapter's. A call that records no policy is its owner's.
_OWN = "($policy::VARCHAR IS NULL OR c.served_policy IS NULL OR c.served_policy = $policy::VARCHAR)"
_FINAL_SQL = _FINAL_SQL.replace("{own}", _OWN.replace("c.", ""))
_FETCH_CALLS_SQL = _FETCH_CALLS_SQL.replace("{own}", _OWN)
_DROPPED_CALLS_SQL = _DROPPED_CALLS_SQL.replace("{own}", _OWN)

_UNOWNED_SQL = """
SELECT c.rollout_key || '/' || c.span_id FROM _lrl_calls c JOIN _lrl_ready k USING (rollout_key)
WHERE NOT c.duplicate AND NOT list_contains($owned::VARCHAR[], c.agent_key)
"""

_TEMP_TABLES = ("_lrl_scope", "_lrl_spans", "_lrl_copies", "_lrl_rollouts", "_lrl_calls", "_lrl_agents", "_lrl_rewards", "_lrl_final",
                "_lrl_ready")
_REGISTERED = ("_lrl_files", "_lrl_pending", "_lrl_tok")


def span_files(data_dir) -> list[str]:
    """The Parquet files holding ``data_dir``'s spans, as the ``spans`` view reads them."""
    return [str(p) for p in store.table_files(data_dir, "spans")]


@dataclass(frozen=True)
class Pass:
    """One policy's share of a build: its name (None: the unnamed policy of every matching call) and
    which attributed agents it owns."""

    policy: str | None
    owns: Callable[[str], bool]
    owned_by_any: Callable[[str], bool] = bool     # whether some policy owns the agent (policies only)


@dataclass
class Found:
    """What the SQL part of one build found for one :class:`Pass`; the defaults are an empty read."""

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
    unowned: set = field(default_factory=set)   # ids of emitted rollouts' calls no policy owns


def passes(config: TransitionsConfig) -> list[Pass]:
    """The build's passes: one per configured policy, else one of the calls ``agent_match`` selects."""
    if not config.policy_configs:
        pattern = re.compile(config.agent_match)
        return [Pass(None, (lambda name: bool(pattern.search(name))) if config.agent_match else (lambda name: True))]
    policies = tuple(p for p, _ in config.policy_configs)
    # owner() raises ConfigError for an agent two agent_match patterns claim
    return [Pass(p.name, lambda name, p=p: owner(policies, name) is p, lambda name: owner(policies, name) is not None)
            for p in policies]


def read_spans(con, config: TransitionsConfig, since: Watermark, now: int, files: list[str],
               passes: list[Pass]) -> list[Found]:
    """Step 1: the spans in scope, deduplicated, into ``_lrl_spans``; then :func:`_select` for each
    of ``passes`` (its steps 2-5 over the same spans; token lists are decoded once).
    ``files``: the span files to read (:func:`span_files`); ``now``: the build's time."""
    found = Found(newest=since.received_unix_nano, pending=list(since.pending))
    if not files:
        return [dataclasses.replace(found, pending=list(found.pending)) for _ in passes]
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
                return [dataclasses.replace(found, pending=list(found.pending)) for _ in passes]
            where = "WHERE coalesce(s.rollout_id, s.trace_id) IN (SELECT rollout_key FROM _lrl_scope)"
            reader.prefetch(f for (f,) in con.execute(_NEW_FILES_SQL.format(source=source),
                                                      {"watermark": since.received_unix_nano}).fetchall())
        else:
            reader.prefetch(range(len(files)))
        # the files' token lists decode in the background while DuckDB reads the light columns
        con.execute(_SPANS_SQL.format(source=source, where=where),
                    {"runner": semconv.SPAN_RUNNER, "outcome": semconv.ROLLOUT_OUTCOME,
                     "invoke_agent": semconv.OPERATION_INVOKE_AGENT, "tl_kind": semconv.TRACELOOP_SPAN_KIND,
                     "tl_entity": semconv.TRACELOOP_ENTITY_NAME, "reward_call": semconv.REWARD_CALL_SPAN_ID})
        read, newest = con.execute("SELECT count(*), max(received_unix_nano) FROM _lrl_spans").fetchall()[0]
        con.execute(_DEDUP_SQL)
        copies = con.execute("SELECT sum(copies - 1) FROM _lrl_copies").fetchall()[0][0]
        if copies:
            con.execute(_DROP_COPIES_SQL)
        con.execute(_TASK_AGENTS_SQL)
        found.scan.update(spans_read=int(read or 0), duplicate_spans=int(copies or 0))
        found.newest = max(found.newest, -1 if newest is None else int(newest))
        out = []
        for p in passes:
            mine = dataclasses.replace(found, scan=dict(found.scan), pending=list(found.pending))
            _select(con, config, now, reader, mine, p)
            out.append(mine)
    finally:
        reader.close()
    return out


def _select(con, config: TransitionsConfig, now: int, reader: Reader, found: Found, p: Pass) -> None:
    """Steps 2–5 in SQL over ``_lrl_spans``: the calls, rewards and groups of the ready rollouts of
    pass ``p`` (its policy's agents)."""
    con.execute(_ROLLOUTS_SQL, {
        "runner": semconv.SPAN_RUNNER, "root": semconv.SPAN_ROLLOUT, "split": config.split, "policy": p.policy,
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
    agents = [n for n in names if p.owns(n)]
    owned = [n for n in names if p.owned_by_any(n)] if p.policy is not None else []
    con.execute(_FINAL_SQL, {"agents": agents, "policy": p.policy, "min_group_size": config.min_group_size,
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
    params = {"agents": agents, "policy": p.policy, "drop_truncated": config.drop_truncated}
    found.calls = con.sql(_FETCH_CALLS_SQL, params=params).to_arrow_table()
    found.rewards = con.sql(_FETCH_REWARDS_SQL).to_arrow_table()
    found.groups = con.sql("SELECT gidx FROM _lrl_ready ORDER BY ridx").to_arrow_table()
    *counts, found.truncated_calls = con.execute(_DROPPED_CALLS_SQL, params).fetchall()[0]
    found.dropped_calls = dict(zip(CALL_DROP_REASONS, counts))
    if p.policy is not None:     # calls of agents no policy owns, counted once however many passes see them
        found.unowned = {row[0] for row in con.execute(_UNOWNED_SQL, {"owned": owned}).fetchall()}


def drop_temp(con: duckdb.DuckDBPyConnection) -> None:
    """Remove what :func:`read_spans` left on ``con``: its temp tables and registered arrays."""
    for name in _TEMP_TABLES:
        con.execute(f"DROP TABLE IF EXISTS {name}")
    for name in _REGISTERED:
        try:
            con.unregister(name)
        except duckdb.Error:
            pass
