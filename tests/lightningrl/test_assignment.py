"""lightningrl/assignment.py's ``assign`` against the algorithm written as a plain loop, one rollout
and one call at a time, as the papers read (lightningrl/credit.py, advantages.py), on random
rollouts: calls in order, rewards at random times, several tasks."""

from __future__ import annotations

import random
import statistics

import pytest

from .helpers import EPS, build, call, reward, runner, write


def random_rollouts(seed: int) -> dict[str, tuple[str, int, list[tuple[int, float]]]]:
    """rollout id -> (task, number of calls, [(reward time, value)]): calls k at 20k .. 20k + 10."""
    rng = random.Random(seed)
    out = {}
    for task in ("t0", "t1", "t2")[:rng.randint(1, 3)]:
        for j in range(rng.randint(2, 4)):                       # a group needs two rollouts
            calls = rng.randint(1, 4)
            times = rng.sample(range(0, 20 * calls + 1), rng.randint(1, 3))   # distinct: no ties
            out[f"{task}-r{j}"] = (task, calls, [(t, rng.choice([-1.0, 0.0, 0.25, 0.5, 1.0])) for t in times])
    return out


def spans(rollouts) -> list[dict]:
    rows = []
    for rid, (task, calls, rewards) in rollouts.items():
        rows += [call(rid, 20 * k, 20 * k + 10, task=task) for k in range(calls)]
        rows += [reward(rid, t, v, task=task) for t, v in rewards]
        rows.append(runner(rid, 20 * calls + 15, task=task))
    return rows


def reference(rollouts, credit: str, advantage: str, gamma: float) -> dict[tuple[str, int], tuple]:
    """(rollout, call) -> (reward, credit, advantage), one rollout and one call at a time."""
    credit_of, ret = {}, {}
    final = {}
    for rid, (task, calls, rewards) in rollouts.items():
        ends = [20 * k + 10 for k in range(calls)]
        r = [0.0] * calls                       # r_t: each reward to the latest call ended at or before it
        for t, v in rewards:
            ended = [k for k in range(calls) if ends[k] <= t]
            r[ended[-1] if ended else 0] += v
        final[rid] = max(rewards)[1]            # the last reward (by time) is the final one
        if credit == "identical":               # LightningRL: every call gets R
            c = [final[rid]] * calls
        else:                                   # return-to-go: G_t = r_t + γ G_{t+1}, G_T = 0
            c, future = [0.0] * calls, 0.0
            for t in reversed(range(calls)):
                future = r[t] + gamma * future
                c[t] = future
        credit_of[rid], ret[rid] = c, c[0]      # the rollout's return: from its first call
    out = {}
    for rid, (task, calls, _) in rollouts.items():
        group = [ret[o] for o, (g, _, _) in rollouts.items() if g == task]
        mean, n = sum(group) / len(group), len(group)
        if advantage == "grpo":
            baseline, scale = mean, statistics.pstdev(group) + EPS
        elif advantage == "dr_grpo":
            baseline, scale = mean, 1.0
        else:                                   # rloo: the mean of the other rollouts' returns
            baseline, scale = (sum(group) - ret[rid]) / (n - 1), 1.0
        for t in range(calls):
            out[(rid, t)] = (final[rid], credit_of[rid][t], (credit_of[rid][t] - baseline) / scale)
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("credit, advantage, gamma", [
    ("identical", "grpo", 1.0), ("identical", "rloo", 1.0), ("discounted", "dr_grpo", 0.9),
    ("discounted", "grpo", 0.5), ("discounted", "rloo", 1.0)])
def test_assign_equals_the_plain_loop(tmp_path, seed, credit, advantage, gamma):
    rollouts = random_rollouts(seed)
    write(tmp_path, spans(rollouts))
    table, stats = build(tmp_path, credit=credit, advantage=advantage, gamma=gamma)
    got = {(r["rollout_id"], r["call_index"]): (r["reward"], r["credit"], r["advantage"]) for r in table.to_pylist()}
    want = reference(rollouts, credit, advantage, gamma)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key
    assert stats["transitions/calls"] == len(want) and stats["transitions/rollouts"] == len(rollouts)
