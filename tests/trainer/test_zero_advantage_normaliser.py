"""Whether the zero-advantage sequences of a step count in what its loss divides by (issue 33).

next_batch leaves transitions with advantage 0 out of the forward pass (they carry no gradient).
With ``zero_advantage = 'count'`` GRPO's 1/G counts every sampled output of the step, as TRL's
GRPOTrainer does; with ``'exclude'`` (the default, DAPO's dynamic sampling) the loss divides by the
informative sequences only, so a step with one informative group in four moves the policy as far
as one with four (bench/README.md, "Per step against TRL").
"""

import pyarrow as pa
import pytest

from lightspan import store
from lightspan.trainer.batches import Cursor, next_batch
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.loop import Trainer
from lightspan.trainer.loss import BatchTotals


def _row(i, advantage, n_completion, rollout=None):
    return {"transition_id": f"t{i}", "rollout_id": rollout or f"r{i}", "task_id": "task",
            "prompt_token_ids": [60, 61, 62], "completion_token_ids": [65 + i % 5] * n_completion,
            "completion_logprobs": [-5.5] * n_completion, "model_version": 0, "reward": 0.0,
            "advantage": advantage, "created_unix_nano": 1 + i}


INFORMATIVE = [_row(0, 1.0, 3), _row(1, -1.0, 4)]
ZERO = [_row(2, 0.0, 5), _row(3, 0.0, 2)]


def _grad_norm(tmp_path, name, rows, tiny_model, loss_type, zero_advantage="count"):
    cfg = TrainerConfig(model=str(tiny_model), data_dir=str(tmp_path / name), sync="none", torch_threads=1,
                        learning_rate=1e-3, max_grad_norm=0.0, metrics_port=0, loss_type=loss_type,
                        zero_advantage=zero_advantage)
    store.write_table(cfg.data_dir, "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))
    trainer = Trainer(cfg)
    trainer.load_or_init()
    row = trainer.train_once()
    assert row is not None and row["num_transitions"] == 2
    return row


@pytest.mark.parametrize(("loss_type", "scale"), [
    ("grpo", 2 / 4),                   # 1/G over 4 sequences, not the 2 informative ones
    ("dapo", (3 + 4) / (3 + 4 + 5 + 2)),   # every sampled token of the step
    ("dr_grpo", (2 * 4) / (4 * 5)),     # sequences x the longest completion, the zero rows' 5 included
])
def test_zero_advantage_sequences_count_in_the_normaliser(tmp_path, tiny_model, loss_type, scale):
    alone = _grad_norm(tmp_path, "alone", INFORMATIVE, tiny_model, loss_type)
    with_zero = _grad_norm(tmp_path, "with-zero", INFORMATIVE + ZERO, tiny_model, loss_type)
    assert with_zero["zero_advantage"] == 2
    # the same two rows trained from the same weights: only the normaliser differs
    assert with_zero["grad_norm"] == pytest.approx(alone["grad_norm"] * scale, rel=1e-4)
    # the per-token metrics stay means over the trained tokens
    assert with_zero["num_tokens"] == alone["num_tokens"] == 7
    assert with_zero["entropy"] == pytest.approx(alone["entropy"], rel=1e-5)


def test_excluded_zero_advantage_sequences_leave_the_normaliser_alone(tmp_path, tiny_model):
    """The default: the same gradient with or without the zero-advantage rows in the batch."""
    assert TrainerConfig.__dataclass_fields__["zero_advantage"].default == "exclude"
    alone = _grad_norm(tmp_path, "alone", INFORMATIVE, tiny_model, "grpo", "exclude")
    with_zero = _grad_norm(tmp_path, "with-zero", INFORMATIVE + ZERO, tiny_model, "grpo", "exclude")
    assert with_zero["zero_advantage"] == 2
    assert with_zero["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-5)


def test_a_bad_zero_advantage_setting_fails_naming_it():
    with pytest.raises(Exception, match="zero_advantage"):
        TrainerConfig(model="m", zero_advantage="sometimes")


def _batch(tmp_path, rows, normalisation):
    data = tmp_path / normalisation
    store.write_table(str(data), "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))
    cfg = TrainerConfig(model="m", data_dir=str(data), sync="none", loss_normalisation=normalisation)
    return next_batch(str(data), cfg, version=0, cursor=Cursor(), vocab_size=1000, max_len=1000)


def test_zero_totals_per_transition_and_per_rollout(tmp_path):
    rows = [_row(0, 1.0, 3, "a"), _row(1, 0.0, 4, "a"),            # rollout a: trained, one zero call
            _row(2, 0.0, 5, "b"), _row(3, 0.0, 2, "b"),            # rollout b: both calls zero
            _row(4, 0.0, 6, "c")]                                   # rollout c: one zero call
    assert _batch(tmp_path, rows, "transition").zero_totals == BatchTotals(4, 4 + 5 + 2 + 6, 6)
    # per rollout: b is one sequence of 7 tokens, c one of 6; a is trained, its zero call is not a sequence
    assert _batch(tmp_path, rows, "rollout").zero_totals == BatchTotals(2, 7 + 6, 7)


def test_no_zero_rows_no_zero_totals(tmp_path):
    assert _batch(tmp_path, INFORMATIVE, "transition").zero_totals == BatchTotals(0, 0, 0)
