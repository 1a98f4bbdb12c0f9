"""Four outcomes, not two, and turn selection (lightningrl/config.py's outcomes and turn_*,
selection_sql.py, assignment.py), over hand-built span trees with hand-computed advantages."""

import math

import pytest

from lightspan.core.config import ConfigError, resolve
from lightspan.lightningrl.config import TransitionsConfig
from tests.lightningrl.helpers import EPS, build, call, episode, reward, runner, write


def _rollouts():
    """a 1.0 and b 0.0 ok; c failed with its reward 0.5; d timed out without a reward; e failed for
    the infrastructure (with a reward it never earned: the harness's 0). All of task t1."""
    rows = episode("a", 1.0) + episode("b", 0.0)
    rows += [call("c", 0, 10), reward("c", 20, 0.5), runner("c", 25, "failed")]
    rows += [call("d", 0, 10), runner("d", 25, "timeout")]
    rows += [call("e", 0, 10), reward("e", 20, 0.0), runner("e", 25, "infra")]
    return rows


def test_by_default_the_agents_failures_train_with_their_real_reward(tmp_path):
    write(tmp_path, _rollouts())
    table, m = build(tmp_path)
    got = {r["rollout_id"]: (r["outcome"], r["reward"], r["loss_weight"], r["advantage"]) for r in table.to_pylist()}
    s = math.sqrt(1 / 6)        # population std of [1, 0, 0.5]
    assert got == {"a": ("ok", 1.0, 1.0, pytest.approx(0.5 / (s + EPS))),
                   "b": ("ok", 0.0, 1.0, pytest.approx(-0.5 / (s + EPS))),
                   "c": ("failed", 0.5, 1.0, pytest.approx(0.0))}
    assert (m["transitions/outcomes/ok"], m["transitions/outcomes/failed"], m["transitions/outcomes/masked"]) == (2, 1, 0)
    # d timed out without any reward: dropped and counted, never a 0; e is the infrastructure's
    assert m["transitions/dropped_rollouts/no_reward"] == 1 and m["transitions/dropped_rollouts/infra"] == 1
    assert m["transitions/dropped_rollouts/failed"] == m["transitions/dropped_rollouts/timeout"] == 0


def test_a_masked_rollout_counts_in_the_baseline_with_zero_loss(tmp_path):
    write(tmp_path, _rollouts())
    table, m = build(tmp_path, outcomes="failed=masked", advantage="dr_grpo")
    got = {r["rollout_id"]: (r["outcome"], r["loss_weight"], r["advantage"]) for r in table.to_pylist()}
    # the baseline is the mean of [1, 0, 0.5] with c in it; c's rows are written with loss weight 0
    assert got == {"a": ("ok", 1.0, pytest.approx(0.5)), "b": ("ok", 1.0, pytest.approx(-0.5)),
                   "c": ("masked", 0.0, pytest.approx(0.0))}
    assert m["transitions/outcomes/masked"] == 1 and m["transitions/rollouts"] == 3


def test_each_cause_can_be_dropped_and_is_counted(tmp_path):
    write(tmp_path, _rollouts())
    table, m = build(tmp_path, outcomes="failed=dropped, timeout=dropped, infra=masked")
    got = {r["rollout_id"]: r["outcome"] for r in table.to_pylist()}
    assert got == {"a": "ok", "b": "ok", "e": "masked"}
    assert m["transitions/dropped_rollouts/failed"] == 1 and m["transitions/dropped_rollouts/timeout"] == 1
    assert m["transitions/dropped_rollouts/no_reward"] == m["transitions/dropped_rollouts/infra"] == 0


@pytest.mark.parametrize("value", ["failed=ignored", "crash=failed", "failed", "ok=failed"])
def test_a_bad_outcomes_table_fails_at_config_load_naming_the_field(value):
    with pytest.raises(ConfigError) as err:
        TransitionsConfig(outcomes=value)
    assert err.value.field == "transitions.outcomes" and "fix:" in str(err.value)
    assert TransitionsConfig(outcomes="timeout=masked").outcome_of == {
        "failed": "failed", "timeout": "masked", "infra": "dropped"}


# --- turn selection ---------------------------------------------------------------------------

