"""Credit assignment: how a rollout's rewards are shared among its LLM calls (DESIGN.md §3.4).

A rollout is one episode; its LLM calls, ordered by start time, are the actions a_0 … a_{T-1}.
Each policy is a pure function ``policy(call_rewards, final_reward, gamma) -> credit`` with one
credit value per call, and ``POLICIES`` is the closed set the config accepts.

- ``identical`` — LightningRL as published: Luo et al. 2025, "Agent Lightning: Train ANY AI
  Agents with Reinforcement Learning", arXiv 2508.03680 (the LightningRL algorithm): every
  action of an episode receives the episode's final reward, and each call is then optimised
  as a single-turn sample.
- ``discounted`` — return-to-go, Sutton & Barto 2018, "Reinforcement Learning: An
  Introduction", eq. 3.9: G_t = r_t + γ G_{t+1}, G_T = 0, over per-call rewards r_t, so
  intermediate rewards count and a reward credits only the calls made before it.

Per-call rewards r_t come from :func:`rewards_per_call`: a reward is attributed to the latest
call that ended at or before the reward's time (end time of the reward span).

Deviations:

1. The paper's LightningRL assigns the *final* reward; with several reward spans ``identical``
   uses the last one by time (ties broken by span id) and ignores the others. Use
   ``discounted`` (γ = 1 sums them) to let every reward count.
2. A reward emitted before any call ended goes to the first call (r_0), not dropped: the agent
   reported it, so it must be credited somewhere, and only a call can hold it.
3. Reward names are not distinguished: every reward span of the rollout is a reward.
4. The paper's γ is implicit (1); here γ ∈ (0, 1] applies per *call*, not per token or second.
"""

from __future__ import annotations

import numpy as np


def rewards_per_call(call_end: np.ndarray, reward_time: np.ndarray, reward_value: np.ndarray) -> np.ndarray:
    """r_t: the sum of the rewards attributed to call t.

    A reward at time τ goes to the call with the latest end time ≤ τ (on equal end times, the
    call later in the rollout); a reward before every call's end goes to call 0, the first
    call in rollout order (even when a later, shorter call ended first).
    ``call_end`` is in call order; rewards may come in any order. Returns float64, len(call_end).
    """
    call_end = np.asarray(call_end, dtype=np.int64)
    n = len(call_end)
    if n == 0:
        return np.zeros(0)
    by_end = np.lexsort((np.arange(n), call_end))  # calls sorted by (end time, position)
    pos = np.searchsorted(call_end[by_end], np.asarray(reward_time, dtype=np.int64), side="right") - 1
    target = np.where(pos >= 0, by_end[np.maximum(pos, 0)], 0)  # before every end: call 0
    return np.bincount(target, weights=np.asarray(reward_value, dtype=np.float64), minlength=n)


def identical(call_rewards: np.ndarray, final_reward: float, gamma: float) -> np.ndarray:
    """LightningRL (Luo et al. 2025): credit_t = R_final for every call t."""
    return np.full(len(call_rewards), float(final_reward))


def discounted(call_rewards: np.ndarray, final_reward: float, gamma: float) -> np.ndarray:
    """Return-to-go (Sutton & Barto eq. 3.9): G_t = r_t + γ G_{t+1}, G_T = 0."""
    r = np.asarray(call_rewards, dtype=np.float64)
    G = np.zeros_like(r)
    g_next = 0.0
    for t in range(len(r) - 1, -1, -1):
        g_next = G[t] = r[t] + gamma * g_next
    return G


POLICIES = {"identical": identical, "discounted": discounted}
"""The closed set of credit policies, by config name."""
