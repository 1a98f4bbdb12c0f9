"""Group advantage estimators at rollout level (docs/architecture.md, "LightningRL").

A group g is the rollouts of one task; r_i is rollout i's return, one number per rollout, so a
rollout counts once in its group's statistics however many LLM calls it made. Each estimator
is a pure function of (rewards, group_ids) with keyword-only options, and all three have the
form Â_i = (r_i − b_i) / s_i with a baseline b_i and a scale s_i taken from the group:

- ``grpo`` — Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300, §4.1.2 (outcome
  supervision): Â_i = (r_i − mean(r_g)) / (std(r_g) + ε).
- ``dr_grpo`` — Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
  Perspective" (Dr. GRPO), arXiv 2503.20783: Â_i = r_i − mean(r_g), no std division.
- ``rloo`` — Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization
  for Learning from Human Feedback in LLMs", arXiv 2402.14740 (after Kool et al.
  2019): Â_i = r_i − mean_{j≠i} r_j.

Per-call advantages. Given ``credit`` (one value per call) and ``rollout_index`` (the rollout
of each call), call t of rollout i gets Â_t = (credit_t − b_i) / s_i: the baseline and scale
stay those of the rollout returns. With ``identical`` credit (credit_t = r_i) this is exactly
Â_i for every call; with ``discounted`` credit the return-to-go G_t is compared with the
group's rollout returns G_0.

Deviations:

1. GRPO's std is the population std (ddof 0); TRL's GRPOTrainer uses the sample std (ddof 1).
2. ε is added to the std (DeepSeekMath divides by the std alone) so a group whose rewards are
   all equal gets Â = 0 instead of 0/0.
3. A group of one rollout gets Â = 0 under every estimator (RLOO's leave-one-out mean is
   undefined); the builder drops groups below ``min_group_size`` (default 2) before this.
"""

from __future__ import annotations

import numpy as np


def _group_stats(rewards: np.ndarray, group_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rollout: its group's mean, population std and size."""
    _, g = np.unique(np.asarray(group_ids), return_inverse=True)
    g = g.reshape(-1)
    n = np.bincount(g).astype(np.float64)
    mean = np.bincount(g, weights=rewards) / n
    dev = rewards - mean[g]
    std = np.sqrt(np.bincount(g, weights=dev * dev) / n)
    return mean[g], std[g], n[g]


def _advantage(rewards, baseline, scale, credit, rollout_index) -> np.ndarray:
    """(x − b) / s per rollout (x = r_i), or per call (x = credit_t, b and s of its rollout)."""
    if credit is None:
        return (rewards - baseline) / scale
    if rollout_index is None:
        raise ValueError("per-call advantages need rollout_index along with credit")
    i = np.asarray(rollout_index, dtype=np.int64)
    return (np.asarray(credit, dtype=np.float64) - baseline[i]) / scale[i]


def grpo(rewards, group_ids, *, epsilon: float, credit=None, rollout_index=None) -> np.ndarray:
    """GRPO (Shao et al. 2024): Â_i = (r_i − mean(r_g)) / (std(r_g) + ε)."""
    r = np.asarray(rewards, dtype=np.float64)
    mean, std, _ = _group_stats(r, group_ids)
    return _advantage(r, mean, std + epsilon, credit, rollout_index)


def dr_grpo(rewards, group_ids, *, epsilon: float = 0.0, credit=None, rollout_index=None) -> np.ndarray:
    """Dr. GRPO (Liu et al. 2025): Â_i = r_i − mean(r_g). ``epsilon`` is unused."""
    r = np.asarray(rewards, dtype=np.float64)
    mean, _, _ = _group_stats(r, group_ids)
    return _advantage(r, mean, np.ones_like(r), credit, rollout_index)


def rloo(rewards, group_ids, *, epsilon: float = 0.0, credit=None, rollout_index=None) -> np.ndarray:
    """RLOO (Ahmadian et al. 2024): Â_i = r_i − (Σ_g r − r_i) / (n_g − 1). ``epsilon`` is unused."""
    r = np.asarray(rewards, dtype=np.float64)
    mean, _, n = _group_stats(r, group_ids)
    # leave-one-out mean; a group of one is its own baseline (Â = 0)
    others = np.where(n > 1, (mean * n - r) / np.maximum(n - 1, 1), r)
    return _advantage(r, others, np.ones_like(r), credit, rollout_index)


ESTIMATORS = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}
"""The closed set of advantage estimators, by config name."""