def _three_turns(rid, r, tokens, **kw):
    rows = [call(rid, 20 * i, 20 * i + 10, prompt=[1, 2 + i], completion=[10 + i], output_tokens=n, **kw)
            for i, n in enumerate(tokens)]
    return rows + [reward(rid, 15, 0.2), reward(rid, 60, r), runner(rid, 65)]


def test_a_sql_predicate_over_llm_calls_selects_the_turns(tmp_path):
    # a: output_tokens 2, 9, 7 -> calls 1 and 2 trained; b: 8 -> call 0 only; c: nothing selected
    write(tmp_path, _three_turns("a", 1.0, [2, 9, 7]) + _three_turns("b", 0.0, [8, 1]) + _three_turns("c", 0.0, [1]))
    table, m = build(tmp_path, turn_select_sql="output_tokens > 5", credit="discounted", advantage="dr_grpo")
    got = {(r["rollout_id"], r["call_index"]): (r["completion_token_ids"], r["credit"], r["advantage"])
           for r in table.to_pylist()}
    # unselected calls keep their place: the 0.2 after call 0 is call 0's, so a's call 1 has G_1 = 1.0;
    # the baseline is the mean of the rollouts' G_0: a 1.2, b 0.2
    assert got == {("a", 0): ([11], pytest.approx(1.0), pytest.approx(1.0 - 0.7)),
                   ("a", 1): ([12], pytest.approx(1.0), pytest.approx(1.0 - 0.7)),
                   ("b", 0): ([10], pytest.approx(0.2), pytest.approx(0.2 - 0.7))}
    assert m["transitions/dropped_rollouts/not_selected"] == 1
    assert m["transitions/dropped_calls/not_selected"] == 2 and m["transitions/calls"] == 3


def test_last_k_trains_the_last_turns_and_the_rest_become_context(tmp_path):
    def chain(rid, r):      # three calls that extend each other
        return [call(rid, 0, 10, prompt=[1], completion=[10]), call(rid, 20, 30, prompt=[1, 10, 50], completion=[11]),
                call(rid, 40, 50, prompt=[1, 10, 50, 11, 51], completion=[12]), reward(rid, 60, r), runner(rid, 65)]
    write(tmp_path, chain("a", 1.0) + chain("b", 0.0))
    table, m = build(tmp_path, turn_last_k=2, output="per_rollout")
    rows = sorted(table.to_pylist(), key=lambda r: r["rollout_id"])
    assert [(r["call_index"], r["prompt_token_ids"], r["completion_token_ids"], r["completion_mask"]) for r in rows] == [
        (0, [1, 10, 50], [11, 51, 12], [1, 0, 1])] * 2
    assert m["transitions/dropped_calls/not_selected"] == 2 and m["transitions/merge_rate"] == 1.0
    table, _ = build(tmp_path, turn_last_k=1)
    assert sorted(table.column("completion_token_ids").to_pylist()) == [[12], [12]]


@pytest.mark.parametrize("field, value", [
    ("turn_select_sql", "completion_tokens > 5"),        # not a column of llm_calls (output_tokens is)
    ("turn_select_sql", "output_tokens >"),
    ("turn_select_sql", "true; DROP TABLE spans"),
    ("turn_last_k", -1),
])
def test_bad_turn_selection_fails_at_config_load_naming_the_field(field, value):
    with pytest.raises(ConfigError) as err:
        TransitionsConfig(**{field: value})
    assert err.value.field == f"transitions.{field}" and "fix:" in str(err.value)


def test_outcomes_and_turn_selection_come_from_the_environment_and_command_line():
    cfg = resolve(TransitionsConfig, section="transitions",
                  environ={"LIGHTSPAN_TRANSITIONS_OUTCOMES": "failed=masked",
                           "LIGHTSPAN_TRANSITIONS_TURN_SELECT_SQL": "output_tokens > 5"},
                  cli={"turn_last_k": 2})
    assert cfg.outcome_of == {"failed": "masked", "timeout": "failed", "infra": "dropped"}
    assert (cfg.turn_select_sql, cfg.turn_last_k) == ("output_tokens > 5", 2)
    with pytest.raises(ConfigError) as err:
        resolve(TransitionsConfig, section="transitions", environ={"LIGHTSPAN_TRANSITIONS_OUTCOMES": "oops=failed"},
                cli={})
    assert err.value.field == "transitions.outcomes"
