"""Long and split rollouts in the trainer: per-rollout loss normalisation, masked rows, micro-batches
cut by a token budget (trainer/loss.py deviation 9, trainer/batches.py, trainer/step.py, trainer/memory.py).

Gradients are read off one step of the real ``optimise`` with plain SGD at learning rate 1 and no
clipping: the weights move by minus the gradient."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
import torch

from lightspan.core.config import ConfigError
from lightspan.trainer.batches import Batch, Cursor, next_batch, pack, step_totals
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.memory import bytes_per_token, reserve_bytes, step_budget, token_budget
from lightspan.trainer.step import optimise

torch.set_num_threads(1)

PROMPT = [60, 61, 62, 63, 64]
TURNS = [[65, 66, 67], [70, 71], [72, 73, 74, 75]]      # one rollout's three calls' completions


def row(tid, rollout, prompt, completion, advantage, **extra):
    return {"transition_id": tid, "rollout_id": rollout, "task_id": "t0", "prompt_token_ids": prompt,
            "completion_token_ids": completion, "completion_logprobs": [-5.5] * len(completion),
            "completion_mask": None, "advantage": advantage, "temperature": 1.0, "reward": 1.0,
            "model_version": 0, "created_unix_nano": 1, **extra}


def merged():
    """Rollout A as one row (its three turns one completion), and rollout B of one call."""
    return [row("a", "A", PROMPT, sum(TURNS, []), 1.0), row("b", "B", PROMPT[:3], [80, 81, 82, 83, 84], -1.0)]


def split():
    """The same tokens with rollout A split into three rows, each prompt the previous row's whole sequence
    (a rollout the builder cut where it could not merge, e.g. at a re-tokenisation)."""
    rows, prompt = [], list(PROMPT)
    for k, turn in enumerate(TURNS):
        rows.append(row(f"a{k}", "A", list(prompt), turn, 1.0))
        prompt += turn
    return rows + [merged()[1]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from lightspan.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "v0")


def gradient(model_dir, rows, **config) -> torch.Tensor:
    """The step's gradient (all parameters, flat) on ``rows``."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    cfg = TrainerConfig(model=str(model_dir), sync="none", max_grad_norm=0.0, is_correction="none",
                        **{"micro_batch_tokens": 10**6, **config})
    optimise(Accelerator(cpu=True), model, torch.optim.SGD(model.parameters(), lr=1.0),
             Batch(table=pa.Table.from_pylist(rows), cursor=Cursor()), cfg)
    return before - torch.cat([p.detach().flatten() for p in model.parameters()])


def close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_a_rollout_split_into_k_rows_weighs_as_one_row_under_rollout_normalisation(model_dir, loss_type):
    one = gradient(model_dir, merged(), loss_type=loss_type, loss_normalisation="rollout")
    three = gradient(model_dir, split(), loss_type=loss_type, loss_normalisation="rollout")
    assert one.abs().max() > 0
    assert close(one, three)
    # per transition, the split rollout is three sequences of four: its gradient and B's both change
    per_row = gradient(model_dir, split(), loss_type=loss_type, loss_normalisation="transition")
    assert not close(one, per_row)
    assert close(one, gradient(model_dir, merged(), loss_type=loss_type, loss_normalisation="transition"))


def test_token_level_losses_are_the_same_either_way(model_dir):
    # dapo: every token of the batch weighs 1 / its tokens, however the rows are cut (deviation 9)
    one = gradient(model_dir, merged(), loss_type="dapo", loss_normalisation="transition")
    assert close(one, gradient(model_dir, split(), loss_type="dapo", loss_normalisation="transition"))
    assert close(one, gradient(model_dir, split(), loss_type="dapo", loss_normalisation="rollout"))


@pytest.mark.parametrize("normalisation", ["transition", "rollout"])
def test_a_small_token_budget_gives_the_gradient_of_one_micro_batch(model_dir, normalisation):
    rows = split() + [row("c", "C", PROMPT, [90, 91, 92, 93, 94, 95, 96], 0.5)]
    whole = gradient(model_dir, rows, loss_type="grpo", loss_normalisation=normalisation)
    # 12 padded tokens: the rows of rollout A land in different micro-batches
    cut = gradient(model_dir, rows, loss_type="grpo", loss_normalisation=normalisation, micro_batch_tokens=12)
    assert close(whole, cut)


@pytest.mark.parametrize("column", [{"loss_weight": 0.0}, {"outcome": "masked"}])
def test_masked_rows_get_zero_loss(model_dir, column):
    masked = row("m", "M", PROMPT, [100, 101, 102, 103], 2.0, **column)
    others = [{**r, "loss_weight": 1.0, "outcome": "ok"} for r in merged()]
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        assert close(gradient(model_dir, others + [masked], loss_type=loss_type),
                     gradient(model_dir, others, loss_type=loss_type))
    totals, _ = step_totals(pa.Table.from_pylist(others + [masked]), "rollout")
    assert (totals.num_sequences, totals.num_tokens) == (2, 14)


