"""The transition builder over hand-built span trees (lightningrl/builder.py, selection.py, assignment.py, config.py)."""

import json
import math
import random
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightspan import store
from lightspan.core.config import ConfigError, resolve
from lightspan.lightningrl import builder
from lightspan.lightningrl.config import TransitionsConfig
from tests.collector.helpers import query
from tests.lightningrl.helpers import EPS, NOW, T0, build, call, episode, reward, rows_by_id, runner, span, write


# --- config -----------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("gamma", 0.0), ("gamma", 1.5), ("credit", "shapley"), ("advantage", "ppo"),
    ("agent_match", "(unclosed"), ("min_group_size", 0), ("grace_s", -1.0), ("epsilon", 0.0),
    ("split", ""), ("group_by", "prompt"),
])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ConfigError) as err:
        TransitionsConfig(**{field: value})
    assert err.value.field == f"transitions.{field}"
    assert "fix:" in str(err.value)


def test_config_resolves_with_env_alias_and_choices(tmp_path):
    cfg = resolve(TransitionsConfig, section="transitions",
                  environ={"LIGHTSPAN_DATA_DIR": str(tmp_path), "LIGHTSPAN_TRANSITIONS_GAMMA": "0.9"},
                  cli={"credit": "discounted"})
    assert (cfg.data_dir, cfg.gamma, cfg.credit, cfg.advantage) == (str(tmp_path), 0.9, "discounted", "grpo")
    with pytest.raises(ConfigError):
        resolve(TransitionsConfig, section="transitions", environ={}, cli={"advantage": "ppo"})


# --- credit and advantages end to end ---------------------------------------------------------

def test_identical_grpo_by_hand(tmp_path):
    write(tmp_path, episode("a", 1.0, calls=2) + episode("b", 0.0) + episode("c", 0.5))
    table, m = build(tmp_path)
    assert table.schema == store.TRANSITION_SCHEMA
    assert table.num_rows == 4
    s = math.sqrt(1 / 6)   # population std of [1, 0, 0.5]
    expect = {"a": 0.5 / (s + EPS), "b": -0.5 / (s + EPS), "c": 0.0}
    by_rollout = {}
    for r in table.to_pylist():
        by_rollout.setdefault(r["rollout_id"], []).append(r)
        assert r["transition_id"].startswith(r["rollout_id"] + "/")
        assert r["credit"] == r["reward"]
        assert r["advantage"] == pytest.approx(expect[r["rollout_id"]])
        assert (r["credit_policy"], r["advantage_estimator"]) == ("identical", "grpo")
        assert (r["task_id"], r["split"], r["agent_name"], r["model_version"]) == ("t1", "train", "solver", 3)
        assert r["prompt_token_ids"] == [1, 2, 3] and r["completion_token_ids"] == [4, 5]
        assert r["completion_logprobs"] == [-0.5, -0.5]
        assert r["created_unix_nano"] == NOW
    a = sorted(by_rollout["a"], key=lambda r: r["call_index"])
    assert [(r["call_index"], r["num_calls"]) for r in a] == [(0, 2), (1, 2)]
    assert len({r["build_id"] for r in table.to_pylist()}) == 1
    assert m["transitions/rollouts"] == 3 and m["transitions/calls"] == 4 and m["transitions/groups"] == 1
    assert m["transitions/reward_mean"] == pytest.approx(0.5)
    assert m["transitions/completion_tokens"] == 8


def test_each_rollout_counts_once_in_its_group(tmp_path):
    # a makes 5 calls: the group mean stays (1 + 0)/2, not (5·1 + 0)/6
    write(tmp_path, episode("a", 1.0, calls=5) + episode("b", 0.0))
    table, _ = build(tmp_path, advantage="dr_grpo")
    adv = {(r["rollout_id"], r["call_index"]): r["advantage"] for r in table.to_pylist()}
    assert adv == {**{("a", i): pytest.approx(0.5) for i in range(5)}, ("b", 0): pytest.approx(-0.5)}


