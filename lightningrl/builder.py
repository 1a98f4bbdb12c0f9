"""The transition builder: spans in, LightningRL transitions and a metrics dict out (DESIGN.md §3.4).

The set-based work is SQL over the store's DuckDB views; Python only walks per-rollout numpy
arrays through the pure credit and advantage functions. One build:

1. Rollouts (``spans`` grouped by rollout key = rollout id, else trace id) of ``config.split``
   (a rollout with no split is ``train``) that have an LLM call or a rollout id, and that
   have no row yet in ``transitions`` — so a build never emits a rollout twice.
2. Each is kept or dropped with the first reason that applies, in this order:
   ``incomplete`` (no ``lightspan.runner`` end span and a span that ended within ``grace_s``;
   it is reconsidered next build), ``timeout`` / ``failed`` (the runner's outcome; a runner
   span without the outcome attribute is failed iff its status is ERROR; a
   ``lightspan.rollout`` root span with status ERROR is also failed), ``no_token_ids`` (no LLM
   call at all), ``agent_mismatch`` (no call of an agent matching ``agent_match``),
   ``no_token_ids`` (no matching call with token ids), ``no_reward`` (no finite reward),
   ``small_group`` (fewer than ``min_group_size`` rollouts of its task left in this build).
3. A group is the rollouts of one task among those kept in this build (a rollout without a
   task id is a group of its own). Rollouts already built or still incomplete never join a
   later group: a straggler that completes after its siblings were built is a group of one.
4. A rollout's actions are its calls of a matching agent, ordered by (start, end, span id).
   Rewards are matched to them (``credit.rewards_per_call``), the credit policy gives one
   credit per call, the estimator gives per-call advantages against the group's rollout
   returns (``identical``: the final reward; ``discounted``: G_0). Calls without token ids
   (missing prompt or completion ids, or logprobs missing or not one per completion token)
   keep their place in the credit computation but are not emitted.

Drop counts are per build: a rollout that stays unbuilt (incomplete, small group, no reward
yet) is counted again by the next build. Two builds must not run at once on one data dir.

Metrics (one build):

- ``transitions/rollouts``, ``/calls``, ``/groups``: rollouts, transitions (LLM calls) and
  task groups emitted; ``/group_size_mean``: rollouts per emitted group.
- ``transitions/reward_mean``, ``/reward_std``: the emitted rollouts' final rewards;
  ``/return_mean``: the rollout returns the baselines use (= reward_mean under ``identical``);
  ``/advantage_abs_mean``: mean |Â| over transitions (NaN when nothing was emitted).
- ``transitions/nonzero_advantage``: transitions that carry a gradient (|Â| > 0).
- ``transitions/zero_std_groups``: groups whose returns are all equal, so they carry no
  rollout-level learning signal (every Â is 0 under ``identical``).
- ``transitions/completion_tokens``: completion tokens in the emitted transitions.
- ``transitions/dropped_rollouts/<reason>``: rollouts not emitted, by first reason (above).
- ``transitions/dropped_calls/agent_mismatch``, ``/no_token_ids``: calls of *emitted*
  rollouts that are not transitions; with ``/calls`` they add up to all their LLM calls.
- ``transitions/build_seconds``: wall time of the build (not the write).
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lightspan.collector import store
from lightspan.tracing import semconv

from .advantages import ESTIMATORS
from .config import TransitionsConfig
from .credit import POLICIES, rewards_per_call

log = logging.getLogger(__name__)

ROLLOUT_DROP_REASONS = ("incomplete", "failed", "timeout", "no_token_ids", "agent_mismatch",
                        "no_reward", "small_group")
CALL_DROP_REASONS = ("agent_mismatch", "no_token_ids")   # the column order of _DROPPED_CALLS_SQL

# 1–2a. Pending rollouts of the split and their first drop reason (NULL: still a candidate).
_ROLLOUTS_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_rollouts AS
WITH calls AS (
    SELECT rollout_key, count(*) AS num_calls FROM llm_calls GROUP BY rollout_key
), roll AS (
    SELECT coalesce(rollout_id, trace_id) AS rollout_key,
           bool_or(rollout_id IS NOT NULL) AS has_rollout_id,
           min(task_id) AS task_id,
           coalesce(min(split), 'train') AS split,
           max(coalesce(end_time_unix_nano, start_time_unix_nano)) AS last_end,
           count(*) FILTER (WHERE name = $runner) AS runner_spans,
           -- the worst outcome among runner spans: 2 timeout, 1 failed (or unknown), 0 ok
           max(CASE coalesce(trim(attributes[$outcome], '"'),
                             CASE WHEN status_code = 'ERROR' THEN 'failed' ELSE 'ok' END)
                   WHEN 'ok' THEN 0 WHEN 'timeout' THEN 2 ELSE 1 END)
               FILTER (WHERE name = $runner) AS outcome,
           bool_or(name = $root AND status_code = 'ERROR') AS root_error
    FROM spans
    GROUP BY 1
)
SELECT r.rollout_key, r.task_id, r.split,
       CASE WHEN r.runner_spans = 0 AND r.last_end >= $cutoff THEN 'incomplete'
            WHEN r.outcome = 2 THEN 'timeout'
            WHEN r.outcome = 1 OR r.root_error THEN 'failed'
            WHEN c.num_calls IS NULL THEN 'no_token_ids'
       END AS reason
FROM roll r LEFT JOIN calls c USING (rollout_key)
WHERE (r.has_rollout_id OR c.num_calls IS NOT NULL)
  AND r.split = $split
  AND r.rollout_key NOT IN (SELECT rollout_id FROM transitions WHERE rollout_id IS NOT NULL)
"""

