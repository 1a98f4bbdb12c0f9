"""The web UI's training, feedback and quality queries: parameters in, JSON-able dicts out.

As :mod:`lightspan.dashboards.ui` (whose parameter helpers these use), every query reads the
store's views on a connection the caller opens, with values bound as parameters.

- ``/api/ui/training``: :func:`training`, the train_steps of one run (with the entropy floor the
  trainer ran under), the mean final reward per policy version and split, and the reward drift:
  each source's mean reward per policy version (the ``reward_drift`` view);
- ``/api/ui/queue``: :func:`queue`, the annotation queue: rollouts with no reward yet (status
  ``unrewarded``: not failed, not timed out), newest first; ``after_time`` and ``after_key`` (the
  rollout shown last) step past the ones a person skipped or just scored, so a score still on its
  way to Parquet does not show the same rollout again. The scores themselves go to the collector's
  ``POST /v1/rewards`` with source ``human``: that endpoint is the one home of the reward contract;
- ``/api/ui/quality``: :func:`quality`, pass@k and pass^k per task and policy version (the
  ``pass_k`` macro) and the agreement of judge and human scores (``reward_agreement``).
"""

from __future__ import annotations

import duckdb

from lightspan import store
from lightspan.store import deployments
from lightspan.dashboards.ui import MAX_LIMIT, BadParameter, Params, check_known, integer, number, one, records

# --- training ------------------------------------------------------------------------------------

TRAINING_PARAMS = ("run",)
_STEP_COLUMNS = """policy, step, policy_version, time_unix_nano, num_transitions, num_tokens, reward_mean, advantage_abs_mean,
       loss, kl, clip_ratio, entropy, entropy_floor, is_ratio_mean, staleness_mean, skipped_stale, step_seconds,
       {tokens_per_second} AS tokens_per_second, sync_seconds, sync_max_abs_logprob_diff"""
# trained completion tokens per second of the optimisation step; the trainer's own figure when the
# store has that column (it also counts num_iterations passes), else tokens / step time
_TOKENS_PER_SECOND = "num_tokens / nullif(step_seconds, 0)"


def training(con: duckdb.DuckDBPyConnection, params: Params) -> dict:
    """The training runs, the steps of one (``run``, default the latest), the mean final reward of
    rollouts per policy version and split (train and validation), each source's mean reward per
    policy version, and ``entropy_warnings``: the run's steps whose entropy fell below the floor.
    With several policies each policy's checkpoint lineage is a run of its own (``policy``), and the
    rewards per version are per policy."""
    check_known(params, TRAINING_PARAMS)
    run = one(params, "run")
    runs = records(con.execute("""
        SELECT run_id, any_value(policy) AS policy, count(*) AS steps, max(step) AS last_step,
               max(policy_version) AS policy_version, min(time_unix_nano) AS first_time_unix_nano, max(time_unix_nano) AS last_time_unix_nano
        FROM train_steps GROUP BY run_id ORDER BY last_time_unix_nano DESC"""))
    if run is not None and run not in {r["run_id"] for r in runs}:
        raise BadParameter(f"no training run {run!r}: known runs are {[r['run_id'] for r in runs][:20]}")
    run = run or (runs[0]["run_id"] if runs else None)
    tokens_per_second = _TOKENS_PER_SECOND
    if "tokens_per_second" in store.TRAIN_STEP_SCHEMA.names:
        tokens_per_second = f"coalesce(tokens_per_second, {_TOKENS_PER_SECOND})"
    columns = _STEP_COLUMNS.format(tokens_per_second=tokens_per_second)
    steps = records(con.execute(f"SELECT {columns} FROM train_steps WHERE run_id = $run "
                                "ORDER BY step, time_unix_nano", {"run": run})) if run else []
    # the unnamed policy's rollouts, and each named policy's (a rollout two policies served is in both)
    by_version = records(con.execute("""
        SELECT NULL::VARCHAR AS policy, model_version AS policy_version, coalesce(split, 'train') AS split,
               count(*) AS rollouts, avg(final_reward) AS reward_mean, count(final_reward) AS with_reward
        FROM rollouts WHERE len(policies) = 0 GROUP BY ALL
        UNION ALL
        SELECT policy, model_version, coalesce(split, 'train'), count(*), avg(final_reward), count(final_reward)
        FROM policy_rollouts GROUP BY ALL
        ORDER BY policy NULLS FIRST, policy_version NULLS FIRST, split"""))
    by_source = records(con.execute("""
        SELECT model_version AS policy_version, source, sum(rollouts) AS rollouts,
               sum(reward_mean * rollouts) / sum(rollouts) AS reward_mean
        FROM reward_drift GROUP BY ALL ORDER BY policy_version NULLS FIRST, source"""))
    below = [s["step"] for s in steps
             if s["entropy_floor"] and s["entropy"] is not None and s["entropy"] < s["entropy_floor"]]
    policy = next((r["policy"] for r in runs if r["run_id"] == run), None)
    return {"runs": runs, "run_id": run, "policy": policy, "steps": steps, "reward_by_version": by_version,
            "reward_by_source": by_source, "entropy_warnings": below,
            "deployments": deployments.summary(con)}           # canaries: versions, shares, decisions


# --- the annotation queue ------------------------------------------------------------------------

