"""The DuckDB queries of a build's selection (lightningrl/selection.py runs them, in this order).

Each works on the temp tables (``_lrl_*``) the ones before it made; ``$name`` parameters are
bound by the caller. A call counts for a policy by ``OWN``: one served by another named policy
(``lightspan.policy.name``) carries another adapter's logprobs.
"""

# 1. Rollout keys with a span received after the watermark (row groups are skipped by their
#    received_unix_nano statistics), and the pending ones.
SCOPE_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_scope AS
SELECT coalesce(rollout_id, trace_id) AS rollout_key FROM {source}
WHERE received_unix_nano > $watermark
UNION
SELECT rollout_key FROM _lrl_pending
"""

# The files holding spans received after the watermark: their token lists are decoded early.
NEW_FILES_SQL = """
SELECT DISTINCT f.fidx FROM {source} s JOIN _lrl_files f ON f.filename = s.filename
WHERE s.received_unix_nano > $watermark
"""

# The light columns of the spans in scope, with the file and row each came from, so that its
# token lists can be fetched later. Then one row per span: the first copy received.
SPANS_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_spans AS
SELECT f.fidx, s.file_row_number AS frow, s.trace_id, s.span_id, s.parent_span_id, s.name, s.status_code,
       coalesce(s.rollout_id, s.trace_id) AS rollout_key, s.rollout_id IS NOT NULL AS has_rollout_id,
       s.task_id, s.split, s.start_time_unix_nano AS start_ns,
       coalesce(s.end_time_unix_nano, s.start_time_unix_nano) AS end_ns,
       s.operation_name, s.capture_status, s.finish_reasons[1] AS finish_reason, s.service_name,
       -- the agent this span names, if it is an agent span (step 3)
       coalesce(s.agent_name,
                -- an invoke_agent span (or, before GenAI conventions v0.1.0, invoke_workflow) named
                -- "<operation> <name>"
                CASE WHEN s.operation_name IN ($invoke_agent, $invoke_workflow)
                     THEN nullif(trim(substr(s.name, length(s.operation_name) + 1)), '') END,
                CASE WHEN s.attributes[$tl_kind] = '"agent"' THEN trim(s.attributes[$tl_entity], '"') END
       ) AS agent_label,
       CASE WHEN s.attributes[$tl_kind] = '"task"' THEN trim(s.attributes[$tl_entity], '"') END AS task_label,
       s.reward, s.model_version, s.policy AS served_policy, s.temperature, s.received_unix_nano,
       CASE WHEN s.name = $runner THEN s.attributes[$outcome] END AS outcome,
       -- a reward that scores one call (a person's, in the web UI) names it
       CASE WHEN s.reward IS NOT NULL THEN json_extract_string(s.attributes[$reward_call], '$') END AS reward_call,
       -- turn_select_sql over the span's columns (true without one)
       {selected} AS selected
FROM {source} s JOIN _lrl_files f ON f.filename = s.filename
{where}
"""

# A task span (a LangGraph node) named after an agent of its rollout runs that agent (step 3).
TASK_AGENTS_SQL = """
UPDATE _lrl_spans s SET agent_label = s.task_label
FROM (SELECT DISTINCT rollout_key, agent_label FROM _lrl_spans WHERE agent_label IS NOT NULL) a
WHERE s.agent_label IS NULL AND s.task_label IS NOT NULL
  AND a.rollout_key = s.rollout_key AND a.agent_label = s.task_label
"""

# Re-sent spans are rare: find them by a 64-bit hash of their ids first (then exactly), and run
# the window only over them.
DEDUP_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_copies AS
WITH maybe AS (SELECT hash(trace_id, span_id) AS h FROM _lrl_spans GROUP BY 1 HAVING count(*) > 1)
SELECT trace_id, span_id, count(*) AS copies FROM _lrl_spans
WHERE hash(trace_id, span_id) IN (SELECT h FROM maybe)
GROUP BY ALL HAVING count(*) > 1
"""
DROP_COPIES_SQL = """
DELETE FROM _lrl_spans WHERE (fidx, frow) IN (
    SELECT (s.fidx, s.frow) FROM _lrl_spans s JOIN _lrl_copies USING (trace_id, span_id)
    QUALIFY row_number() OVER (PARTITION BY s.trace_id, s.span_id
                               ORDER BY s.received_unix_nano, s.fidx, s.frow) > 1)
