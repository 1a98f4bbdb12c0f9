"""Which LLM call a reward belongs to: one rule, read by the transition builder (credit
assignment) and the web UI (a call's matched reward) alike."""

from __future__ import annotations

import numpy as np


def rewards_per_call(call_end: np.ndarray, reward_time: np.ndarray, reward_value: np.ndarray, *,
                     call_rollout: np.ndarray | None = None,
                     reward_rollout: np.ndarray | None = None) -> np.ndarray:
    """r_t: the sum of the rewards attributed to call t.

    A reward at time τ goes to the call with the latest end time ≤ τ (on equal end times, the
    call later in the rollout); a reward before every call's end goes to call 0, the first
    call in rollout order (even when a later, shorter call ended first).
    ``call_end`` is in call order; rewards may come in any order. Returns float64, len(call_end).

    Many rollouts at once: ``call_rollout`` (ascending; calls of one rollout contiguous, in
    call order) and ``reward_rollout`` give each call's and reward's rollout, and a reward only
    goes to a call of its own rollout. Every rollout with a reward must have a call.
    """
    call_end = np.asarray(call_end, dtype=np.int64)
    reward_time = np.asarray(reward_time, dtype=np.int64)
    n = len(call_end)
    if n == 0:
        return np.zeros(0)
    if call_rollout is None:
        call_rollout = np.zeros(n, dtype=np.int64)
        reward_rollout = np.zeros(len(reward_time), dtype=np.int64)
    call_rollout = np.asarray(call_rollout, dtype=np.int64)
    reward_rollout = np.asarray(reward_rollout, dtype=np.int64)
    # one sortable int64 key per (rollout, time): rollout in the high bits, the time's rank below
    times, rank = np.unique(np.concatenate([call_end, reward_time]), return_inverse=True)
    shift = max(int(len(times)).bit_length(), 1)
    key = np.concatenate([call_rollout, reward_rollout]) << shift | rank.reshape(-1)
    call_key, reward_key = key[:n], key[n:]
    by_end = np.lexsort((np.arange(n), call_key))       # calls sorted by (rollout, end, position)
    pos = np.searchsorted(call_key[by_end], reward_key, side="right") - 1
    found = by_end[np.maximum(pos, 0)]
    own = (pos >= 0) & (call_rollout[found] == reward_rollout)
    first = np.searchsorted(call_rollout, reward_rollout, side="left")   # call 0 of each reward's rollout
    target = np.where(own, found, first)
    return np.bincount(target, weights=np.asarray(reward_value, dtype=np.float64), minlength=n)
