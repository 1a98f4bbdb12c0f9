"""The transition builder's config: section ``[transitions]``, env ``LIGHTSPAN_TRANSITIONS_<FIELD>``.

Each field's ``help`` is its documentation and its ``--help``; bad values fail here, at
config load, with the field and the fix named (STYLE.md §1–2).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from lightspan.config import ConfigError, option

from .advantages import ESTIMATORS
from .credit import POLICIES

SECTION = "transitions"


@dataclass(frozen=True)
class TransitionsConfig:
    data_dir: str = option(
        "./lightspan-data", "Data directory holding spans/ and transitions/ (Parquet).",
        env="LIGHTSPAN_DATA_DIR")
    credit: str = option(
        "identical",
        "Credit assignment policy. 'identical': LightningRL (Luo et al. 2025, arXiv 2508.03680), "
        "the rollout's final reward goes to every LLM call. 'discounted': return-to-go "
        "G_t = r_t + gamma * G_{t+1} over per-call rewards, so intermediate rewards count.",
        choices=tuple(POLICIES))
    gamma: float = option(
        1.0, "Discount factor in (0, 1] for credit='discounted' (unused by 'identical').")
    advantage: str = option(
        "grpo",
        "Group advantage estimator over the rollouts of one task. 'grpo': (r - mean)/(std + eps) "
        "(Shao et al. 2024, DeepSeekMath); 'dr_grpo': r - mean (Liu et al. 2025, Dr. GRPO); "
        "'rloo': r minus the mean of the other rollouts (Ahmadian et al. 2024).",
        choices=tuple(ESTIMATORS))
    split: str = option(
        "train", "Build transitions for rollouts of this split (a rollout without one is 'train').")
    agent_match: str = option(
        "", "Python regex searched in each call's gen_ai.agent.name; only matching calls are "
        "actions to train (empty: every call). A call without an agent name is matched as ''.")
    min_group_size: int = option(
        2, "Groups (rollouts of one task in one build) smaller than this are dropped and counted "
        "(transitions/dropped_rollouts/small_group).")
    grace_s: float = option(
        30.0, "A rollout without the runner's end span (lightspan.runner) counts as complete "
        "once its last span ended more than this many seconds ago.")
    epsilon: float = option(
        1e-6, "Floor added to the group std by the 'grpo' estimator.")

    def __post_init__(self):
        def bad(name: str, problem: str, fix: str):
            raise ConfigError(SECTION, name, problem, fix)

        if self.credit not in POLICIES:
            bad("credit", f"unknown credit policy {self.credit!r}", f"use one of: {', '.join(POLICIES)}")
        if self.advantage not in ESTIMATORS:
            bad("advantage", f"unknown advantage estimator {self.advantage!r}",
                f"use one of: {', '.join(ESTIMATORS)}")
        if not (isinstance(self.gamma, (int, float)) and 0.0 < self.gamma <= 1.0):
            bad("gamma", f"{self.gamma!r} is outside (0, 1]",
                "give a discount in (0, 1]; 1.0 sums rewards undiscounted")
        if not self.split:
            bad("split", "is empty", "name a split, e.g. 'train'")
        try:
            re.compile(self.agent_match)
        except (re.error, TypeError) as err:
            bad("agent_match", f"{self.agent_match!r} is not a valid regex ({err})",
                "give a Python regular expression, or '' to match every agent")
        if not (isinstance(self.min_group_size, int) and self.min_group_size >= 1):
            bad("min_group_size", f"{self.min_group_size!r} is below 1",
                "give an integer >= 1; GRPO needs >= 2 rollouts per task for a non-zero advantage")
        if not (isinstance(self.grace_s, (int, float)) and math.isfinite(self.grace_s) and self.grace_s >= 0):
            bad("grace_s", f"{self.grace_s!r} is not a finite number of seconds >= 0",
                "give the seconds to wait for a rollout without a runner end span, e.g. 30")
        if not (isinstance(self.epsilon, (int, float)) and math.isfinite(self.epsilon) and self.epsilon > 0):
            bad("epsilon", f"{self.epsilon!r} is not > 0",
                "give a small positive std floor, e.g. 1e-6")
