"""The canary's decision rule: a one-sided Welch t-test with a non-inferiority margin.

The candidate version's rewards ``c`` and the serving version's ``s`` (one per rewarded rollout,
the latest ``window`` of each arm) are compared on their difference of means δ = mean(c) − mean(s):

1. fewer than ``min_rollouts`` rewarded rollouts on either arm: **wait**;
2. t = (δ + margin) / sqrt(var(c)/n_c + var(s)/n_s), with the Welch–Satterthwaite degrees of
   freedom (Welch 1947), p = P(T_df ≥ t) under H0: δ = −margin;
3. p < 1 − confidence: the candidate is worse than the serving version by less than ``margin``
   with that confidence (non-inferior): **promote**;
4. p > confidence: it is worse by more than ``margin`` with that confidence: **rollback**;
5. otherwise **wait** for more rollouts. Equal rewards on enough rollouts promote (δ = 0 > −margin);
   with ``margin = 0`` a candidate must be better to be promoted, and equal ones wait (or a person
   decides, ``lightspan deploy``).

Why Welch's t: what is compared is the mean reward (what GRPO raises), the arms' variances differ
(a broken version's rewards are often all 0), and rollout rewards are bounded, so with the tens of
rollouts ``min_rollouts`` asks for the mean's sampling distribution is close to normal; the test is
closed-form and deterministic (a bootstrap would need a seed and thousands of resamples per check);
the t tail is scipy's.
Mann–Whitney tests stochastic order, not the mean, and its normal approximation breaks on the many
ties of 0/1 rewards. Departures: (1) when both arms have zero variance the sign of δ + margin
decides (t = ±∞); (2) the window is a sliding one per arm, so a long canary judges its recent
rollouts; repeated looks at the data raise the false-decision rate above 1 − confidence (no
sequential correction: a margin and a high confidence are the guard).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

WAIT, PROMOTE, ROLLBACK = "wait", "promote", "rollback"


@dataclass(frozen=True)
class Evidence:
    """What a decision rests on (stored with it, store/deployments.py)."""

    action: str
    candidate_rollouts: int
    serving_rollouts: int
    candidate_reward_mean: float | None
    serving_reward_mean: float | None
    t_statistic: float | None = None
    df: float | None = None
    p_value: float | None = None
    reason: str = ""

    def columns(self) -> dict:
        """The evidence columns of a ``deployments`` row."""
        return {k: getattr(self, k) for k in ("candidate_rollouts", "serving_rollouts", "candidate_reward_mean",
                                              "serving_reward_mean", "t_statistic", "df", "p_value")}


def t_sf(t: float, df: float) -> float:
    """P(T >= t) for Student's t with ``df`` degrees of freedom (scipy's)."""
    from scipy.stats import t as student_t      # lazily: the gateway imports this module at start

    return float(student_t.sf(t, df))


def _moments(xs: list[float]) -> tuple[float, float]:
    mean = sum(xs) / len(xs)
    return mean, sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)


def decide(candidate: list[float], serving: list[float], *, min_rollouts: int, confidence: float,
           margin: float) -> Evidence:
    """The rule of the module docstring over the arms' rewards (each the window's, newest last)."""
    n_c, n_s = len(candidate), len(serving)
    mean_c = sum(candidate) / n_c if n_c else None
    mean_s = sum(serving) / n_s if n_s else None
    if min(n_c, n_s) < max(min_rollouts, 2):
        return Evidence(WAIT, n_c, n_s, mean_c, mean_s,
                        reason=f"{n_c} candidate and {n_s} serving rewarded rollouts; each arm needs {min_rollouts}")
    (mean_c, var_c), (mean_s, var_s) = _moments(candidate), _moments(serving)
    shift = mean_c - mean_s + margin
    se2 = var_c / n_c + var_s / n_s
    if se2 == 0.0:
        t, df = (math.copysign(math.inf, shift) if shift else 0.0), float(n_c + n_s - 2)
    else:
        t = shift / math.sqrt(se2)
        df = se2 ** 2 / ((var_c / n_c) ** 2 / (n_c - 1) + (var_s / n_s) ** 2 / (n_s - 1))
    p = 0.5 if t == 0.0 else t_sf(t, df)
    alpha = 1.0 - confidence
    delta = f"mean reward {mean_c:.4g} vs {mean_s:.4g} (margin {margin:g}, one-sided Welch p={p:.3g})"
    if p < alpha:
        return Evidence(PROMOTE, n_c, n_s, mean_c, mean_s, t, df, p, f"not worse by {margin:g}: {delta}")
    if p > confidence:
        return Evidence(ROLLBACK, n_c, n_s, mean_c, mean_s, t, df, p, f"worse by more than {margin:g}: {delta}")
    return Evidence(WAIT, n_c, n_s, mean_c, mean_s, t, df, p, f"undecided at confidence {confidence:g}: {delta}")
