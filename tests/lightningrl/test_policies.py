"""Several policies from one trace stream (lightspan/store/policies.py, the builder's passes in
lightningrl/selection.py and builder.py): each policy's calls become its transitions, grouped
within the policy, credited under its own credit policy, dropped calls counted per policy."""

import pytest

from lightspan import store
from lightspan.core.config import ConfigError
from lightspan.store import policies as pol

from .helpers import EPS, build, call, reward, runner, write

POLICIES = """
[[policies]]
name = "writer"
agents = ["writer"]

[[policies]]
name = "checker"
agent_match = "^check"
credit = "discounted"
advantage = "rloo"
"""


def policies_file(tmp_path, text=POLICIES):
    path = tmp_path / "policies.toml"
    path.write_text(text)
    return str(path)


def rollout(rid, *, task, step, final, writer=True, **extra):
    """writer call 0-10, a step reward at 15, checker call 20-30, an unowned planner call 40-50,
    the final reward at 60."""
    rows = [call(rid, 0, 10, agent="writer", task=task)] if writer else []
    rows += [reward(rid, 15, step, task=task), call(rid, 20, 30, agent="checker", task=task),
             call(rid, 40, 50, agent="planner", task=task), reward(rid, 60, final, task=task),
             runner(rid, 65, task=task)]
    for start, cols in extra.items():        # more writer calls: start time -> columns
        rows.append(call(rid, int(start[1:]), int(start[1:]) + 2, agent="writer", task=task, **cols))
    return rows


def test_each_policy_gets_its_calls_its_groups_its_credit_and_its_drop_counts(tmp_path):
    rows = (rollout("r1", task="t1", step=0.5, final=1.0, s11={"tokens": False})       # a writer call without ids
            + rollout("r2", task="t1", step=0.0, final=0.0, s12={"policy": "checker"})  # served by the checker
            + rollout("r3", task="t2", step=0.0, final=1.0, writer=False)
            + rollout("r4", task="t2", step=0.0, final=0.0, writer=False))
    write(tmp_path, rows)
    table, m = build(tmp_path, policies=policies_file(tmp_path))
    got = {(r["policy"], r["rollout_id"]): r for r in table.to_pylist()}
    assert sorted(got) == [("checker", "r1"), ("checker", "r2"), ("checker", "r3"), ("checker", "r4"),
                           ("writer", "r1"), ("writer", "r2")]
    assert {r["agent_name"] for r in got.values() if r["policy"] == "writer"} == {"writer"}
    assert {r["agent_name"] for r in got.values() if r["policy"] == "checker"} == {"checker"}

    # writer: identical credit (the final reward), GRPO over its one group {r1, r2}
    assert got["writer", "r1"]["credit"] == 1.0 and got["writer", "r2"]["credit"] == 0.0
    assert got["writer", "r1"]["advantage"] == pytest.approx(0.5 / (0.5 + EPS))
    assert got["writer", "r2"]["advantage"] == pytest.approx(-0.5 / (0.5 + EPS))
    assert {r["credit_policy"] for r in got.values() if r["policy"] == "writer"} == {"identical"}
    # checker: discounted (gamma 1) over its own calls: the step reward at 15 comes before its only
    # call ends, so it is that call's too: 0.5 + 1.0 in r1; RLOO within t1 = {r1, r2} and t2 = {r3, r4}
    assert got["checker", "r1"]["credit"] == 1.5 and got["checker", "r2"]["credit"] == 0.0
    assert got["checker", "r1"]["advantage"] == pytest.approx(1.5)
    assert got["checker", "r2"]["advantage"] == pytest.approx(-1.5)
    assert got["checker", "r3"]["advantage"] == pytest.approx(1.0)
    assert got["checker", "r4"]["advantage"] == pytest.approx(-1.0)
    assert {r["advantage_estimator"] for r in got.values() if r["policy"] == "checker"} == {"rloo"}

    w, c = "transitions/policies/writer/", "transitions/policies/checker/"
    assert (m[w + "rollouts"], m[w + "groups"], m[w + "calls"]) == (2, 1, 2)
    assert (m[c + "rollouts"], m[c + "groups"], m[c + "calls"]) == (4, 2, 4)
    assert m[w + "dropped_rollouts/agent_mismatch"] == 2          # r3, r4 have no writer call
    assert m[c + "dropped_rollouts/agent_mismatch"] == 0
    assert m[w + "dropped_calls/no_token_ids"] == 1 and m[c + "dropped_calls/no_token_ids"] == 0
    assert m[w + "dropped_calls/other_policy"] == 1 and m[c + "dropped_calls/other_policy"] == 0
    # the policies' counts add up at the top; calls no policy owns (the planner's) count once
    assert m["transitions/rollouts"] == 6 and m["transitions/calls"] == 6 and m["transitions/groups"] == 3
    assert m["transitions/dropped_calls/agent_mismatch"] == 4     # r1..r4 each have one planner call
    assert m["transitions/reward_mean"] == pytest.approx((2 * 0.5 + 4 * 0.5) / 6)
    assert m["transitions/reward_std"] == pytest.approx(0.5)

    # built once per policy: a second build emits nothing
    store.write_table(tmp_path, "transitions", table)
    again, m2 = build(tmp_path, policies=policies_file(tmp_path))
    assert again.num_rows == 0 and m2["transitions/already_built"] == 2 + 4


