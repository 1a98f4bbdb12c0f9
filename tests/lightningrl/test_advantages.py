"""Group advantage estimators, hand-computed and as properties (lightningrl/advantages.py)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightspan.lightningrl.advantages import ESTIMATORS, dr_grpo, grpo, rloo

EPS = 1e-6


def test_estimators_are_the_closed_set():
    assert ESTIMATORS == {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}


def test_grpo_by_hand():
    # group a: [1, 0, 0.5] → mean 0.5, population std sqrt(1/6); group b: [2, 4] → mean 3, std 1
    r = np.array([1.0, 0.0, 0.5, 2.0, 4.0])
    g = np.array(["a", "a", "a", "b", "b"])
    s = math.sqrt(1 / 6)
    np.testing.assert_allclose(grpo(r, g, epsilon=EPS),
                               [0.5 / (s + EPS), -0.5 / (s + EPS), 0.0, -1 / (1 + EPS), 1 / (1 + EPS)])


def test_dr_grpo_by_hand():
    r = np.array([1.0, 0.0, 0.5, 2.0, 4.0])
    g = np.array([0, 0, 0, 1, 1])
    np.testing.assert_allclose(dr_grpo(r, g, epsilon=EPS), [0.5, -0.5, 0.0, -1.0, 1.0])


def test_rloo_by_hand():
    # [1, 0, 0]: 1 − 0 = 1, 0 − 0.5 = −0.5 twice; [2, 4]: −2, 2
    r = np.array([1.0, 0.0, 0.0, 2.0, 4.0])
    g = np.array([7, 7, 7, 3, 3])
    np.testing.assert_allclose(rloo(r, g, epsilon=EPS), [1.0, -0.5, -0.5, -2.0, 2.0])


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_group_of_one_and_equal_rewards_give_zero(name):
    r = np.array([3.0, 1.0, 1.0, 1.0])
    g = np.array([0, 1, 1, 1])
    np.testing.assert_allclose(ESTIMATORS[name](r, g, epsilon=EPS), 0.0, atol=1e-12)


def test_per_call_identical_credit_equals_rollout_advantage():
    r = np.array([1.0, 0.0, 0.5])
    g = np.array([0, 0, 0])
    rollout_index = np.array([0, 0, 1, 2, 2, 2])
    for fn in ESTIMATORS.values():
        per_rollout = fn(r, g, epsilon=EPS)
        per_call = fn(r, g, epsilon=EPS, credit=r[rollout_index], rollout_index=rollout_index)
        np.testing.assert_allclose(per_call, per_rollout[rollout_index])


def test_per_call_credit_against_the_rollout_baseline():
    # returns G_0 = [0.55, 0.25] (mean 0.4, std 0.15); rollout 0's calls have G = [0.55, 0.5, 1.0]
    r = np.array([0.55, 0.25])
    g = np.array([0, 0])
    idx = np.array([0, 0, 0, 1])
    c = np.array([0.55, 0.5, 1.0, 0.25])
    np.testing.assert_allclose(dr_grpo(r, g, credit=c, rollout_index=idx), [0.15, 0.1, 0.6, -0.15])
    np.testing.assert_allclose(grpo(r, g, epsilon=EPS, credit=c, rollout_index=idx),
                               np.array([0.15, 0.1, 0.6, -0.15]) / (0.15 + EPS))
    # rloo: baseline of rollout 0 is 0.25, of rollout 1 is 0.55
    np.testing.assert_allclose(rloo(r, g, credit=c, rollout_index=idx), [0.3, 0.25, 0.75, -0.3])


def test_per_call_needs_rollout_index():
    with pytest.raises(ValueError):
        grpo(np.array([1.0, 0.0]), np.array([0, 0]), epsilon=EPS, credit=np.array([1.0]))


def test_estimators_are_keyword_only():
    with pytest.raises(TypeError):
        grpo(np.array([1.0]), np.array([0]), EPS)


groups = st.lists(
    st.tuples(st.integers(0, 4), st.floats(-100, 100, allow_nan=False, allow_infinity=False)),
    min_size=1, max_size=30)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@settings(max_examples=60, deadline=None)
@given(rows=groups)
def test_advantages_are_zero_mean_within_each_group(name, rows):
    g = np.array([k for k, _ in rows])
    r = np.array([v for _, v in rows])
    a = ESTIMATORS[name](r, g, epsilon=EPS)
    assert a.shape == r.shape and np.all(np.isfinite(a))
    for k in np.unique(g):
        scale = 1.0 if name != "grpo" else 1.0 / (r[g == k].std() + EPS)
        assert abs(a[g == k].sum()) <= 1e-9 * max(1.0, np.abs(r).max()) * scale * len(r)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@settings(max_examples=30, deadline=None)
@given(rows=groups, seed=st.integers(0, 2**31 - 1))
def test_advantages_do_not_depend_on_row_order(name, rows, seed):
    g = np.array([k for k, _ in rows])
    r = np.array([v for _, v in rows])
    perm = np.random.default_rng(seed).permutation(len(r))
    a = ESTIMATORS[name](r, g, epsilon=EPS)
    np.testing.assert_allclose(ESTIMATORS[name](r[perm], g[perm], epsilon=EPS), a[perm], rtol=1e-9, atol=1e-9)
