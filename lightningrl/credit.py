"""Credit assignment: how a rollout's rewards are shared among its LLM calls
(docs/architecture.md, "LightningRL").

A rollout is one episode; its LLM calls, ordered by start time, are the actions a_0 … a_{T-1}.
Each policy is a pure function ``policy(call_rewards, final_reward, gamma) -> credit`` with one
credit value per call, and ``POLICIES`` is the closed set the config accepts. Given
``rollout_index`` (each call's rollout), the same function credits many rollouts at once: the
builder calls it once per build, not once per rollout.

- ``identical`` — LightningRL as published: Luo et al. 2025, "Agent Lightning: Train ANY AI
  Agents with Reinforcement Learning", arXiv 2508.03680 (the LightningRL algorithm): every
  action of an episode receives the episode's final reward, and each call is then optimised
  as a single-turn sample.
- ``discounted`` — return-to-go, Sutton & Barto 2018, "Reinforcement Learning: An
  Introduction", eq. 3.9: G_t = r_t + γ G_{t+1}, G_T = 0, over per-call rewards r_t, so
  intermediate rewards count and a reward credits only the calls made before it.

Per-call rewards r_t come from :func:`lightspan.store.attribution.rewards_per_call` (the store's,
so that the web UI shows the attribution the builder trains on): a reward is attributed to the latest
call that ended at or before the reward's time (end time of the reward span).

Deviations:

1. The paper's LightningRL assigns the *final* reward; with several reward spans ``identical``
   uses the last one the collector received (then by the sender's time, then span id: a
   sender's clock cannot make its reward the last) and ignores the others. Use
   ``discounted`` (γ = 1 sums them) to let every reward count.
2. A reward emitted before any call ended goes to the first call (r_0), not dropped: the agent
   reported it, so it must be credited somewhere, and only a call can hold it.
3. Reward names are not distinguished: every reward span of the rollout is a reward.
4. The paper's γ is implicit (1); here γ ∈ (0, 1] applies per *call*, not per token or second.
"""

from __future__ import annotations

import numpy as np

from lightspan.store.attribution import rewards_per_call

__all__ = ["POLICIES", "discounted", "identical", "rewards_per_call"]


def identical(call_rewards: np.ndarray, final_reward, gamma: float, *,
              rollout_index: np.ndarray | None = None) -> np.ndarray:
    """LightningRL (Luo et al. 2025): credit_t = R_final for every call t.

    Many rollouts at once: ``final_reward`` has one value per rollout and ``rollout_index``
    gives each call's rollout.
    """
    if rollout_index is None:
        return np.full(len(call_rewards), float(final_reward))
    return np.asarray(final_reward, dtype=np.float64)[np.asarray(rollout_index, dtype=np.int64)]


def discounted(call_rewards: np.ndarray, final_reward, gamma: float, *,
               rollout_index: np.ndarray | None = None) -> np.ndarray:
    """Return-to-go (Sutton & Barto eq. 3.9): G_t = r_t + γ G_{t+1}, G_T = 0.

    For one rollout of T calls it is this loop (tests/lightningrl/test_credit.py checks the code
    against it on random rollouts)::

        G, future = [0.0] * T, 0.0
        for t in reversed(range(T)):
            future = r[t] + gamma * future
            G[t] = future

    Many rollouts at once: ``rollout_index`` (ascending, calls of one rollout contiguous, in
    call order) gives each call's rollout; G_T = 0 at the end of every rollout. The code runs the
    loop's step for every rollout at once: first the last call of each, then the ones before,
    as many steps as the longest rollout has calls.
    """
    r = np.asarray(call_rewards, dtype=np.float64)
    n = len(r)
    G = r.copy()
    if n == 0:
        return G
    idx = np.zeros(n, dtype=np.int64) if rollout_index is None else np.asarray(rollout_index, dtype=np.int64)
    # steps to the end of the rollout: 0 for its last call. The recursion runs one step for all
    # rollouts at once, from the last calls backwards: as many steps as the longest rollout.
    last = np.flatnonzero(np.append(idx[1:] != idx[:-1], True))
    ends = np.repeat(last, np.diff(np.concatenate([[-1], last])))
    to_end = ends - np.arange(n)
    order = np.argsort(to_end, kind="stable")
    bounds = np.searchsorted(to_end[order], np.arange(to_end.max() + 2))
    for k in range(1, len(bounds) - 1):
        t = order[bounds[k]:bounds[k + 1]]
        G[t] = r[t] + gamma * G[t + 1]
    return G


POLICIES = {"identical": identical, "discounted": discounted}
"""The closed set of credit policies, by config name."""