def test_a_rollout_built_for_one_policy_is_still_built_for_another(tmp_path):
    write(tmp_path, rollout("r1", task="t1", step=0, final=1.0) + rollout("r2", task="t1", step=0, final=0.0))
    only_writer = policies_file(tmp_path, '[[policies]]\nname = "writer"\nagents = ["writer"]\n')
    first, _ = build(tmp_path, policies=only_writer)
    store.write_table(tmp_path, "transitions", first)
    both, m = build(tmp_path, policies=policies_file(tmp_path))
    assert sorted(set(both.column("policy").to_pylist())) == ["checker"]
    assert m["transitions/policies/writer/already_built"] == 2 and m["transitions/policies/checker/rollouts"] == 2


def test_without_policies_nothing_changes(tmp_path):
    write(tmp_path, rollout("r1", task="t1", step=0, final=1.0) + rollout("r2", task="t1", step=0, final=0.0))
    table, m = build(tmp_path, agent_match="^writer$")
    assert table.column("policy").to_pylist() == [None, None]
    assert not [k for k in m if "/policies/" in k]
    assert m["transitions/dropped_calls/agent_mismatch"] == 4


@pytest.mark.parametrize("text, field", [
    ('[[policies]]\nname = "a"\nagents = ["x"]\nlora_rank = 8\n', "policies.a.lora_rank"),           # unknown field
    ('[[policies]]\nname = "a"\n', "policies.a.agents"),                                              # owns nothing
    ('[[policies]]\nname = "a"\nagents = ["x"]\n[[policies]]\nname = "b"\nagents = ["x"]\n', "policies.b.agents"),
    ('[[policies]]\nname = "a"\nagents = ["x"]\n[[policies]]\nname = "b"\nagent_match = "^x"\n',
     "policies.b.agent_match"),                                                                       # overlap
    ('[[policies]]\nname = "a"\nagent_match = "^x"\n[[policies]]\nname = "b"\nagents = ["xy"]\n', "policies.b.agents"),
    ('[[policies]]\nname = "a"\nagents = ["x"]\n[[policies]]\nname = "a"\nagents = ["y"]\n', "policies.a.name"),
    ('[[policies]]\nname = "my policy"\nagents = ["x"]\n', "policies.my policy.name"),
    ('[[policies]]\nname = "w-v2"\nagents = ["x"]\n', "policies.w-v2.name"),                        # versioned
    ('[[policies]]\nname = "a"\nagent_match = "("\n', "policies.a.agent_match"),
    ('[[policies]]\nname = "a"\nagents = ["x"]\nlora_r = "big"\n', "policies.a.lora_r"),
    ('[tool]\nx = 1\n', "policies.file"),
    ('[[policies]\n', "policies.file"),
])
def test_bad_policies_fail_at_load_naming_the_field(tmp_path, text, field):
    with pytest.raises(ConfigError) as err:
        pol.load(policies_file(tmp_path, text))
    assert err.value.field == field
    assert "fix:" in str(err.value)


@pytest.mark.parametrize("extra, field", [
    ('[[policies]]\nname = "judge"\nagents = ["judge"]\ncredit = "bogus"', "policies.judge.credit"),
    ("gamma = 2.0", "policies.checker.gamma")])
def test_a_bad_per_policy_setting_fails_when_the_builder_starts(tmp_path, extra, field):
    with pytest.raises(ConfigError) as err:
        build(tmp_path, policies=policies_file(tmp_path, POLICIES + extra + "\n"))
    assert err.value.field == field


def test_policies_and_agent_match_together_are_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        build(tmp_path, policies=policies_file(tmp_path), agent_match="writer")
    assert err.value.field == "transitions.agent_match"


def test_an_agent_two_patterns_claim_fails_the_build(tmp_path):
    write(tmp_path, rollout("r1", task="t1", step=0, final=1.0) + rollout("r2", task="t1", step=0, final=0.0))
    text = '[[policies]]\nname = "a"\nagent_match = "^check"\n[[policies]]\nname = "b"\nagent_match = "er$"\n'
    with pytest.raises(ConfigError) as err:
        build(tmp_path, policies=policies_file(tmp_path, text))
    assert "checker" in str(err.value) and err.value.field == "policies.b.agent_match"


def test_owner_and_overrides():
    a = pol.PolicyConfig(name="a", agents=("x",), lora_r=8)
    b = pol.PolicyConfig(name="b", agent_match="^y")
    policies = pol.validate([a, b])
    assert pol.owner(policies, "x") is a and pol.owner(policies, "yz") is b and pol.owner(policies, "z") is None
    assert a.overrides(pol.TRAINER_FIELDS) == {"lora_r": 8} and b.overrides(pol.TRAINER_FIELDS) == {}