# The LLM calls of the candidates, with everything a transition carries.
_CALLS_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_calls AS
SELECT c.rollout_key, c.rollout_key || '/' || c.span_id AS transition_id,
       c.trace_id, c.span_id, c.agent_name, coalesce(c.agent_name, '') AS agent_key,
       c.start_time_unix_nano AS start_ns,
       coalesce(c.end_time_unix_nano, c.start_time_unix_nano) AS end_ns,
       c.prompt_token_ids, c.completion_token_ids, c.completion_logprobs, c.model_version,
       coalesce(len(c.prompt_token_ids) > 0 AND len(c.completion_token_ids) > 0
                AND len(c.completion_logprobs) = len(c.completion_token_ids), false) AS has_tokens
FROM llm_calls c JOIN _lrl_rollouts r USING (rollout_key)
WHERE r.reason IS NULL
"""

_REWARDS_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_rewards AS
SELECT w.rollout_key, w.time_unix_nano, w.span_id, w.reward
FROM rewards w JOIN _lrl_rollouts r USING (rollout_key)
WHERE r.reason IS NULL AND isfinite(w.reward) AND w.time_unix_nano IS NOT NULL
"""

# 2b–3. The remaining reasons, then group sizes among the rollouts still kept.
_FINAL_SQL = """
CREATE OR REPLACE TEMP TABLE _lrl_final AS
WITH per AS (
    SELECT rollout_key,
           count(*) FILTER (WHERE list_contains($agents::VARCHAR[], agent_key)) AS matched,
           count(*) FILTER (WHERE list_contains($agents::VARCHAR[], agent_key) AND has_tokens) AS with_tokens
    FROM _lrl_calls GROUP BY rollout_key
), rew AS (
    SELECT rollout_key, count(*) AS num_rewards FROM _lrl_rewards GROUP BY rollout_key
), staged AS (
    SELECT r.rollout_key, r.task_id, r.split,
           coalesce('t:' || r.task_id, 'r:' || r.rollout_key) AS group_key,
           coalesce(r.reason,
                    CASE WHEN coalesce(p.matched, 0) = 0 THEN 'agent_mismatch'
                         WHEN p.with_tokens = 0 THEN 'no_token_ids'
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
SELECT k.ridx, k.task_id, k.split, c.*
FROM _lrl_calls c JOIN _lrl_ready k USING (rollout_key)
WHERE list_contains($agents::VARCHAR[], c.agent_key)
ORDER BY k.ridx, c.start_ns, c.end_ns, c.span_id, c.trace_id
"""

_FETCH_REWARDS_SQL = """
SELECT k.ridx, w.time_unix_nano, w.reward
FROM _lrl_rewards w JOIN _lrl_ready k USING (rollout_key)
ORDER BY k.ridx, w.time_unix_nano, w.span_id, w.reward
"""

_DROPPED_CALLS_SQL = """
SELECT count(*) FILTER (WHERE NOT list_contains($agents::VARCHAR[], c.agent_key)) AS agent_mismatch,
       count(*) FILTER (WHERE list_contains($agents::VARCHAR[], c.agent_key) AND NOT c.has_tokens)
           AS no_token_ids
FROM _lrl_calls c JOIN _lrl_ready k USING (rollout_key)
"""