def test_group_by_batch_makes_one_group_of_rollouts_with_different_tasks(tmp_path):
    # live traffic: no task repeats, so by task every rollout is a group of one (dropped as small_group);
    # by batch the build's rollouts are one group, each compared with their mean
    write(tmp_path, episode("a", 1.0, task="q1") + episode("b", 0.0, task="q2") + episode("c", 0.5, task="q3")
          + episode("v", 1.0, task="q4", split="val"))
    table, m = build(tmp_path)
    assert table.num_rows == 0 and m["transitions/dropped_rollouts/small_group"] == 3
    fresh = tmp_path / "batch"
    write(fresh, episode("a", 1.0, task="q1") + episode("b", 0.0, task="q2") + episode("c", 0.5, task="q3")
          + episode("v", 1.0, task="q4", split="val"))
    table, m = build(fresh, group_by="batch")
    s = math.sqrt(1 / 6)   # population std of [1, 0, 0.5]; the val rollout is another split, not built
    assert {r["rollout_id"]: r["advantage"] for r in table.to_pylist()} == pytest.approx(
        {"a": 0.5 / (s + EPS), "b": -0.5 / (s + EPS), "c": 0.0})
    assert m["transitions/groups"] == 1 and {r["task_id"] for r in table.to_pylist()} == {"q1", "q2", "q3"}


def test_discounted_dr_grpo_by_hand(tmp_path):
    # a: calls 0–10, 20–30, 40–50; rewards 0.1 at 5 (before any call ends → call 0), 0.2 at 25
    # (call 1 ends at 30 → call 0), 1.0 at 55 → r = [0.3, 0, 1]; γ = 0.5 → G = [0.55, 0.5, 1]
    a = [call("a", 0, 10), call("a", 20, 30), call("a", 40, 50), reward("a", 5, 0.1),
         reward("a", 25, 0.2), reward("a", 55, 1.0), runner("a", 60)]
    write(tmp_path, a + episode("b", 0.25))   # b: G = [0.25]
    table, m = build(tmp_path, credit="discounted", gamma=0.5, advantage="dr_grpo")
    got = {(r["rollout_id"], r["call_index"]): (r["credit"], r["advantage"], r["reward"]) for r in table.to_pylist()}
    # baseline = mean of rollout returns G_0 = (0.55 + 0.25) / 2 = 0.4
    expect = {("a", 0): (0.55, 0.15, 1.0), ("a", 1): (0.5, 0.1, 1.0), ("a", 2): (1.0, 0.6, 1.0),
              ("b", 0): (0.25, -0.15, 0.25)}
    assert set(got) == set(expect)
    for k, v in expect.items():
        assert got[k] == pytest.approx(v)
    assert m["transitions/return_mean"] == pytest.approx(0.4)


def test_identical_uses_the_last_reward_by_time(tmp_path):
    a = [call("a", 0, 10), reward("a", 30, 0.7), reward("a", 12, 0.1), runner("a", 40)]
    write(tmp_path, a + episode("b", 0.0))
    table, _ = build(tmp_path, advantage="dr_grpo")
    got = {r["rollout_id"]: (r["reward"], r["credit"], r["advantage"]) for r in table.to_pylist()}
    assert got["a"] == pytest.approx((0.7, 0.7, 0.35))


def test_a_reward_naming_a_call_is_that_calls_and_not_the_rollouts_final(tmp_path):
    # a person scores call 0 (at 100, after everything): by time it would be call 1's, and the
    # rollout's last reward; naming the call makes it call 0's, and R stays the agent's 1.0
    first, second = call("a", 0, 10), call("a", 20, 30)
    scored = reward("a", 100, 0.5, attributes=[("lightspan.reward.call_span_id", json.dumps(first["span_id"]))])
    write(tmp_path, [first, second, reward("a", 35, 1.0), runner("a", 40), scored] + episode("b", 0.0))
    table, _ = build(tmp_path, credit="discounted", gamma=1.0, advantage="dr_grpo")
    got = {(r["rollout_id"], r["call_index"]): (r["credit"], r["advantage"], r["reward"]) for r in table.to_pylist()}
    # r = [0.5, 1.0] -> G = [1.5, 1.0]; baseline (1.5 + 0) / 2
    assert got == {("a", 0): pytest.approx((1.5, 0.75, 1.0)), ("a", 1): pytest.approx((1.0, 0.25, 1.0)),
                   ("b", 0): pytest.approx((0.0, -0.75, 0.0))}
    assert query(tmp_path, "SELECT final_reward FROM rollouts WHERE rollout_key = 'a'") == [(1.0,)]


