"""The assignment part of a build: credit and advantages for the ready rollouts' calls, then the
transition rows (steps 5 and 6 of lightningrl/builder.py's module docstring).

:func:`assign` applies the pure credit (:mod:`.credit`) and advantage (:mod:`.advantages`)
functions to whole numpy columns, every rollout at once, and builds the output table of
``config.output`` (:data:`OUTPUTS`: one row per call, or per sequence of one rollout and agent,
:mod:`.sequences`), taking the token lists from the build's :class:`.tokens.Tokens` without a
copy. Its statistics are the ``transitions/*`` metrics that describe what was emitted.
"""

from __future__ import annotations

import math
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lightspan import store

from .advantages import ESTIMATORS
from .config import TransitionsConfig
from .credit import POLICIES, rewards_per_call
from .sequences import MISMATCH_KINDS, merge
from .tokens import Tokens

def empty_stats() -> dict:
    nan = math.nan
    stats = {"transitions/calls": 0, "transitions/sequences": 0, "transitions/groups": 0,
             "transitions/reward_mean": nan, "transitions/reward_std": nan,
             "transitions/return_mean": nan, "transitions/advantage_abs_mean": nan,
             "transitions/nonzero_advantage": 0, "transitions/zero_std_groups": 0,
             "transitions/group_size_mean": nan, "transitions/completion_tokens": 0,
             "transitions/masked_tokens": 0, "transitions/rows_per_rollout_mean": nan,
             "transitions/rows_per_rollout_max": 0, "transitions/merge_rate": nan,
             "transitions/dropped_calls/not_selected": 0}
    stats.update({f"transitions/prefix_mismatch/{kind}": 0 for kind in MISMATCH_KINDS})
    stats.update({f"transitions/outcomes/{o}": 0 for o in ROW_OUTCOMES})
    return stats


ROW_OUTCOMES = ("ok", "failed", "masked")
"""The ``outcome`` of an emitted rollout's rows (config.TRAIN_OUTCOMES less ``dropped``, plus ``ok``)."""


def last_k(rollout: np.ndarray, keep: np.ndarray, k: int) -> np.ndarray:
    """``keep`` (bool per call, calls sorted by ``rollout``) with only each rollout's last ``k`` kept
    calls left true; k = 0 leaves it as it is."""
    keep = np.asarray(keep, dtype=bool)
    if k <= 0:
        return keep
    idx = np.flatnonzero(keep)
    r = rollout[idx]
    within = np.arange(len(idx)) - np.searchsorted(r, r, side="left")     # 0 for a rollout's first kept
    count = np.bincount(r, minlength=int(rollout.max(initial=-1)) + 1)
    out = np.zeros_like(keep)
    out[idx[count[r] - within <= k]] = True
    return out