_TEMP_TABLES = ("_lrl_rollouts", "_lrl_calls", "_lrl_rewards", "_lrl_final", "_lrl_ready")


def _offsets(sorted_ids: np.ndarray, n: int) -> np.ndarray:
    """Row offsets of ids 0..n-1 in an ascending id column: rows of id i are [o[i], o[i+1])."""
    return np.searchsorted(sorted_ids, np.arange(n + 1), side="left")


def build_transitions(con: duckdb.DuckDBPyConnection, config: TransitionsConfig, *,
                      now_unix_nano: int | None = None) -> tuple[pa.Table, dict]:
    """Build the transitions of every complete, not yet built rollout of ``config.split``.

    ``con`` has the store's views (``store.connect``). Returns a table in exactly
    ``store.TRANSITION_SCHEMA`` (empty when nothing is ready) and the build's metrics.
    Nothing is written: see :func:`run`.
    """
    t0 = time.perf_counter()
    now = time.time_ns() if now_unix_nano is None else int(now_unix_nano)
    try:
        con.execute(_ROLLOUTS_SQL, {
            "runner": semconv.SPAN_RUNNER, "outcome": semconv.ROLLOUT_OUTCOME,
            "root": semconv.SPAN_ROLLOUT, "split": config.split,
            "cutoff": now - int(config.grace_s * 1e9)})
        con.execute(_CALLS_SQL)
        con.execute(_REWARDS_SQL)
        names = [row[0] for row in con.execute("SELECT DISTINCT agent_key FROM _lrl_calls").fetchall()]
        pattern = re.compile(config.agent_match)
        agents = [n for n in names if pattern.search(n)] if config.agent_match else names
        con.execute(_FINAL_SQL, {"agents": agents, "min_group_size": config.min_group_size})
        con.execute(_READY_SQL)
        drops = dict(con.execute(
            "SELECT reason, count(*) FROM _lrl_final WHERE reason IS NOT NULL GROUP BY reason").fetchall())
        num_rollouts, num_groups = con.execute(
            "SELECT count(*), count(DISTINCT gidx) FROM _lrl_ready").fetchall()[0]
        calls = con.sql(_FETCH_CALLS_SQL, params={"agents": agents}).to_arrow_table()
        rewards = con.sql(_FETCH_REWARDS_SQL).to_arrow_table()
        dropped_calls = dict(zip(CALL_DROP_REASONS,
                                 con.execute(_DROPPED_CALLS_SQL, {"agents": agents}).fetchall()[0]))
        groups = con.sql("SELECT gidx FROM _lrl_ready ORDER BY ridx").to_arrow_table()
    finally:
        for name in _TEMP_TABLES:
            con.execute(f"DROP TABLE IF EXISTS {name}")

    table, stats = _assign(calls, rewards, groups.column("gidx").to_numpy(), num_rollouts, config, now)

    metrics: dict = {
        "transitions/rollouts": int(num_rollouts),
        "transitions/calls": table.num_rows,
        "transitions/groups": int(num_groups),
        **stats,
    }
    for reason in ROLLOUT_DROP_REASONS:
        metrics[f"transitions/dropped_rollouts/{reason}"] = int(drops.get(reason, 0))
    for reason in CALL_DROP_REASONS:
        metrics[f"transitions/dropped_calls/{reason}"] = int(dropped_calls[reason] or 0)
    metrics["transitions/build_seconds"] = time.perf_counter() - t0
    return table, metrics