def test_rloo_by_hand_with_two_tasks(tmp_path):
    write(tmp_path, episode("a", 1.0) + episode("b", 0.0) + episode("c", 0.0)
          + episode("x", 2.0, task="t2") + episode("y", 4.0, task="t2"))
    table, m = build(tmp_path, advantage="rloo")
    got = {r["rollout_id"]: r["advantage"] for r in table.to_pylist()}
    assert got == pytest.approx({"a": 1.0, "b": -0.5, "c": -0.5, "x": -2.0, "y": 2.0})
    assert m["transitions/groups"] == 2


def test_rollout_keyed_by_trace_id_without_rollout_id(tmp_path):
    tr1, tr2 = "a" * 32, "b" * 32
    rows = [call(None, 0, 10, trace=tr1), reward(None, 20, 1.0, trace=tr1),
            call(None, 0, 10, trace=tr2), reward(None, 20, 0.0, trace=tr2)]
    write(tmp_path, rows)
    table, m = build(tmp_path)
    assert sorted(table.column("rollout_id").to_pylist()) == [tr1, tr2]
    assert m["transitions/rollouts"] == 2


# --- idempotency and duplicates ---------------------------------------------------------------

def test_second_build_emits_nothing(tmp_path):
    write(tmp_path, episode("a", 1.0, calls=2) + episode("b", 0.0))
    cfg = TransitionsConfig(data_dir=str(tmp_path), grace_s=0.0)
    first = builder.run(cfg)
    assert first["transitions/calls"] == 3
    second = builder.run(cfg)
    assert second["transitions/calls"] == 0 and second["transitions/rollouts"] == 0
    # a new group arriving later is built alone, the old one stays built once
    write(tmp_path, episode("c", 1.0, task="t2") + episode("d", 0.5, task="t2"))
    third = builder.run(cfg)
    assert third["transitions/rollouts"] == 2
    con = store.connect(tmp_path)
    ids = [r[0] for r in con.execute("SELECT transition_id FROM transitions").fetchall()]
    assert len(ids) == len(set(ids)) == 5


def test_duplicate_spans_never_double_count(tmp_path):
    rows = episode("a", 1.0, calls=2) + episode("b", 0.0)
    write(tmp_path, rows)
    once, m1 = build(tmp_path)
    write(tmp_path, rows)                 # at-least-once delivery: every span again
    write(tmp_path, rows[:2])
    twice, m2 = build(tmp_path)
    assert twice.num_rows == once.num_rows == 3
    strip = ("build_id",)
    assert ({k: {c: v for c, v in r.items() if c not in strip} for k, r in rows_by_id(once).items()}
            == {k: {c: v for c, v in r.items() if c not in strip} for k, r in rows_by_id(twice).items()})
    assert m1["transitions/reward_mean"] == m2["transitions/reward_mean"]


# --- drops, by reason -------------------------------------------------------------------------

