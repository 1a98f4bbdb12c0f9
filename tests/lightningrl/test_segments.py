"""Compaction as a branch point: an agent that rewrites its history every few turns gives several
segments of one rollout, nothing mis-merged, credit equal across them (lightningrl/sequences.py,
the per_rollout path of assignment.py)."""

import pytest

from tests.lightningrl.helpers import EPS, build, call, reward, runner, write

SYS, EOS, NL, SUMMARY = [1, 2, 3], 99, 98, 7


def compacting_agent(rid, r, *, turns=7, every=3, task="t1"):
    """A ReAct-like agent: call k's prompt is its history, its completion ``[100 + 10k, 101 + 10k, EOS]``,
    then a tool result ``[50 + k, NL]``. After every ``every``-th call it compacts: the history
    becomes the system prompt and a summary (shorter than before). Returns (spans, the calls'
    (prompt, completion, tool) in order)."""
    rows, turns_of, history = [], [], list(SYS) + [4]
    for k in range(turns):
        completion, tool = [100 + 10 * k, 101 + 10 * k, EOS], [50 + k, NL]
        rows.append(call(rid, 20 * k, 20 * k + 10, prompt=history, completion=completion,
                         logprobs=[-0.1 * (k + 1)] * 3, task=task))
        turns_of.append((list(history), completion, tool))
        history = history + completion + tool
        if k % every == every - 1:
            history = list(SYS) + [SUMMARY, 200 + k]
    return rows + [reward(rid, 20 * turns, r, task=task), runner(rid, 20 * turns + 5, task=task)], turns_of


def test_an_agent_that_compacts_every_three_turns_gives_three_segments(tmp_path):
    a, turns = compacting_agent("a", 1.0)
    b, _ = compacting_agent("b", 0.0)
    write(tmp_path, a + b)
    table, m = build(tmp_path, output="per_rollout")
    rows = sorted(table.to_pylist(), key=lambda r: (r["rollout_id"], r["segment"]))
    assert [(r["rollout_id"], r["segment"], r["segment_cause"], r["call_index"], r["rollout_rows"]) for r in rows] == [
        (rid, s, None if s == 0 else "compaction", 3 * s, 3) for rid in "ab" for s in range(3)]
    # nothing mis-merged: segment s is calls 3s .. 3s+2 (the last one call 6 alone), its prompt the
    # first call's prompt, then each call's completion (mask 1) and the tool turn after it (mask 0)
    for r in rows[:3]:
        calls = turns[3 * r["segment"]:3 * r["segment"] + 3]
        assert r["prompt_token_ids"] == calls[0][0]
        tokens, mask, logprobs = [], [], []
        for i, (_, completion, tool) in enumerate(calls):
            k = 3 * r["segment"] + i
            if i:
                tokens += turns[k - 1][2]
                mask += [0] * len(turns[k - 1][2])
                logprobs += [0.0] * len(turns[k - 1][2])
            tokens += completion
            mask += [1] * len(completion)
            logprobs += [-0.1 * (k + 1)] * len(completion)
        assert r["completion_token_ids"] == tokens and r["completion_mask"] == mask
        assert r["completion_logprobs"] == pytest.approx(logprobs)
    # credit flows across segments: under identical every row of a rollout has its advantage
    # (GRPO over [1, 0]: mean 0.5, std 0.5)
    assert [r["advantage"] for r in rows] == pytest.approx([0.5 / (0.5 + EPS)] * 3 + [-0.5 / (0.5 + EPS)] * 3)
    assert all(r["credit"] == r["reward"] for r in rows)
    assert m["transitions/prefix_mismatch/compaction"] == 4
    assert sum(v for k, v in m.items() if "prefix_mismatch" in k) == 4
    assert (m["transitions/calls"], m["transitions/sequences"]) == (14, 6)
    assert m["transitions/rows_per_rollout_mean"] == 3 and m["transitions/rows_per_rollout_max"] == 3
    assert m["transitions/merge_rate"] == 0.0


def test_discounted_credit_flows_across_segments(tmp_path):
    # a reward 0.5 after call 1 and 1.0 at the end, γ = 1: G_t = 1.5 for t <= 1, 1.0 after. Segment 0
    # (calls 0-2) gets G_0 = 1.5, segment 1 (calls 3-5) G_3 = 1.0, segment 2 (call 6) G_6 = 1.0
    a, _ = compacting_agent("a", 1.0)
    a.append(reward("a", 35, 0.5))
    b, _ = compacting_agent("b", 0.0)
    write(tmp_path, a + b)
    table, _ = build(tmp_path, output="per_rollout", credit="discounted", advantage="dr_grpo")
    got = {(r["rollout_id"], r["segment"]): (r["credit"], r["advantage"]) for r in table.to_pylist()}
    mean = (1.5 + 0.0) / 2             # the baseline: the rollouts' G_0
    assert got == {("a", 0): pytest.approx((1.5, 1.5 - mean)), ("a", 1): pytest.approx((1.0, 1.0 - mean)),
                   ("a", 2): pytest.approx((1.0, 1.0 - mean)),
                   **{("b", s): pytest.approx((0.0, -mean)) for s in range(3)}}


def test_one_merged_rollout_is_one_row_and_per_call_has_no_segments(tmp_path):
    a, _ = compacting_agent("a", 1.0, every=100)
    b, _ = compacting_agent("b", 0.0, every=100)
    write(tmp_path, a + b)
    table, m = build(tmp_path, output="per_rollout")
    assert [(r["segment"], r["segment_cause"], r["rollout_rows"], r["num_calls"]) for r in table.to_pylist()] == [
        (0, None, 1, 7)] * 2
    assert m["transitions/merge_rate"] == 1.0 and m["transitions/rows_per_rollout_mean"] == 1.0
    table, m = build(tmp_path)                # per_call: one row per call, no segments
    assert set(table.column("segment").to_pylist()) == {None}
    assert set(table.column("rollout_rows").to_pylist()) == {7}
    assert m["transitions/rows_per_rollout_mean"] == 7 and m["transitions/merge_rate"] == 0.0