def _assign(calls: pa.Table, rewards: pa.Table, group_of: np.ndarray, num_rollouts: int,
            config: TransitionsConfig, now: int) -> tuple[pa.Table, dict]:
    """Credit and advantages over the ready rollouts' calls (sorted by rollout, then call order)."""
    nan = math.nan
    stats = {"transitions/reward_mean": nan, "transitions/reward_std": nan,
             "transitions/return_mean": nan, "transitions/advantage_abs_mean": nan,
             "transitions/nonzero_advantage": 0,
             "transitions/zero_std_groups": 0, "transitions/group_size_mean": nan,
             "transitions/completion_tokens": 0}
    if num_rollouts == 0:
        return store.TRANSITION_SCHEMA.empty_table(), stats

    call_ridx = calls.column("ridx").to_numpy()
    end_ns = calls.column("end_ns").to_numpy()
    reward_ridx = rewards.column("ridx").to_numpy()
    reward_t = rewards.column("time_unix_nano").to_numpy()
    reward_v = rewards.column("reward").to_numpy()
    co = _offsets(call_ridx, num_rollouts)
    ro = _offsets(reward_ridx, num_rollouts)

    policy = POLICIES[config.credit]
    credit = np.empty(len(call_ridx))
    final = np.empty(num_rollouts)   # R_i: the rollout's last reward by time
    ret = np.empty(num_rollouts)     # the rollout return the group baseline is taken over
    for i in range(num_rollouts):
        c, r = slice(co[i], co[i + 1]), slice(ro[i], ro[i + 1])
        final[i] = reward_v[r][-1]
        r_t = rewards_per_call(end_ns[c], reward_t[r], reward_v[r])
        credit[c] = policy(r_t, final[i], config.gamma)
        ret[i] = credit[co[i]]  # the return from the first action: R (identical), G_0 (discounted)

    advantage = ESTIMATORS[config.advantage](ret, group_of, epsilon=config.epsilon,
                                             credit=credit, rollout_index=call_ridx)

    keep = calls.column("has_tokens").to_numpy(zero_copy_only=False)
    kept_ridx = call_ridx[keep]
    num_calls = np.bincount(kept_ridx, minlength=num_rollouts)
    first = _offsets(kept_ridx, num_rollouts)[kept_ridx]
    call_index = np.arange(len(kept_ridx)) - first
    out = calls if keep.all() else calls.filter(pa.array(keep))
    n = out.num_rows
    columns = {
        "transition_id": out.column("transition_id"),
        "rollout_id": out.column("rollout_key"),
        "task_id": out.column("task_id"),
        "split": out.column("split"),
        "agent_name": out.column("agent_name"),
        "call_index": pa.array(call_index, pa.int32()),
        "num_calls": pa.array(num_calls[kept_ridx], pa.int32()),
        "prompt_token_ids": out.column("prompt_token_ids"),
        "completion_token_ids": out.column("completion_token_ids"),
        "completion_logprobs": out.column("completion_logprobs"),
        "model_version": out.column("model_version"),
        "reward": pa.array(final[kept_ridx], pa.float64()),
        "credit": pa.array(credit[keep], pa.float64()),
        "advantage": pa.array(advantage[keep], pa.float64()),
        "credit_policy": pa.array([config.credit] * n, pa.string()),
        "advantage_estimator": pa.array([config.advantage] * n, pa.string()),
        "build_id": pa.array([uuid.uuid4().hex] * n, pa.string()),
        "created_unix_nano": pa.array(np.full(n, now, dtype=np.int64), pa.int64()),
    }
    table = pa.table({f.name: columns[f.name].cast(f.type) for f in store.TRANSITION_SCHEMA},
                     schema=store.TRANSITION_SCHEMA)

    sizes = np.bincount(group_of)
    high, low = np.full(len(sizes), -np.inf), np.full(len(sizes), np.inf)
    np.maximum.at(high, group_of, ret)
    np.minimum.at(low, group_of, ret)
    stats.update({
        "transitions/reward_mean": float(final.mean()),
        "transitions/reward_std": float(final.std()),
        "transitions/return_mean": float(ret.mean()),
        "transitions/advantage_abs_mean": float(np.abs(advantage[keep]).mean()) if n else nan,
        "transitions/nonzero_advantage": int(np.count_nonzero(advantage[keep])),
        "transitions/zero_std_groups": int(np.sum(high == low)),  # every advantage 0 under identical
        "transitions/group_size_mean": float(sizes.mean()),
        "transitions/completion_tokens":
            int(pc.sum(pc.list_value_length(out.column("completion_token_ids"))).as_py() or 0),
    })
    return table, stats


def run(config: TransitionsConfig) -> dict:
    """One build over ``config.data_dir``: write the new transitions (if any) and return the metrics."""
    con = store.connect(config.data_dir)
    try:
        table, metrics = build_transitions(con, config)
    finally:
        con.close()
    if table.num_rows:
        path = store.write_table(config.data_dir, "transitions", table)
        log.info("wrote %d transitions of %d rollouts in %d groups to %s (reward mean %.4f)",
                 table.num_rows, metrics["transitions/rollouts"], metrics["transitions/groups"],
                 path, metrics["transitions/reward_mean"])
    else:
        log.info("no complete rollout to build in %s", config.data_dir)
    dropped = {k.removeprefix("transitions/"): v for k, v in metrics.items()
               if k.startswith("transitions/dropped_") and v}
    if dropped:
        log.info("dropped: %s", ", ".join(f"{k}={v}" for k, v in sorted(dropped.items())))
    return metrics
