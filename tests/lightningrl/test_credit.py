"""Credit policies and reward-to-call matching, hand-computed (lightningrl/credit.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightspan.lightningrl import credit
from lightspan.lightningrl.credit import POLICIES, discounted, identical, rewards_per_call


def test_policies_are_the_closed_set():
    assert POLICIES == {"identical": identical, "discounted": discounted}


def test_identical_gives_the_final_reward_to_every_call():
    out = identical(np.array([0.2, 0.0, 1.0]), 1.0, 0.5)
    np.testing.assert_array_equal(out, [1.0, 1.0, 1.0])
    assert out.dtype == np.float64


def test_identical_ignores_intermediate_rewards_and_gamma():
    np.testing.assert_array_equal(identical(np.array([5.0, 0.0]), -1.0, 0.1), [-1.0, -1.0])


def test_discounted_is_return_to_go():
    # r = [0.3, 0, 1], γ = 0.5: G2 = 1, G1 = 0 + 0.5·1 = 0.5, G0 = 0.3 + 0.5·0.5 = 0.55
    np.testing.assert_allclose(discounted(np.array([0.3, 0.0, 1.0]), 1.0, 0.5), [0.55, 0.5, 1.0])


def plain_return_to_go(r, gamma):
    """G_t = r_t + γ G_{t+1}, G_T = 0, written as the textbook loop."""
    G, future = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        future = r[t] + gamma * future
        G[t] = future
    return G


@pytest.mark.parametrize("seed", range(10))
def test_discounted_equals_the_plain_loop_on_random_rollouts(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 12, rng.integers(1, 20))
    rewards = [rng.choice([0.0, 0.0, 1.0, -0.5, 0.25], n) for n in lengths]
    gamma = float(rng.choice([1.0, 0.99, 0.9, 0.5]))
    want = np.concatenate([plain_return_to_go(r.tolist(), gamma) for r in rewards])
    got = discounted(np.concatenate(rewards), None, gamma, rollout_index=np.repeat(np.arange(len(lengths)), lengths))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    for r in rewards:                                    # and one rollout alone
        np.testing.assert_allclose(discounted(r, None, gamma), plain_return_to_go(r.tolist(), gamma), atol=1e-12)


def test_discounted_with_gamma_one_sums_the_rewards_still_to_come():
    np.testing.assert_allclose(discounted(np.array([1.0, 2.0, 3.0]), 3.0, 1.0), [6.0, 5.0, 3.0])


def test_discounted_ignores_final_reward_argument():
    np.testing.assert_allclose(discounted(np.array([0.0, 1.0]), 42.0, 1.0), [1.0, 1.0])


def test_empty_rollout():
    assert len(identical(np.zeros(0), 1.0, 1.0)) == 0
    assert len(discounted(np.zeros(0), 1.0, 1.0)) == 0
    assert len(rewards_per_call(np.zeros(0, np.int64), np.array([1]), np.array([1.0]))) == 0


def test_reward_goes_to_the_latest_call_ended_at_or_before_it():
    ends = np.array([10, 20, 30])
    times = np.array([20, 25, 35, 30])    # at 20 → call 1 (ended exactly then); 25 → 1; 35, 30 → 2
    values = np.array([1.0, 2.0, 4.0, 8.0])
    np.testing.assert_allclose(rewards_per_call(ends, times, values), [0.0, 3.0, 12.0])


def test_reward_before_any_call_goes_to_the_first_call():
    np.testing.assert_allclose(rewards_per_call(np.array([10, 20]), np.array([5, 15]), np.array([0.5, 1.0])),
                               [1.5, 0.0])


def test_overlapping_calls_match_by_end_time():
    # call 0 runs 0–100, call 1 runs 10–50 (calls are in start order): a reward at 60
    # follows call 1's end only; one at 120 follows call 0's (the latest end).
    ends = np.array([100, 50])
    np.testing.assert_allclose(rewards_per_call(ends, np.array([60, 120]), np.array([1.0, 10.0])), [10.0, 1.0])


def test_reward_before_every_end_goes_to_call_zero_even_if_another_ended_first():
    # call 0 runs 0–100, call 1 runs 10–50: a reward at 40 precedes both ends
    np.testing.assert_allclose(rewards_per_call(np.array([100, 50]), np.array([40]), np.array([1.0])), [1.0, 0.0])


def test_equal_end_times_go_to_the_later_call():
    np.testing.assert_allclose(rewards_per_call(np.array([10, 10]), np.array([10]), np.array([1.0])), [0.0, 1.0])


def test_module_docstring_cites_and_numbers_deviations():
    doc = credit.__doc__
    assert "2508.03680" in doc and "Sutton" in doc
    assert "\n1. " in doc


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policies_are_pure(policy):
    r = np.array([0.1, 0.2])
    before = r.copy()
    POLICIES[policy](r, 0.2, 0.9)
    np.testing.assert_array_equal(r, before)


# --- many rollouts at once equal one rollout at a time ----------------------------------------

rollouts_st = st.lists(st.tuples(
    st.lists(st.integers(0, 60), min_size=1, max_size=5),                                  # call end times
    st.lists(st.tuples(st.integers(0, 80), st.sampled_from([0.0, 0.5, 1.0, -2.0])), max_size=4)),  # rewards
    min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(rollouts=rollouts_st, gamma=st.sampled_from([1.0, 0.9, 0.5]))
def test_batched_credit_equals_one_rollout_at_a_time(rollouts, gamma):
    ends, call_rollout, times, values, reward_rollout, final = [], [], [], [], [], []
    expect_r, expect = [], {name: [] for name in POLICIES}
    for i, (call_end, rewards) in enumerate(rollouts):
        t = np.array([x for x, _ in rewards], dtype=np.int64)
        v = np.array([y for _, y in rewards], dtype=np.float64)
        r = rewards_per_call(np.array(call_end), t, v)
        f = v[np.argmax(t)] if len(v) else 0.0
        expect_r.append(r)
        for name, policy in POLICIES.items():
            expect[name].append(policy(r, f, gamma))
        ends += call_end
        call_rollout += [i] * len(call_end)
        order = np.argsort(t, kind="stable")       # rewards in any order across rollouts
        times += t[order].tolist()
        values += v[order].tolist()
        reward_rollout += [i] * len(t)
        final.append(f)
    perm = np.random.default_rng(len(ends)).permutation(len(times))
    r = rewards_per_call(np.array(ends), np.array(times, dtype=np.int64)[perm], np.array(values)[perm],
                         call_rollout=np.array(call_rollout), reward_rollout=np.array(reward_rollout)[perm])
    np.testing.assert_allclose(r, np.concatenate(expect_r), atol=1e-12)
    for name, policy in POLICIES.items():
        got = policy(r, np.array(final), gamma, rollout_index=np.array(call_rollout))
        np.testing.assert_allclose(got, np.concatenate(expect[name]), atol=1e-12)
