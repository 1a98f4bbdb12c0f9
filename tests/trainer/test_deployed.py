"""The trainer under canary decisions (trainer/deployed.py): a rolled-back version is not built upon
(the next step starts from the serving version's weights and optimizer state, as a new version),
and the serving version's checkpoint is never pruned. Tiny model, LoRA and full fine-tuning."""

import pytest
import torch

from lightspan.store import deployments as dep
from lightspan.trainer import deployed
from lightspan.trainer.loop import Trainer
from tests.trainer.test_lora import lora_config, transitions, write

torch.set_num_threads(1)


def snapshot(trainer):
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    state = {k: {n: t.clone() for n, t in v.items()} for k, v in trainer.optimizer.state_dict()["state"].items()}
    return params, state


def same(trainer, snap) -> bool:
    params, state = snapshot(trainer)
    return (all(torch.equal(params[n], snap[0][n]) for n in params)
            and all(torch.equal(state[k][n], snap[1][k][n]) for k in state for n in state[k]))


@pytest.mark.parametrize("lora_r", [8, 0])
def test_after_a_rollback_training_goes_on_from_the_serving_version(tmp_path, tiny_model, lora_r):
    cfg = lora_config(tmp_path, tiny_model, batch_size=8, micro_batch_size=8, keep_checkpoints=1, lora_r=lora_r)
    write(cfg.data_dir, transitions(1, "a"))
    trainer = Trainer(cfg)
    trainer.load_or_init()
    trainer.train_once()
    v1 = snapshot(trainer)
    checkpoint_v1 = trainer.model_source
    dep.record(cfg.data_dir, [dep.row("", 1, dep.SERVE, checkpoint=str(checkpoint_v1), time_unix_nano=1)])
    write(cfg.data_dir, transitions(2, "b"))
    trainer.train_once()                                    # v2: the canary
    assert trainer.version == 2 and not same(trainer, v1)
    assert checkpoint_v1.is_dir()                           # serving: kept although keep_checkpoints is 1
    assert deployed.follow_rollback(trainer) is False       # v2 is undecided: nothing to do
    dep.record(cfg.data_dir, [dep.row("", 2, dep.CANARY, checkpoint=str(trainer.model_source), share=0.1,
                                      time_unix_nano=2),
                              dep.row("", 2, dep.ROLLBACK, actor=dep.MANUAL, time_unix_nano=3)])

    assert deployed.follow_rollback(trainer) is True
    assert same(trainer, v1) and trainer.version == 2       # v1's weights and optimizer state, still at 2
    assert deployed.follow_rollback(trainer) is False       # once per rolled-back version
    write(cfg.data_dir, transitions(3, "c"))
    row = trainer.train_once()
    assert row["policy_version"] == 3 and trainer.version == 3     # a new number, never 2 again

    # the same step from v1 by a trainer that never saw v2 gives the same weights
    ref_cfg = lora_config(tmp_path / "ref", tiny_model, batch_size=8, micro_batch_size=8, lora_r=lora_r)
    write(ref_cfg.data_dir, transitions(1, "a"))
    ref = Trainer(ref_cfg)
    ref.load_or_init()
    ref.train_once()
    write(ref_cfg.data_dir, transitions(3, "c"))
    ref.train_once()
    assert same(trainer, snapshot(ref))


def test_in_use_names_the_serving_version_and_the_candidate(tmp_path):
    assert deployed.current(tmp_path, None) is None and deployed.in_use(None) == {}
    a, b = tmp_path / "v000001", tmp_path / "v000002"
    dep.record(tmp_path, [dep.row("", 1, dep.SERVE, checkpoint=str(a), time_unix_nano=1),
                          dep.row("", 2, dep.CANARY, checkpoint=str(b), share=0.2, time_unix_nano=2)])
    assert deployed.in_use(deployed.current(tmp_path, None)) == {1: a.resolve(), 2: b.resolve()}
    assert deployed.current(tmp_path, "other") is None      # a named policy has its own decisions