QUEUE_PARAMS = ("task", "split", "after_time", "after_key")
_QUEUE_FILTERS = {"task": "task_id = $task", "split": "coalesce(split, 'train') = $split"}
# newest first, as the rollouts list; a rollout without a start time (no timed span) comes last
_ORDER = "coalesce(start_time_unix_nano, -1)"
_AFTER = f"({_ORDER} < $after_time OR ({_ORDER} = $after_time AND rollout_key > $after_key))"


def queue(con: duckdb.DuckDBPyConnection, params: Params) -> dict:
    """The rollouts that wait for a score (``status = 'unrewarded'``, optionally of one ``task`` or
    ``split``): how many in all, how many after the cursor, and the next one."""
    check_known(params, QUEUE_PARAMS)
    bound = {k: v for k in _QUEUE_FILTERS if (v := one(params, k)) is not None}
    after_time, after_key = integer(params, "after_time", low=-1), one(params, "after_key")
    if (after_time is None) != (after_key is None):
        raise BadParameter("give 'after_time' and 'after_key' together: the start time and key of the rollout "
                           "shown last")
    where = " AND ".join(["status = 'unrewarded'", *(_QUEUE_FILTERS[k] for k in bound)])
    con.execute(f"CREATE OR REPLACE TEMP TABLE _ui_queue AS SELECT rollout_key, task_id, split, service_name, "
                f"model_version, num_spans, has_error, start_time_unix_nano, end_time_unix_nano, outcome, "
                f"num_uncaptured_calls, capture_reason FROM rollouts WHERE {where}", bound)
    total = con.execute("SELECT count(*) FROM _ui_queue").fetchone()[0]
    rest, cursor = "true", {}
    if after_key is not None:
        rest, cursor = _AFTER, {"after_time": after_time, "after_key": after_key}
    remaining = con.execute(f"SELECT count(*) FROM _ui_queue WHERE {rest}", cursor).fetchone()[0]
    nxt = records(con.execute(f"SELECT * FROM _ui_queue WHERE {rest} ORDER BY {_ORDER} DESC, rollout_key LIMIT 1",
                              cursor))
    if nxt:   # the cursor past it, as text: nanoseconds do not survive a JavaScript number
        start = nxt[0]["start_time_unix_nano"]
        nxt[0]["cursor"] = {"after_time": str(-1 if start is None else start), "after_key": nxt[0]["rollout_key"]}
    return {"total": total, "remaining": remaining, "next": nxt[0] if nxt else None}


# --- pass@k, pass^k and judge/human agreement ----------------------------------------------------

QUALITY_PARAMS = ("k", "threshold")
K_SHOWN = (1, 2, 4, 8, 16)       # the by-version summary's k values


def quality(con: duckdb.DuckDBPyConnection, params: Params) -> dict:
    """pass@k and pass^k: per task and policy version for ``k`` (default 1), and their mean over
    tasks per version for each k of K_SHOWN (a task counts for k when it has at least k rollouts
    whose outcome is known); a rollout succeeds when its final reward is at least ``threshold``
    (default 1). Then the judge and human scores of the rollouts both scored: how many, their mean
    absolute difference, correlation and how often they agree on success, and per policy version
    the mean judge − human difference (a judge drifting from people as the policy learns)."""
    check_known(params, QUALITY_PARAMS)
    k = integer(params, "k", low=1, high=1000, default=1)
    threshold = number(params, "threshold")
    threshold = 1.0 if threshold is None else threshold
    at = {"t": threshold}
    tasks = records(con.execute(f"""
        SELECT task_id, model_version, split, n, c, pass_at_k, pass_hat_k FROM pass_k(threshold := $t)
        WHERE k = $k ORDER BY model_version NULLS FIRST, split, task_id LIMIT {MAX_LIMIT}""", {**at, "k": k}))
    by_version = records(con.execute("""
        SELECT model_version, split, k, count(*) AS tasks, avg(pass_at_k) AS pass_at_k, avg(pass_hat_k) AS pass_hat_k
        FROM pass_k(threshold := $t) WHERE list_contains($ks::BIGINT[], k)
        GROUP BY ALL ORDER BY model_version NULLS FIRST, split, k""", {**at, "ks": list(K_SHOWN)}))
    agreement = records(con.execute("""
        SELECT count(*) AS rollouts, avg(abs(judge - human)) AS mean_abs_difference, corr(judge, human) AS correlation,
               avg(((judge >= $t) = (human >= $t))::INT) AS success_agreement
        FROM reward_agreement""", at))[0]
    drift = records(con.execute("""
        SELECT r.model_version, count(*) AS rollouts, avg(a.judge - a.human) AS judge_minus_human
        FROM reward_agreement a JOIN rollouts r USING (rollout_key) GROUP BY 1 ORDER BY 1 NULLS FIRST"""))
    pairs = records(con.execute(f"""
        SELECT a.rollout_key, a.task_id, r.model_version, a.judge, a.human FROM reward_agreement a
        JOIN rollouts r USING (rollout_key) ORDER BY abs(a.judge - a.human) DESC, a.rollout_key LIMIT {MAX_LIMIT}"""))
    return {"k": k, "threshold": threshold, "tasks": tasks, "by_version": by_version, "k_shown": list(K_SHOWN),
            "agreement": agreement, "judge_drift": drift, "pairs": pairs}