def test_drops_are_counted_by_reason(tmp_path):
    rows = episode("ok1", 1.0) + episode("ok2", 0.0)
    rows += [call("notok", 0, 10, tokens=False), reward("notok", 20, 1.0), runner("notok", 25)]
    rows += [call("norew", 0, 10), runner("norew", 25)]
    rows += [call("fail", 0, 10), reward("fail", 20, 1.0), runner("fail", 25, "failed")]
    rows += [call("slow", 0, 10), reward("slow", 20, 1.0), runner("slow", 25, "timeout")]
    rows += [call("errd", 0, 10), reward("errd", 20, 1.0), runner("errd", 25, "failed", attribute=False)]
    rows += [call("down", 0, 10), runner("down", 25, "infra")]    # a service it needs was down: not a 0
    rows += [call("live", 0, 10), reward("live", 20, 1.0)]       # no runner, last span ends near NOW
    rows[-2]["end_time_unix_nano"] = rows[-1]["end_time_unix_nano"] = NOW - 10**9
    rows += episode("alone", 1.0, task="t9")                          # a group of one
    write(tmp_path, rows)
    # the agent's failures dropped too (the default trains them: tests/lightningrl/test_outcomes.py)
    table, m = build(tmp_path, grace_s=30.0, outcomes="failed=dropped,timeout=dropped")
    assert set(table.column("rollout_id").to_pylist()) == {"ok1", "ok2"}
    assert {k.rsplit("/", 1)[1]: v for k, v in m.items() if "dropped_rollouts" in k} == {
        "no_token_ids": 1, "no_reward": 1, "failed": 2, "timeout": 1, "infra": 1, "incomplete": 1,
        "small_group": 1, "agent_mismatch": 0, "split": 0, "duplicate": 0, "time_window": 0,
        "model_version": 0, "truncated": 0, "other_policy": 0, "not_selected": 0}


def test_rollout_without_runner_completes_after_grace(tmp_path):
    rows = [call("a", 0, 10), reward("a", 20, 1.0), call("b", 0, 10), reward("b", 20, 0.0)]
    write(tmp_path, rows)
    _, early = build(tmp_path, now=T0 + 20 + 29 * 10**9, grace_s=30.0)
    assert early["transitions/dropped_rollouts/incomplete"] == 2 and early["transitions/calls"] == 0
    table, late = build(tmp_path, now=T0 + 20 + 31 * 10**9, grace_s=30.0)
    assert late["transitions/rollouts"] == 2 and late["transitions/dropped_rollouts/incomplete"] == 0


def test_runner_span_ends_a_rollout_at_once(tmp_path):
    write(tmp_path, episode("a", 1.0) + episode("b", 0.0))
    _, m = build(tmp_path, now=T0 + 100, grace_s=3600.0)
    assert m["transitions/rollouts"] == 2


def test_failed_root_rollout_span_is_a_failure(tmp_path):
    rows = episode("a", 1.0) + episode("b", 0.0) + episode("c", 0.0)
    rows.append(span("c", "lightspan.rollout", 0, 50, status_code="ERROR"))
    write(tmp_path, rows)
    table, m = build(tmp_path)         # the default: trained as a failure with its real reward
    assert dict(zip(table.column("rollout_id").to_pylist(), table.column("outcome").to_pylist())) == {
        "a": "ok", "b": "ok", "c": "failed"}
    table, m = build(tmp_path, outcomes="failed=dropped")
    assert set(table.column("rollout_id").to_pylist()) == {"a", "b"}
    assert m["transitions/dropped_rollouts/failed"] == 1


def test_calls_without_token_ids_are_dropped_and_counted(tmp_path):
    a = [call("a", 0, 10), call("a", 20, 30, tokens=False), call("a", 40, 50, completion=(7, 8, 9),
         logprobs=(-1.0,)), call("a", 60, 70, completion=(6,)), reward("a", 80, 1.0), runner("a", 90)]
    write(tmp_path, a + episode("b", 0.0))
    table, m = build(tmp_path)
    a_rows = sorted((r for r in table.to_pylist() if r["rollout_id"] == "a"), key=lambda r: r["call_index"])
    assert [(r["call_index"], r["num_calls"], r["completion_token_ids"]) for r in a_rows] == [(0, 2, [4, 5]), (1, 2, [6])]
    assert m["transitions/dropped_calls/no_token_ids"] == 2
    assert m["transitions/calls"] == 3


def test_agent_match_keeps_only_matching_calls(tmp_path):
    a = [call("a", 0, 10, agent="planner"), call("a", 20, 30, agent="coder"),
         call("a", 40, 50, agent="planner"), reward("a", 35, 0.5), reward("a", 60, 1.0), runner("a", 70)]
    b = [call("b", 0, 10, agent="coder"), reward("b", 20, 0.0), runner("b", 25)]
    c = [call("c", 0, 10, agent="planner"), reward("c", 20, 1.0), runner("c", 25)]
    write(tmp_path, a + b + c)
    table, m = build(tmp_path, agent_match="^coder$", credit="discounted", advantage="dr_grpo")
    got = {r["rollout_id"]: (r["agent_name"], r["credit"], r["advantage"]) for r in table.to_pylist()}
    # a's only action is its coder call: both rewards (at 35 and 60) follow it → G_0 = 1.5
    assert got == {"a": ("coder", 1.5, pytest.approx(0.75)), "b": ("coder", 0.0, pytest.approx(-0.75))}
    assert m["transitions/dropped_calls/agent_mismatch"] == 2
    assert m["transitions/dropped_rollouts/agent_mismatch"] == 1


