"""Several optimizer steps from one batch (trainer config ``mini_batches``, trainer/step.py)."""

import pyarrow as pa
import pytest
import torch

from lightspan.trainer.loop import Trainer
from lightspan.trainer.loss import BatchTotals
from lightspan.trainer.step import split_rollouts

from tests.trainer.test_loop import BAD, GOOD, good_and_bad, make_config, transition, write

torch.set_num_threads(1)


def table(rollouts):
    return pa.table({"rollout_id": rollouts, "transition_id": [f"t{i}" for i in range(len(rollouts))]})


def test_a_batch_is_cut_between_rollouts_into_even_parts_with_their_share_of_the_zero_advantage_rows():
    # eight rollouts of two calls: four rollouts a part
    rows = table([f"r{i // 2}" for i in range(16)])
    parts = split_rollouts(rows, 2, BatchTotals(5, 41, 9))
    assert [p.column("rollout_id").to_pylist() for p, _ in parts] == [
        [f"r{i // 2}" for i in range(8)], [f"r{i // 2}" for i in range(8, 16)]]
    assert [s for _, s in parts] == [BatchTotals(2, 20, 9), BatchTotals(3, 21, 9)]     # all of it, pro rata
    # a rollout across the middle stays whole, in the first part
    uneven = split_rollouts(table(["a", "b", "b", "b", "c", "d"]), 2, BatchTotals(0, 0, 0))
    assert [p.column("rollout_id").to_pylist() for p, _ in uneven] == [["a", "b", "b", "b"], ["c", "d"]]
    # no more parts than rollouts; a transition without a rollout is one
    assert len(split_rollouts(table(["a", "a", "a"]), 4, BatchTotals(0, 0, 0))) == 1
    assert [p.num_rows for p, _ in split_rollouts(table([None, None, None]), 3, BatchTotals(0, 0, 0))] == [1, 1, 1]
    assert split_rollouts(table([]), 2, BatchTotals(3, 7, 2))[0][1] == BatchTotals(3, 7, 2)


def test_two_mini_batches_are_two_updates_the_first_of_which_is_the_first_half_alone(tmp_path, tiny_model):
    # the batch, oldest first: four good rollouts, then four bad ones
    first = [transition(f"a-good-{i}", c, 1.0, created=1) for i, c in enumerate(GOOD)]
    second = [transition(f"b-bad-{i}", c, -1.0, created=2) for i, c in enumerate(BAD)]
    split = make_config(tmp_path / "split", tiny_model, learning_rate=1e-2, mini_batches=2, batch_size=0)
    alone = make_config(tmp_path / "alone", tiny_model, learning_rate=1e-2, batch_size=4)
    write(split.data_dir, first + second)
    write(alone.data_dir, first + second)

    a = Trainer(split)
    a.load_or_init()
    after_first_update = []
    step = a.optimizer.step

    def snapshot(*args, **kwargs):
        out = step(*args, **kwargs)
        if not after_first_update:
            after_first_update.extend(p.detach().clone() for p in a.model.parameters())
        return out

    a.optimizer.step = snapshot
    row = a.train_once()
    b = Trainer(alone)
    b.load_or_init()
    b.train_once()                                  # the four good rollouts only

    assert a.version == 1 and row["num_transitions"] == 8
    assert {int(s["step"]) for s in a.optimizer.state_dict()["state"].values()} == {2}
    for p, q in zip(after_first_update, b.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    # the second update's ratio is against the logprobs from before the first: not 1
    assert row["ratio_mean"] != pytest.approx(1.0, abs=1e-6)
    assert not all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_one_mini_batch_is_the_step_it_always_was(tmp_path, tiny_model):
    cfg = make_config(tmp_path, tiny_model, learning_rate=1e-2)
    write(cfg.data_dir, good_and_bad(created=1))
    t = Trainer(cfg)
    t.load_or_init()
    row = t.train_once()
    assert row["ratio_mean"] == pytest.approx(1.0)
    assert {int(s["step"]) for s in t.optimizer.state_dict()["state"].values()} == {1}


def test_a_rollouts_rows_stay_in_one_part_wherever_they_lie_in_the_batch():
    parts = split_rollouts(table(["a", "b", "a", "c", "b", "d"]), 2, BatchTotals(0, 0, 0))
    assert [p.column("rollout_id").to_pylist() for p, _ in parts] == [["a", "a", "b", "b"], ["c", "d"]]


def test_no_mini_batches_is_refused_at_start_up_naming_the_field(tmp_path):
    from lightspan.core.config import ConfigError
    from lightspan.trainer.config import TrainerConfig

    with pytest.raises(ConfigError, match="trainer.mini_batches"):
        TrainerConfig(model="m", mini_batches=0)