"""

# 2a. Rollouts and the reasons that need no token list.
ROLLOUTS_SQL = """
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
           -- the worst outcome among runner spans: 3 infra, 2 timeout, 1 failed (or unknown), 0 ok
           max(CASE coalesce(trim(outcome, '"'), CASE WHEN status_code = 'ERROR' THEN 'failed' ELSE 'ok' END)
                   WHEN 'ok' THEN 0 WHEN 'timeout' THEN 2 WHEN 'infra' THEN 3 ELSE 1 END)
               FILTER (WHERE name = $runner) AS outcome,
           bool_or(name = $root AND status_code = 'ERROR') AS root_error
    FROM _lrl_spans
    GROUP BY 1
), built AS (
    -- built for this policy (the pass's; null: the unnamed one)
    SELECT rollout_id, min(created_unix_nano) AS built_at FROM transitions
    WHERE rollout_id IN (SELECT rollout_key FROM roll) AND policy IS NOT DISTINCT FROM $policy::VARCHAR
    GROUP BY 1
), caused AS (
    -- why it did not end ok (config.CAUSES), if it did not
    SELECT *, CASE WHEN outcome = 3 THEN 'infra' WHEN outcome = 2 THEN 'timeout'
                   WHEN outcome = 1 OR root_error THEN 'failed' END AS cause
    FROM roll
)
SELECT r.rollout_key, r.task_id, r.split, b.built_at IS NOT NULL AS built, r.cause,
       CASE WHEN r.split <> $split THEN 'split'
            WHEN b.built_at IS NOT NULL AND r.last_received > b.built_at THEN 'duplicate'
            WHEN b.built_at IS NOT NULL THEN 'built'
            WHEN r.runner_spans = 0 AND r.last_end >= $cutoff THEN 'incomplete'
            -- the causes the config's outcomes drop (the others train as failed or masked)
            WHEN list_contains($dropped::VARCHAR[], r.cause) THEN r.cause
            WHEN r.start_ns < $since::BIGINT OR r.start_ns >= $until::BIGINT THEN 'time_window'
       END AS reason
FROM caused r LEFT JOIN built b ON b.rollout_id = r.rollout_key
WHERE r.has_rollout_id OR r.has_llm_span
"""

# Where the token lists of the candidates' spans are: (file, row), by file.
TOKEN_ROWS_SQL = """
SELECT s.fidx, s.frow FROM _lrl_spans s JOIN _lrl_rollouts r USING (rollout_key)
WHERE r.reason IS NULL ORDER BY s.fidx, s.frow
"""

# 2b. The candidates' LLM calls (token lengths from _lrl_tok); nested duplicates flagged.
CALLS_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_calls AS
WITH c AS (
    SELECT s.rollout_key, s.trace_id, s.span_id, s.parent_span_id, s.agent_label AS agent_name,
           s.service_name, s.start_ns, s.end_ns, s.model_version, s.served_policy, s.temperature,
           coalesce(list_contains($truncated::VARCHAR[], s.finish_reason), false) AS truncated, t.hpos,
           s.capture_status IS NOT DISTINCT FROM 'duplicate' AS marked_duplicate,
           coalesce(t.plen > 0 AND t.clen > 0 AND t.llen = t.clen, false) AS has_tokens, s.selected
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
AGENTS_SQL = """
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
AGENT_KEY_SQL = """
UPDATE _lrl_calls c SET agent_key = a.agent FROM _lrl_agents a
WHERE a.trace_id = c.trace_id AND a.span_id = c.span_id
"""

REWARDS_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_rewards AS
-- a reward naming a call counts at that call's end, so it is the call's reward (credit.rewards_per_call);
-- received_ns, when the collector received it, orders the rewards (the last is final: store.REWARD_ORDER)
SELECT s.rollout_key, coalesce(c.end_ns, s.end_ns) AS time_ns, s.span_id, s.reward,
       s.reward_call IS NOT NULL AS per_call, coalesce(s.received_unix_nano, s.end_ns) AS received_ns
FROM _lrl_spans s JOIN _lrl_rollouts r USING (rollout_key)
LEFT JOIN _lrl_spans c ON c.span_id = s.reward_call AND c.rollout_key = s.rollout_key
WHERE r.reason IS NULL AND s.reward IS NOT NULL AND isfinite(s.reward)
"""

# 2c. The remaining reasons, then group sizes among the rollouts still kept.
FINAL_SQL = """
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
           count(*) FILTER (WHERE matched AND has_tokens AND own AND NOT (truncated AND $drop_truncated)
                            AND selected) AS selected,
           bool_and(coalesce(($vmin::BIGINT IS NULL OR model_version >= $vmin::BIGINT)
                             AND ($vmax::BIGINT IS NULL OR model_version <= $vmax::BIGINT), false))
               FILTER (WHERE matched AND has_tokens AND own) AS in_versions
    FROM calls GROUP BY rollout_key
), rew AS (
    SELECT rollout_key, count(*) AS num_rewards FROM _lrl_rewards GROUP BY rollout_key
), staged AS (
    SELECT r.rollout_key, r.task_id, r.split, r.cause,
           CASE WHEN $group_by = 'batch' THEN 'b:' || coalesce(r.split, '')
                ELSE coalesce('t:' || r.task_id, 'r:' || r.rollout_key) END AS group_key,
           coalesce(r.reason,
                    CASE WHEN p.rollout_key IS NULL THEN 'no_token_ids'
                         WHEN p.matched = 0 THEN 'agent_mismatch'
                         WHEN p.with_tokens = 0 THEN 'no_token_ids'
                         WHEN p.served_here = 0 THEN 'other_policy'
                         WHEN NOT p.in_versions THEN 'model_version'
                         WHEN p.trainable = 0 THEN 'truncated'
                         WHEN p.selected = 0 THEN 'not_selected'
                         WHEN w.num_rewards IS NULL THEN 'no_reward' END) AS reason
    FROM _lrl_rollouts r LEFT JOIN per p USING (rollout_key) LEFT JOIN rew w USING (rollout_key)
)
SELECT rollout_key, task_id, split, group_key, cause,
       CASE WHEN reason IS NULL
                 AND count(*) OVER (PARTITION BY group_key, reason IS NULL) < $min_group_size
            THEN 'small_group' ELSE reason END AS reason
