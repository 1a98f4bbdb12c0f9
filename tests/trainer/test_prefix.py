"""A prompt prefix shared by a micro-batch's rows, run once (trainer/prefix.py): the same logprobs,
gradients and optimizer steps as running every row's whole prompt; rows packed so that a group
shares a pass; no vLLM here."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from lightspan import store
from lightspan.trainer.batches import collate, micro_batches
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.loop import Trainer
from lightspan.trainer.loss import token_logprobs
from lightspan.trainer.prefix import common_prefix, pack

torch.set_num_threads(1)

SHARED = list(range(40, 80))                     # 40 tokens every prompt starts with


def rows(rng: np.random.Generator, rests: list[int], completions: list[int], group: str = "g") -> list[dict]:
    out = []
    for i, (rest, n) in enumerate(zip(rests, completions)):
        completion = rng.integers(3, 200, n).tolist()
        out.append({"transition_id": f"{group}-{i}", "rollout_id": f"r-{group}-{i}", "task_id": group,
                    "split": "train", "prompt_token_ids": SHARED + rng.integers(3, 200, rest).tolist(),
                    "completion_token_ids": completion, "completion_logprobs": (-rng.random(n) * 4).tolist(),
                    "temperature": [0.7, 1.0][i % 2], "advantage": [1.0, -1.0, 0.5][i % 3], "model_version": 0,
                    "reward": 1.0, "created_unix_nano": 1 + i})
    return out


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()


@pytest.mark.parametrize("rests", [[0, 0, 0, 0], [0, 5, 0, 9], [3, 5, 2, 9]], ids=["same", "some", "all"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_shared_pass_gives_the_plain_logprobs_and_gradients(model, rests, lora):
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    batch = rows(np.random.default_rng(len(rests) + sum(rests)), rests, [6, 3, 8, 1])
    mb = collate(batch, 0, shared_prefix=16)
    assert mb.prefix_len == 40 if max(rests) == 0 else mb.prefix_len >= 40
    results = []
    for prefix_len in (0, mb.prefix_len):
        model.zero_grad()
        logprobs, entropy = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_mask,
                                           mb.temperatures, prefix_len)
        (logprobs * torch.linspace(0.5, 2, logprobs.numel()).view_as(logprobs)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logprobs.detach(), entropy, grads))
    (plain, plain_entropy, plain_grads), (shared, shared_entropy, shared_grads) = results
    assert torch.allclose(plain, shared, atol=1e-5) and torch.allclose(plain_entropy, shared_entropy, atol=1e-5)
    assert (plain != 0).sum() == mb.completion_mask.sum()          # every completion token has a logprob
    assert plain_grads.keys() == shared_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        assert torch.allclose(grad, shared_grads[name], atol=1e-5, rtol=1e-4), name
    if lora:
        model.unload()


def test_the_prefix_is_what_every_prompt_shares_if_long_enough():
    a, b, c = np.array([1, 2, 3, 4, 5]), np.array([1, 2, 3, 9]), np.array([1, 2, 3, 4])
    assert common_prefix([a, b, c], 2) == 3 and common_prefix([a, c], 2) == 4
    assert common_prefix([a, b], 4) == 0                          # shorter than asked: the plain pass
    assert common_prefix([a], 1) == 0 and common_prefix([a, a], 0) == 0
    assert common_prefix([a, a], 5) == 5                          # a whole prompt can be the prefix


def test_rows_of_a_group_share_a_pass_and_the_budget_counts_the_prefix_once():
    rng = np.random.default_rng(0)
    g1 = [np.array([1] * 50 + [2] + rng.integers(3, 9, 4).tolist()) for _ in range(4)]
    g2 = [np.array([1] * 50 + [3] + rng.integers(3, 9, 4).tolist()) for _ in range(4)]
    prompts = [g1[0], g2[0], g1[1], g2[1], g1[2], g2[2], g1[3], g2[3]]      # the groups interleaved
    chunks = pack(prompts, [10] * 8, max_rows=4, max_tokens=0, min_tokens=16)
    assert sorted(map(sorted, chunks)) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # the 8 rows in one pass: 50 shared + 8 x (5 + 10) = 170 tokens, where the plain count is 8 x 65 = 520
    assert pack(prompts, [10] * 8, max_rows=8, max_tokens=170, min_tokens=16) == [list(range(8))]
    assert len(pack(prompts, [10] * 8, max_rows=8, max_tokens=169, min_tokens=16)) == 2
    alone = pack(prompts, [10] * 8, max_rows=8, max_tokens=1, min_tokens=16)      # each row over the budget
    assert all(len(c) == 1 for c in alone) and {c[0] for c in alone[:4]} == {0, 2, 4, 6}


def test_micro_batches_of_two_groups_each_share_their_groups_prompt():
    rng = np.random.default_rng(1)
    batch = rows(rng, [4] * 4, [5] * 4, "a") + rows(rng, [4] * 4, [5] * 4, "b")
    for row in batch[4:]:                          # group b's prompt departs from a's after 20 tokens
        row["prompt_token_ids"] = row["prompt_token_ids"][:20] + [7] + row["prompt_token_ids"][20:]
    for row in batch[:4]:                          # each group's rows share their whole prompt
        row["prompt_token_ids"] = batch[0]["prompt_token_ids"]
    for row in batch[4:]:
        row["prompt_token_ids"] = batch[4]["prompt_token_ids"]
    interleaved = [batch[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]
    micro, live = micro_batches(interleaved, rank=0, num_ranks=1, size=4, pad_id=0, device="cpu", shared_prefix=16)
    assert live == 2 and sorted(mb.prefix_len for mb in micro) == [44, 45]
    micro, _ = micro_batches(interleaved, rank=0, num_ranks=1, size=8, pad_id=0, device="cpu", shared_prefix=16)
    assert [mb.prefix_len for mb in micro] == [20]
    micro, _ = micro_batches(interleaved, rank=0, num_ranks=1, size=4, pad_id=0, device="cpu", shared_prefix=0)
    assert all(mb.prefix_len == 0 for mb in micro)


def test_a_step_with_shared_prefixes_updates_the_weights_as_the_plain_step(tmp_path, tiny_model):
    rng = np.random.default_rng(2)
    batch = rows(rng, [0] * 4, [6, 2, 5, 4], "a") + rows(rng, [3, 0, 6, 2], [3, 7, 1, 5], "b")
    runs = []
    for shared in (0, 16):
        cfg = TrainerConfig(data_dir=str(tmp_path / f"data-{shared}"), model=str(tiny_model), sync="none",
                            torch_threads=1, lora_r=8, lora_alpha=16.0, learning_rate=1e-2, metrics_port=0,
                            batch_size=8, micro_batch_size=4, shared_prefix_tokens=shared)
        trainer = Trainer(cfg)
        trainer.load_or_init()
        steps = []
        for k in range(2):                          # the first step moves only LoRA's B (A's gradient is 0)
            store.write_table(cfg.data_dir, "transitions", pa.Table.from_pylist(
                [{**r, "transition_id": f"{r['transition_id']}-{k}", "created_unix_nano": 100 * k + i}
                 for i, r in enumerate(batch)], schema=store.TRANSITION_SCHEMA))
            metrics = trainer.train_once()
            assert metrics["num_transitions"] == 8 and metrics["micro_batches"] == 2
            steps.append((metrics["loss"], metrics["grad_norm"]))
        runs.append((steps, {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}))
    (plain_steps, plain), (shared_steps, shared) = runs
    assert np.allclose(plain_steps, shared_steps, rtol=1e-5, atol=0)      # each step's loss and gradient norm
    assert plain.keys() == shared.keys() and plain
    for name in plain:           # AdamW divides near-zero gradients by their RMS: rounding shows at 1e-5
        assert torch.allclose(plain[name], shared[name], atol=1e-4), name