def write(data_dir, rows):
    """The rows as the transitions table's one file, with exactly their columns (a store written before
    or after the builder's loss_weight and outcome columns)."""
    import pyarrow.parquet as pq

    (data_dir / "transitions").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), data_dir / "transitions" / "part-0.parquet")


def test_next_batch_leaves_masked_rows_out_and_counts_them(tmp_path):
    rows = [row(f"t{i}", f"r{i}", PROMPT, [65, 66], 1.0, created_unix_nano=i, split="train",
                loss_weight=0.0 if i % 2 else 1.0, outcome="masked" if i == 3 else ("ok" if i % 2 == 0 else "failed"))
            for i in range(6)]
    write(tmp_path, rows)
    cfg = TrainerConfig(data_dir=str(tmp_path), model="m", sync="none")
    batch = next_batch(tmp_path, cfg, version=0, cursor=Cursor(), vocab_size=300, max_len=1024)
    assert sorted(batch.table.column("transition_id").to_pylist()) == ["t0", "t2", "t4"]
    assert batch.masked == 3


def test_next_batch_reads_a_store_without_the_weight_columns(tmp_path):
    rows = [row(f"t{i}", f"r{i}", PROMPT, [65, 66], 1.0, created_unix_nano=i, split="train") for i in range(3)]
    write(tmp_path, rows)       # files written before the builder's columns: the view reads them as null
    cfg = TrainerConfig(data_dir=str(tmp_path), model="m", sync="none")
    batch = next_batch(tmp_path, cfg, version=0, cursor=Cursor(), vocab_size=300, max_len=1024)
    assert batch.table.num_rows == 3 and batch.masked == 0


def test_pack_respects_the_token_budget_and_a_longer_row_runs_alone():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 30)
        p = [rng.randint(1, 400) for _ in range(n)]
        c = [rng.randint(1, 600) for _ in range(n)]
        budget, rows = rng.choice([64, 500, 1000, 4000]), rng.randint(1, 9)
        chunks = pack(p, c, max_rows=rows, max_tokens=budget)
        assert sorted(i for chunk in chunks for i in chunk) == list(range(n))     # every row once
        for chunk in chunks:
            padded = len(chunk) * (max(p[i] for i in chunk) + max(c[i] for i in chunk))
            assert len(chunk) <= rows
            assert padded <= budget or len(chunk) == 1
    # no budget: batch order, micro_batch_size rows each (as before budgets)
    assert pack([5] * 5, [5] * 5, max_rows=2) == [[0, 1], [2, 3], [4]]


def test_long_rows_are_cut_into_more_micro_batches_by_the_budget(model_dir):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    long = [row(f"l{i}", f"r{i}", [1 + j % 250 for j in range(100)], [1 + j % 250 for j in range(200)],
                1.0 if i % 2 else -1.0)
            for i in range(8)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    batch = Batch(table=pa.Table.from_pylist(long), cursor=Cursor())
    m = optimise(Accelerator(cpu=True), model, opt, batch,
                 TrainerConfig(model=str(model_dir), sync="none", micro_batch_tokens=700, shared_prefix_tokens=0))
    assert (m["micro_batches"], m["micro_batch_tokens"]) == (4, 700)        # 2 rows x 300 tokens each
    # the rows share their 100-token prompt: a pass holds it once and 3 rows' 200 completion tokens
    m = optimise(Accelerator(cpu=True), model, opt, batch,
                 TrainerConfig(model=str(model_dir), sync="none", micro_batch_tokens=700))
    assert (m["micro_batches"], m["micro_batch_tokens"]) == (3, 700)
    m = optimise(Accelerator(cpu=True), model, opt, batch,
                 TrainerConfig(model=str(model_dir), sync="none", micro_batch_tokens=100))
    assert m["micro_batches"] == 8                                          # each row alone, still trained
    assert m["num_tokens"] == 8 * 200
    # derived from a memory limit: the budget shrinks with the limit and never goes below a row's worth
    roomy = step_budget(64.0, model, opt)
    assert roomy > step_budget(2.0, model, opt) >= 64


def test_the_budget_is_what_the_memory_leaves_over_the_bytes_per_token():
    per = bytes_per_token(num_layers=30, hidden_size=576, vocab_size=49152)
    assert per == 4 * (40 * 30 * 576 + 8 * 49152)
    reserve = reserve_bytes(135_000_000, optimizer_started=False)
    assert reserve == 3 * 4 * 135_000_000
    assert token_budget(limit_bytes=16 << 30, resident_bytes=2 << 30, reserve=reserve, per_token=per) == \
        ((16 << 30) - (2 << 30) - reserve) // per
    assert token_budget(limit_bytes=1 << 30, resident_bytes=2 << 30, reserve=0, per_token=per) == 64


def test_config_errors_name_the_field():
    for kwargs, field in (({"loss_normalisation": "row"}, "loss_normalisation"),
                          ({"micro_batch_tokens": -1}, "micro_batch_tokens"),
                          ({"max_memory_gb": -2.0}, "max_memory_gb")):
        with pytest.raises(ConfigError, match=field):
            TrainerConfig(model="m", **kwargs)