def test_only_the_configured_split_is_built(tmp_path):
    rows = episode("a", 1.0) + episode("b", 0.0) + episode("v1", 1.0, split="val") + episode("v2", 0.0, split="val")
    rows += episode("n1", 1.0, task="t2", split=None) + episode("n2", 0.0, task="t2", split=None)
    write(tmp_path, rows)
    train, _ = build(tmp_path)
    assert set(train.column("rollout_id").to_pylist()) == {"a", "b", "n1", "n2"}
    assert set(train.column("split").to_pylist()) == {"train"}
    val, _ = build(tmp_path, split="val")
    assert set(val.column("rollout_id").to_pylist()) == {"v1", "v2"}


def test_empty_store(tmp_path):
    table, m = build(tmp_path)
    assert table.num_rows == 0 and table.schema == store.TRANSITION_SCHEMA
    assert m["transitions/rollouts"] == 0 and math.isnan(m["transitions/reward_mean"])
    assert builder.run(TransitionsConfig(data_dir=str(tmp_path)))["transitions/calls"] == 0
    assert not (tmp_path / "transitions").exists()


# --- properties -------------------------------------------------------------------------------

def _strip(table):
    return sorted((tuple(v for k, v in r.items() if k not in ("build_id",)) for r in table.to_pylist()))


rollout_st = st.tuples(
    st.integers(0, 2),                                            # task
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), min_size=1, max_size=3),  # calls (start, dur)
    st.lists(st.tuples(st.integers(0, 80), st.sampled_from([0.0, 0.25, 0.5, 1.0])), min_size=0, max_size=3),
)


@settings(max_examples=12, deadline=None)
@given(rollouts=st.lists(rollout_st, min_size=1, max_size=6), seed=st.integers(0, 2**31 - 1),
       cfg=st.sampled_from([("identical", "grpo"), ("discounted", "rloo"), ("discounted", "dr_grpo")]))
def test_result_is_independent_of_span_arrival_order(rollouts, seed, cfg):
    rows = []
    for i, (task, calls, rewards) in enumerate(rollouts):
        rid = f"r{i}"
        rows += [call(rid, s, s + d, task=f"t{task}", completion=(i, s)) for s, d in calls]
        rows += [reward(rid, t, v, task=f"t{task}") for t, v in rewards]
        rows.append(runner(rid, 200, task=f"t{task}"))
    shuffled = rows[:]
    random.Random(seed).shuffle(shuffled)
    cut = sorted(random.Random(seed + 1).sample(range(len(rows) + 1), 2))
    kw = dict(credit=cfg[0], advantage=cfg[1], gamma=0.9)
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        write(d1, rows)
        for part in (shuffled[:cut[0]], shuffled[cut[0]:cut[1]], shuffled[cut[1]:]):
            if part:
                write(d2, part)
        t1, m1 = build(d1, **kw)
        t2, m2 = build(d2, **kw)
    assert _strip(t1) == _strip(t2)
    for k in m1:
        if k not in ("transitions/build_seconds", "transitions/token_files_read"):
            assert m1[k] == m2[k] or (math.isnan(m1[k]) and math.isnan(m2[k])), k
    if t1.num_rows:
        # every emitted rollout sits in a group; advantages are zero-mean at rollout level
        per = {}
        for r in t1.to_pylist():
            per.setdefault(r["task_id"], {})[r["rollout_id"]] = r
        if cfg[0] == "identical":
            for group in per.values():
                assert abs(sum(r["advantage"] for r in group.values())) < 1e-6
        assert np.all(np.isfinite(t1.column("advantage").to_numpy()))
