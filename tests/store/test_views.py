"""The store's derived views against hand-computed values: rollout status, reward provenance,
pass@k / pass^k and judge-human agreement."""

from __future__ import annotations

import pytest

from tests.collector.helpers import query


def test_a_rollout_says_why_it_trains_or_not(known_store):
    data, _ = known_store
    rows = dict((k, (s, o, e)) for k, s, o, e in query(data, "SELECT rollout_key, status, outcome, exit_code FROM rollouts"))
    assert rows["x1"] == ("rewarded", "ok", 0) and rows["x4"] == ("failed", "failed", 3)
    assert rows["x5"] == ("unrewarded", None, None)           # no runner span, no reward: not a 0
    assert query(data, "SELECT count(*) FROM rollouts WHERE status = 'failed'") == [(1,)]


def test_posted_rewards_keep_who_gave_them_and_why(known_store):
    data, _ = known_store
    rows = query(data, "SELECT reward_name, reward, source, comment, correction, judge_model, rubric_sha256 "
                       "FROM rewards WHERE rollout_key = 'y1' ORDER BY time_unix_nano")
    assert rows == [("reward", 1.0, "agent", None, None, None, None),
                    ("judge", 1.0, "judge", "fine", None, "m", "a" * 64),
                    ("human", 0.25, "human", "off by one", "The answer is 5.", None, None)]
    assert query(data, "SELECT judge, human FROM reward_agreement") == [(1.0, 0.25)]


# task-x, policy 1: x1 1.0, x2 0.0, x3 1.0, x4 failed (counts as a failure), x5 unrewarded (not
# counted): n = 4, c = 2. Policy 2: y1's final reward is the person's 0.25, y2 1.0: n = 2, c = 1.
EXPECTED = {  # (version, k) -> (pass@k, pass^k)
    (1, 1): (1 - 2 / 4, 2 / 4), (1, 2): (1 - 1 / 6, 1 / 6), (1, 3): (1.0, 0.0), (1, 4): (1.0, 0.0),
    (2, 1): (0.5, 0.5), (2, 2): (1.0, 0.0),
}


def test_pass_at_k_and_pass_hat_k_match_the_hand_computed_values(known_store):
    data, _ = known_store
    rows = query(data, "SELECT model_version, k, n, c, pass_at_k, pass_hat_k FROM pass_at_k WHERE task_id = 'task-x'")
    got = {(v, k): (p, h) for v, k, _, _, p, h in rows}
    assert set(got) == set(EXPECTED)
    for key, (p, h) in EXPECTED.items():
        assert got[key] == (pytest.approx(p, abs=1e-12), pytest.approx(h, abs=1e-12)), key
    assert {(v, n, c) for v, _, n, c, _, _ in rows} == {(1, 4, 2), (2, 2, 1)}
    # another success threshold: the person's 0.25 passes at 0.2
    assert query(data, "SELECT pass_hat_k FROM pass_k(threshold := 0.2) WHERE model_version = 2 AND k = 2") == [(1.0,)]


def test_reward_drift_is_each_sources_mean_reward_per_policy_version(known_store):
    data, _ = known_store
    rows = query(data, "SELECT model_version, source, rollouts, reward_mean FROM reward_drift ORDER BY 1, 2")
    assert rows == [(1, "agent", 3, pytest.approx(2 / 3)), (2, "agent", 2, 1.0), (2, "human", 1, 0.25),
                    (2, "judge", 1, 1.0)]