def final_rewards(reward: np.ndarray, per_call: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """R_i: each rollout's last reward received that scores the rollout, else (only calls were
    scored) its last reward. ``reward`` and ``per_call`` are sorted by (rollout, the time the
    collector received the reward, its time): a sender's clock never makes its reward the last
    (store.REWARD_ORDER); rollout i's rewards are ``bounds[i]:bounds[i + 1]``, and each rollout has one."""
    out = np.empty(len(bounds) - 1)
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        whole = np.flatnonzero(~per_call[lo:hi])
        out[i] = reward[lo + whole[-1]] if len(whole) else reward[hi - 1]
    return out


def assign(calls: pa.Table, rewards: pa.Table, groups: pa.Table, tokens: Tokens, num_rollouts: int,
            config: TransitionsConfig, now: int, policy: str | None = None) -> tuple[pa.Table, dict]:
    """Credit and advantages for the ready rollouts' calls (sorted by rollout, then call order),
    then the output rows of ``config.output`` and their statistics. ``calls``, ``rewards``, ``groups``
    and ``tokens`` are a :class:`.selection.Found`'s; ``now`` stamps ``created_unix_nano``; ``policy``
    names the policy the rows train (None: the unnamed one).

    One rollout at a time it reads (tests/lightningrl/test_assignment.py runs this loop on random
    rollouts and compares; here each line is one numpy call over every rollout)::

        for each rollout i:
            r = rewards_per_call(call ends, reward times, rewards)  # r_t: to the latest call ended by then
            R[i] = the last reward received that scores the rollout  # final_rewards
            credit[i] = POLICIES[config.credit](r, R[i], gamma)      # R for every call, or G_t
            ret[i] = credit[i][0]                                    # the return from its first call
        for each group g (the rollouts of one task), rollout i in g, call t of i:
            advantage[i][t] = (credit[i][t] - b_g(i)) / s_g(i)       # ESTIMATORS: b, s from ret over g
    """
    stats = empty_stats()
    group_of = groups.column("gidx").to_numpy()
    call_ridx = calls.column("ridx").to_numpy()
    reward_ridx = rewards.column("ridx").to_numpy()
    reward_v = rewards.column("reward").to_numpy()
    co = np.searchsorted(call_ridx, np.arange(num_rollouts + 1))
    ro = np.searchsorted(reward_ridx, np.arange(num_rollouts + 1))

    final = final_rewards(reward_v, rewards.column("per_call").to_numpy(zero_copy_only=False), ro)
    r_t = rewards_per_call(calls.column("end_ns").to_numpy(), rewards.column("time_ns").to_numpy(), reward_v,
                           call_rollout=call_ridx, reward_rollout=reward_ridx)
    credit = POLICIES[config.credit](r_t, final, config.gamma, rollout_index=call_ridx)
    ret = credit[co[:-1]]            # the return from the first action: R (identical), G_0 (discounted)
    advantage = ESTIMATORS[config.advantage](ret, group_of, epsilon=config.epsilon,
                                             credit=credit, rollout_index=call_ridx)

    trainable = calls.column("emit").to_numpy(zero_copy_only=False)
    # turn selection: unselected calls keep their place in the credit above, but are not emitted
    emit = last_k(call_ridx, trainable & calls.column("selected").to_numpy(zero_copy_only=False), config.turn_last_k)
    rows = np.flatnonzero(emit)
    kept_ridx = call_ridx[rows]
    num_calls = np.bincount(kept_ridx, minlength=num_rollouts)
    call_index = np.arange(len(rows)) - np.searchsorted(kept_ridx, kept_ridx, side="left")
    version = calls.column("model_version").cast(pa.float64()).to_numpy(zero_copy_only=False)[rows]

    first, lists, seq_version, masked, (segment, cause) = OUTPUTS[config.output](
        calls, tokens, rows, kept_ridx, version, stats)
    prompt, completion, logprobs, mask = lists

    out = calls.take(pa.array(rows[first]))
    n = len(first)
    seq_ridx = kept_ridx[first]
    rollout_rows = np.bincount(seq_ridx, minlength=num_rollouts)
    outcome = groups.column("outcome")                  # one per rollout; taken per row in Arrow
    masked_rollout = pc.equal(outcome, "masked").to_numpy(zero_copy_only=False)
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
        "policy": pa.array([policy] * n, pa.string()),
        "segment": segment,
        "segment_cause": cause,
        "rollout_rows": pa.array(rollout_rows[seq_ridx], pa.int32()),
        "outcome": pc.take(outcome, pa.array(seq_ridx)),
        "loss_weight": pa.array(np.where(masked_rollout[seq_ridx], 0.0, 1.0), pa.float64()),
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
        "transitions/rows_per_rollout_mean": n / num_rollouts,
        "transitions/rows_per_rollout_max": int(rollout_rows.max(initial=0)),
        "transitions/merge_rate": float(np.mean(rollout_rows == 1)),
        "transitions/dropped_calls/not_selected": int(trainable.sum() - len(rows)),
        **{f"transitions/outcomes/{o}": int(pc.sum(pc.equal(outcome, o)).as_py() or 0) for o in ROW_OUTCOMES},
    })
    return table, stats


def _per_call(calls, tokens: Tokens, rows, kept_ridx, version, stats):
    """One row per emitted call, in the order the token lists were read (one copy, or none)."""
    hpos = _hpos(calls, rows)
    first = np.argsort(hpos, kind="stable")
    lists = [tokens.take(c, hpos[first]) for c in ("prompt_token_ids", "completion_token_ids", "completion_logprobs")]
    none = (pa.nulls(len(rows), pa.int32()), pa.nulls(len(rows), pa.string()))
    return first, lists + [pa.nulls(len(rows), pa.list_(pa.int8()))], version[first], 0, none


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
    # each row's segment of its rollout and agent, and the prefix mismatch that started it
    cause = pa.array(np.asarray(MISMATCH_KINDS + (None,), dtype=object)[m.cause], pa.string())
    return first, lists, seq_version, len(m.mask) - int(m.mask.sum()), (pa.array(m.segment, pa.int32()), cause)


OUTPUTS = {"per_call": _per_call, "per_rollout": _per_rollout}
"""The output modes (config ``output``): (calls, tokens, rows, ...) -> (first call of each row, the
four list columns, model version, masked tokens, (segment, segment_cause) columns)."""


def _hpos(calls: pa.Table, rows: np.ndarray) -> np.ndarray:
    """Where the token lists of the calls ``rows`` are in the build's :class:`.tokens.Tokens`."""
    return calls.column("hpos").to_numpy(zero_copy_only=False)[rows].astype(np.int64)