FROM staged
"""

READY_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_ready AS
SELECT rollout_key, task_id, split,
       -- how it trains (config.TRAIN_OUTCOMES): ok, or what the config's outcomes make of its cause
       CASE WHEN cause IS NULL THEN 'ok' WHEN list_contains($masked::VARCHAR[], cause) THEN 'masked'
            ELSE 'failed' END AS outcome,
       (row_number() OVER (ORDER BY rollout_key) - 1)::BIGINT AS ridx,
       (dense_rank() OVER (ORDER BY group_key) - 1)::BIGINT AS gidx
FROM _lrl_final WHERE reason IS NULL
"""

FETCH_CALLS_SQL = """
SELECT k.ridx, c.rollout_key || '/' || c.span_id AS transition_id, c.rollout_key, k.task_id, k.split,
       nullif(c.agent_key, '') AS agent_name, c.agent_key, c.end_ns, c.model_version, c.temperature, c.hpos,
       c.has_tokens AND {own} AND NOT (c.truncated AND $drop_truncated) AS emit, c.selected
FROM _lrl_calls c JOIN _lrl_ready k USING (rollout_key)
WHERE NOT c.duplicate AND list_contains($agents::VARCHAR[], c.agent_key)
ORDER BY k.ridx, c.start_ns, c.end_ns, c.span_id, c.trace_id
"""

FETCH_REWARDS_SQL = """
SELECT k.ridx, w.time_ns, w.reward, w.per_call
FROM _lrl_rewards w JOIN _lrl_ready k USING (rollout_key)
ORDER BY k.ridx, w.received_ns, w.time_ns, w.span_id, w.reward
"""

DROPPED_CALLS_SQL = """
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
OWN = "($policy::VARCHAR IS NULL OR c.served_policy IS NULL OR c.served_policy = $policy::VARCHAR)"
FINAL_SQL = FINAL_SQL.replace("{own}", OWN.replace("c.", ""))
FETCH_CALLS_SQL = FETCH_CALLS_SQL.replace("{own}", OWN)
DROPPED_CALLS_SQL = DROPPED_CALLS_SQL.replace("{own}", OWN)

UNOWNED_SQL = """
SELECT c.rollout_key || '/' || c.span_id FROM _lrl_calls c JOIN _lrl_ready k USING (rollout_key)
WHERE NOT c.duplicate AND NOT list_contains($owned::VARCHAR[], c.agent_key)
"""

TEMP_TABLES = ("_lrl_scope", "_lrl_spans", "_lrl_copies", "_lrl_rollouts", "_lrl_calls", "_lrl_agents", "_lrl_rewards", "_lrl_final",
                "_lrl_ready")
REGISTERED = ("_lrl_files", "_lrl_pending", "_lrl_tok")
