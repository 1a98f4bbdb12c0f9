"""trainer/batches.py: Arrow rows into padded tensors, checked against a plain loop per row."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
import torch

from lightspan import store
from lightspan.trainer.batches import collate, micro_batches, shard_groups, token_totals


def random_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        p, c = rng.randint(1, 9), rng.randint(1, 7)
        rows.append({
            "transition_id": f"t{i}", "rollout_id": f"r{i % 5}", "task_id": rng.choice(["a", "b", "", None]),
            "prompt_token_ids": [rng.randrange(1, 300) for _ in range(p)],
            "completion_token_ids": [rng.randrange(1, 300) for _ in range(c)],
            "completion_logprobs": [-rng.random() * 5 for _ in range(c)],
            "completion_mask": [rng.randint(0, 1) for _ in range(c)] if rng.random() < 0.5 else None,
            "advantage": rng.choice([-1.5, -1.0, 0.5, 2.0]), "temperature": rng.choice([None, 0.0, 0.7, 1.0]),
            "model_version": 0, "created_unix_nano": i})
    return rows


def reference(rows: list[dict], pad_id: int) -> dict[str, list]:
    """The micro-batch written out row by row: prompts left-padded, completions right-padded."""
    p = max(len(r["prompt_token_ids"]) for r in rows)
    c = max(len(r["completion_token_ids"]) for r in rows)
    out = {k: [] for k in ("input_ids", "attention_mask", "completion_mask", "behaviour", "advantages",
                           "temperatures")}
    for r in rows:
        prompt, completion = r["prompt_token_ids"], r["completion_token_ids"]
        left, right = p - len(prompt), c - len(completion)
        out["input_ids"].append([pad_id] * left + prompt + completion + [pad_id] * right)
        out["attention_mask"].append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
        mask = r["completion_mask"] if r["completion_mask"] is not None else [1] * len(completion)
        out["completion_mask"].append(mask + [0] * right)
        out["behaviour"].append(r["completion_logprobs"] + [0.0] * right)
        out["advantages"].append(r["advantage"])
        out["temperatures"].append(r["temperature"] or 1.0)
    return out


def as_lists(mb) -> dict[str, list]:
    return {"input_ids": mb.input_ids.tolist(), "attention_mask": mb.attention_mask.tolist(),
            "completion_mask": mb.completion_mask.tolist(), "behaviour": mb.behaviour_logprobs.tolist(),
            "advantages": mb.advantages.tolist(), "temperatures": mb.temperatures.tolist()}


def close(got: dict, want: dict) -> None:
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert got[key] == want[key], key
    for key in ("behaviour", "advantages", "temperatures"):     # float32 tensors
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key], dtype=torch.float32))


@pytest.mark.parametrize("seed", range(20))
def test_collate_equals_a_plain_loop_on_random_rows(seed):
    rows = random_rows(random.Random(seed).randint(1, 12), seed)
    want = reference(rows, pad_id=7)
    close(as_lists(collate(rows, pad_id=7)), want)
    # as the store holds them: typed Arrow columns (int32 ids, float32 logprobs), read from a slice
    table = pa.Table.from_pylist([{"transition_id": "x", "created_unix_nano": -1, "model_version": 0}] + rows,
                                 schema=store.TRANSITION_SCHEMA).slice(1)
    close(as_lists(collate(table, pad_id=7)), want)


def test_token_totals():
    rows = random_rows(9, 3)
    lengths, trained = token_totals(pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))
    assert lengths == [len(r["completion_token_ids"]) for r in rows]
    assert trained == sum(len(r["completion_token_ids"]) if r["completion_mask"] is None else sum(r["completion_mask"])
                          for r in rows)


def test_shard_groups_of_a_table_are_those_of_its_rows():
    rows = random_rows(12, 5)
    table = pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA)
    for shards in (2, 3):
        assert shard_groups(table, shards) == shard_groups(rows, shards)
        assert sorted(i for s in shard_groups(table, shards) for i in s) == list(range(12))
    # a group is a task, else (no task, or an empty one) a rollout
    keys = [{rows[i]["task_id"] or rows[i]["rollout_id"] for i in shard} for shard in shard_groups(table, 3)]
    assert sum(map(len, keys)) == len(set().union(*keys))


def test_micro_batches_cut_each_ranks_share_in_order_and_pad_the_passes():
    rows = random_rows(10, 8)
    table = pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA)
    shards = shard_groups(table, 2)
    longest = max(-(-len(s) // 3) for s in shards)
    for rank in (0, 1):
        micro, live = micro_batches(table, rank=rank, num_ranks=2, size=3, pad_id=0, device="cpu")
        mine = [rows[i] for i in shards[rank]]
        assert live == -(-len(mine) // 3) and len(micro) == longest
        for k in range(live):
            close(as_lists(micro[k]), reference(mine[3 * k:3 * k + 3], 0))
        for mb in micro[live:]:                      # padding passes repeat the batch's first row
            close(as_lists(mb), reference(rows[:1], 0))


def test_a_rank_without_a_group_runs_padding_passes_only():
    rows = [{**r, "task_id": "one"} for r in random_rows(4, 9)]
    for rank in (1, 2):
        micro, live = micro_batches(rows, rank=rank, num_ranks=3, size=3, pad_id=0, device="cpu")
        assert live == 0 and len(micro) == 2
        close(as_lists(micro[0]), reference(rows[:1], 0))
