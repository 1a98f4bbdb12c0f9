"""The transition builder's config: section ``[transitions]``, env ``LIGHTSPAN_TRANSITIONS_<FIELD>``.

Each field's ``help`` is its documentation and its ``--help``; bad values fail here, at
config load, with the field and the fix named (``ConfigError``, core/config.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from lightspan.core.config import ConfigError, option, parse_duration
from lightspan.core.config import parse_time as core_parse_time
from lightspan.store.layout import DATA_DIR_ENV, DEFAULT_DATA_DIR
from lightspan.store.policies import POLICIES_ENV, TRANSITIONS_FIELDS, PolicyConfig, override
from lightspan.store.policies import load as load_policies

from .advantages import ESTIMATORS
from .credit import POLICIES

SECTION = "transitions"
OUTPUTS = ("per_call", "per_rollout")
GROUP_BY = ("task", "batch")
CAUSES = ("failed", "timeout", "infra")
"""Why a rollout did not end ``ok``: the runner's outcome (``lightspan.rollout.outcome``; a runner span
without it is ``failed`` iff its status is ERROR, as is a ``lightspan.rollout`` root span with status ERROR)."""
TRAIN_OUTCOMES = ("failed", "masked", "dropped")
"""What training does with such a rollout: ``failed`` trains it with its real reward (an agent's
failure is a failure, and no reward at all drops it as ``no_reward``: never a silent 0), ``masked``
keeps its reward in its group's baseline and gives its rows zero loss (loss_weight 0), ``dropped``
leaves it out and counts it (transitions/dropped_rollouts/<cause>)."""
DEFAULT_OUTCOMES = "failed=failed,timeout=failed,infra=dropped"


def parse_outcomes(text: str) -> dict[str, str]:
    """``'cause=outcome,...'`` as {cause: outcome} for every cause in :data:`CAUSES` (unnamed ones keep
    :data:`DEFAULT_OUTCOMES`'); ValueError naming the bad part."""
    out = dict(part.split("=") for part in DEFAULT_OUTCOMES.split(","))
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        cause, sep, outcome = (x.strip() for x in part.partition("="))
        if not sep or cause not in CAUSES or outcome not in TRAIN_OUTCOMES:
            raise ValueError(part)
        out[cause] = outcome
    return out


def check_turn_predicate(predicate: str) -> None:
    """Run ``predicate`` as a WHERE clause over an empty table with the ``llm_calls`` view's columns
    (the spans' plus ``rollout_key``); duckdb.Error if it is not a boolean expression over them."""
    import duckdb
    import pyarrow as pa

    from lightspan.store.schema import SPAN_SCHEMA

    if ";" in predicate:
        raise duckdb.ParserException("';': one boolean expression, not statements")
    con = duckdb.connect()
    try:
        empty = SPAN_SCHEMA.append(pa.field("rollout_key", pa.string())).empty_table()
        con.register("llm_calls", empty)
        con.execute(f"SELECT ({predicate})::BOOLEAN FROM llm_calls").fetchall()
    finally:
        con.close()


def parse_time(value: str) -> int | None:
    """Unix nanoseconds of a ``since``/``until`` bound: '' (no bound), an integer (unix ns) or an ISO
    8601 time (UTC unless it names a zone): :func:`lightspan.core.config.parse_time` in unix ns."""
    return core_parse_time(value, unit_ns=1)


@dataclass(frozen=True)
class TransitionsConfig:
    data_dir: str = option(
        DEFAULT_DATA_DIR, "Data directory holding spans/ and transitions/ (Parquet).",
        env=DATA_DIR_ENV)
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
        "", "Python regex searched in each call's agent name; only matching calls are actions "
        "to train (empty: every call). A call's agent is the nearest enclosing agent span (itself "
        "included: gen_ai.agent.name, an invoke_agent span, traceloop.span.kind=agent), else the "
        "resource's service.name; a call with neither is matched as ''.")
    group_by: str = option(
        "task", "What a group (whose rewards make each rollout's baseline) is: 'task', the rollouts of one "
        "task_id in a build, as GRPO samples several answers to one prompt (a rollout without a task is a "
        "group of its own); 'batch', every rollout of the build's split, a batch baseline for traffic "
        "where no prompt repeats (live users: REINFORCE with the batch's mean, scaled by its std under "
        "'grpo').", choices=GROUP_BY)
    min_group_size: int = option(
        2, "Groups (rollouts of one task in one build, or the build's rollouts under group_by 'batch') "
        "smaller than this are dropped and counted (transitions/dropped_rollouts/small_group).")
    grace_s: float = option(
        30.0, "A rollout without the runner's end span (lightspan.runner) counts as complete "
        "once its last span ended more than this many seconds ago.")
    epsilon: float = option(
        1e-6, "Floor added to the group std by the 'grpo' estimator.")
    output: str = option(
        "per_call",
        "'per_call': one transition per LLM call (each call a single-turn sample, as LightningRL "
        "trains). 'per_rollout': one sequence per rollout and agent, merging call k+1 into call k's "
        "sequence when its prompt starts with call k's prompt + completion; the tokens the model "
        "did not produce (tool outputs, user turns, template tokens) get completion_mask 0. A prompt "
        "that does not extend the sequence starts a new one and is counted by kind "
        "(transitions/prefix_mismatch/<compaction|chat_template|retokenization|tool_text|reply_dropped>): a new segment "
        "of the same rollout (columns segment, segment_cause). A sequence's advantage "
        "is its first call's: the rollout's under 'identical', the return-to-go from the sequence's "
        "start under 'discounted'.",
        choices=OUTPUTS)
    since: str = option(
        "", "Only rollouts that started at or after this time: ISO 8601 (UTC unless it names a "
        "zone) or unix nanoseconds; empty: no bound. Others: transitions/dropped_rollouts/time_window.")
    until: str = option(
        "", "Only rollouts that started before this time (same format as since); empty: no bound.")
    min_model_version: int | None = option(
        None, "Only rollouts whose every trainable call was served by a policy version >= this "
        "(a call without lightspan.model.version is outside any bound). Others: "
        "transitions/dropped_rollouts/model_version.")
    max_model_version: int | None = option(
        None, "Only rollouts whose every trainable call was served by a policy version <= this.")
    drop_truncated: bool = option(
        False, "Leave out calls that stopped at the length limit (finish reason 'length' or "
        "'max_tokens'): counted in transitions/dropped_calls/truncated; a rollout left without a "
        "trainable call is dropped as 'truncated'. Either way transitions/truncated_calls counts them.")
    policies: str = option(
        "", "A TOML file of [[policies]] (lightspan/store/policies.py): each policy's calls (those of the "
        "agents it owns) become its own transitions (column policy), in groups of its own, with its own "
        "credit, gamma and advantage, dropped calls counted per policy (transitions/policies/<name>/...). "
        "A call that recorded another policy (lightspan.policy.name) is not trained (other_policy). "
        "Empty: one unnamed policy trains the calls agent_match selects.", env=POLICIES_ENV)
    incremental: bool = option(
        True, "Keep a watermark in data_dir/lightningrl/state.json so a build reads only the rollouts "
        "with spans received since the last build (plus the still incomplete or too small ones). "
        "false: read every span each build. Either way a rollout is never emitted twice.")
    outcomes: str = option(
        DEFAULT_OUTCOMES,
        "What training does with a rollout that did not end ok, per cause: comma-separated cause=outcome. "
        "Causes: 'failed' (the agent's own failure: it crashed or exited non-zero, e.g. on an invalid action; "
        "or its lightspan.rollout root span has status ERROR), 'timeout' (it "
        "ran out of time), 'infra' (a service it needs was down, it could not start, or exited 75; not the "
        "agent's fault). Outcomes: 'failed' (trained with its real reward; with no reward at all it is "
        "dropped as no_reward, never a reward of 0), 'masked' (its reward counts in its group's baseline, "
        "its rows are written with loss_weight 0), 'dropped' (left out, counted in "
        "transitions/dropped_rollouts/<cause>). Rows carry the outcome (column outcome). Causes not named "
        "keep the default.")
    turn_last_k: int = option(
        0, "Train only the last k of a rollout's trainable calls (0: all). The others keep their place "
        "in the credit assignment and, with per_rollout, become context (mask 0); counted in "
        "transitions/dropped_calls/not_selected.")
    turn_select_sql: str = option(
        "", "Train only the calls for which this SQL predicate over the llm_calls view's columns is true "
        "(e.g. \"output_tokens > 5\" or \"NOT list_contains(finish_reasons, 'tool_calls')\"); empty: every "
        "call. Unselected calls keep their place in the credit assignment and are counted in "
        "transitions/dropped_calls/not_selected; a rollout left without a selected call is dropped as "
        "not_selected. Applied before turn_last_k.")
    watermark_lag_s: float = option(
        300.0, "Spans received within this many seconds before a build are read again by the next "
        "one, so spans still on their way from the collector's queue to Parquet are not missed.")
    every: str = option(
        "", "Build again on this schedule, a duration such as '30s' or '5m' (empty: build once and exit), "
        "each build's metrics a JSON line; a build that fails is logged and the next runs on time; "
        "SIGINT or SIGTERM stops after the current build. Incremental builds only.")

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
        if self.every:
            try:
                period = parse_duration(self.every)
            except ValueError:
                period = 0.0
            if period <= 0:
                bad("every", f"{self.every!r} is not a positive duration", "give e.g. '30s', '5m' or '1h30m'")
            if not self.incremental:
                bad("every", "a scheduled build must be incremental (each would store every rollout again)",
                    "drop --incremental false, or build once without --every")
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
        if self.group_by not in GROUP_BY:
            bad("group_by", f"unknown grouping {self.group_by!r}", f"use one of: {', '.join(GROUP_BY)}")
        if self.output not in OUTPUTS:
            bad("output", f"unknown output mode {self.output!r}", f"use one of: {', '.join(OUTPUTS)}")
        for name in ("since", "until"):
            try:
                parse_time(getattr(self, name))
            except (TypeError, ValueError):
                bad(name, f"{getattr(self, name)!r} is not a time",
                    "give an ISO 8601 timestamp such as 2026-11-30T12:00:00Z, unix nanoseconds, or ''")
        if self.since_unix_nano is not None and self.until_unix_nano is not None \
                and self.since_unix_nano >= self.until_unix_nano:
            bad("until", f"{self.until!r} is not after since={self.since!r}",
                "give an until later than since, or leave one of them empty")
        for name in ("min_model_version", "max_model_version"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool)):
                bad(name, f"{value!r} is not an integer", "give a policy version number, or leave it unset")
        if self.min_model_version is not None and self.max_model_version is not None \
                and self.min_model_version > self.max_model_version:
            bad("max_model_version", f"{self.max_model_version} is below min_model_version={self.min_model_version}",
                "give max_model_version >= min_model_version")
        try:
            object.__setattr__(self, "_outcomes", parse_outcomes(self.outcomes))
        except ValueError as err:
            bad("outcomes", f"{self.outcomes!r}: {str(err)!r} is not cause=outcome",
                f"give comma-separated cause=outcome with cause one of {', '.join(CAUSES)} and outcome one of "
                f"{', '.join(TRAIN_OUTCOMES)}, e.g. {DEFAULT_OUTCOMES!r}")
        if not (isinstance(self.turn_last_k, int) and not isinstance(self.turn_last_k, bool) and self.turn_last_k >= 0):
            bad("turn_last_k", f"{self.turn_last_k!r} is not an integer >= 0",
                "give how many of a rollout's last calls to train, or 0 to train them all")
        if self.turn_select_sql:
            import duckdb
            try:
                check_turn_predicate(self.turn_select_sql)
            except duckdb.Error as err:
                bad("turn_select_sql", f"{self.turn_select_sql!r} is not a predicate over llm_calls "
                    f"({str(err).splitlines()[0]})",
                    "give one SQL boolean expression over the llm_calls view's columns (lightspan sql "
                    "'DESCRIBE llm_calls'), e.g. 'output_tokens > 5', or '' to train every call")
        object.__setattr__(self, "_policies", ())
        if self.policies:
            if self.agent_match:
                bad("agent_match", "is set together with policies, whose agents say which calls train",
                    "drop agent_match, or the policies file")
            # each policy's own config: its credit, gamma and advantage, validated here
            base = dataclasses.replace(self, policies="")
            object.__setattr__(self, "_policies", tuple(
                (p, override(base, p, TRANSITIONS_FIELDS)) for p in load_policies(self.policies)))
        if not (isinstance(self.watermark_lag_s, (int, float)) and math.isfinite(self.watermark_lag_s)
                and self.watermark_lag_s >= 0):
            bad("watermark_lag_s", f"{self.watermark_lag_s!r} is not a finite number of seconds >= 0",
                "give the seconds spans may take from the collector to Parquet, e.g. 300")

    @property
    def policy_configs(self) -> tuple[tuple[PolicyConfig, "TransitionsConfig"], ...]:
        """(policy, its config) for each policy of the ``policies`` file; empty without one."""
        return self._policies

    @property
    def outcome_of(self) -> dict[str, str]:
        """{cause: what training does with it} for every cause in :data:`CAUSES` (``outcomes`` parsed)."""
        return dict(self._outcomes)

    @property
    def since_unix_nano(self) -> int | None:
        return parse_time(self.since)

    @property
    def until_unix_nano(self) -> int | None:
        return parse_time(self.until)
