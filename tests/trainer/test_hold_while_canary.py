"""hold_while_canary (trainer/deployed.py, 3.): while the trainer's latest version is the undecided
canary, a round trains and publishes nothing; once the canary is decided it trains as usual."""

import logging

import pytest
import torch

from lightspan import store
from lightspan.store import deployments as dep
from lightspan.trainer import deployed
from lightspan.trainer.loop import Trainer
from lightspan.trainer.metrics import PREFIX
from tests.trainer.test_lora import lora_config, transitions, write

torch.set_num_threads(1)


def deployment(*rows):
    return dep.fold([dep.row("", v, action, time_unix_nano=t, share=0.1 if action == dep.CANARY else None)
                     for t, (v, action) in enumerate(rows, 1)]).get("")


HOLD = "holding version 3: the canary of version 2 is not decided yet"


@pytest.mark.parametrize("d, version, enabled, reason", [
    (None, 2, True, None),                                                           # no deployments
    (deployment((1, dep.SERVE)), 1, True, None),                                     # serving, no canary
    (deployment((1, dep.SERVE), (2, dep.CANARY)), 2, True, HOLD),                    # undecided, the latest
    (deployment((1, dep.SERVE), (2, dep.CANARY), (2, dep.PROMOTE)), 2, True, None),  # promoted
    (deployment((1, dep.SERVE), (2, dep.CANARY), (2, dep.ROLLBACK)), 2, True, None),  # rolled back
    (deployment((1, dep.SERVE), (2, dep.CANARY)), 3, True, None),                    # an older version's canary
    (deployment((1, dep.SERVE), (2, dep.CANARY)), 1, True, None),                    # a newer one's (resumed older)
    (deployment((1, dep.SERVE), (2, dep.CANARY)), 2, False, None),                   # the setting off
])
def test_hold_reason(d, version, enabled, reason):
    assert deployed.hold_reason(d, version, enabled=enabled) == reason


def metric(trainer, name):
    page = dict(line.rsplit(" ", 1) for line in trainer.metrics.render().splitlines() if not line.startswith("#"))
    return float(page[PREFIX + name])


@pytest.mark.parametrize("decision", [dep.PROMOTE, dep.ROLLBACK])
def test_a_round_holds_while_the_canary_is_undecided_then_trains(tmp_path, tiny_model, caplog, decision):
    cfg = lora_config(tmp_path, tiny_model, batch_size=8, micro_batch_size=8)
    write(cfg.data_dir, transitions(1, "a"))
    trainer = Trainer(cfg)
    trainer.load_or_init()
    assert trainer.train_round()[0]["policy_version"] == 1
    v1 = trainer.model_source
    dep.record(cfg.data_dir, [dep.row("", 1, dep.SERVE, checkpoint=str(v1), time_unix_nano=1)])
    write(cfg.data_dir, transitions(2, "b"))
    assert trainer.train_round()[0]["policy_version"] == 2                 # serving v1, no canary: trains
    dep.record(cfg.data_dir, [dep.row("", 2, dep.CANARY, checkpoint=str(trainer.model_source), share=0.1,
                                      time_unix_nano=2)])
    write(cfg.data_dir, transitions(3, "c"))
    assert metric(trainer, "rounds_held_total") == 0
    with caplog.at_level(logging.INFO, logger="lightspan.trainer.deployed"):
        for _ in range(3):
            assert trainer.train_round() == []                             # held: a batch is waiting
    assert trainer.version == 2 and store.policy.read(cfg.data_dir).version == 2     # nothing published
    assert not (trainer.output_dir / "v000003").exists()
    assert metric(trainer, "rounds_held_total") == 3
    assert [r.getMessage() for r in caplog.records if "holding" in r.getMessage()] == [HOLD]    # logged once

    dep.record(cfg.data_dir, [dep.row("", 2, decision, actor=dep.MANUAL, time_unix_nano=3)])
    row = trainer.train_round()[0]                                         # decided: the waiting batch trains
    assert row["policy_version"] == 3 and store.policy.read(cfg.data_dir).version == 3
    assert (decision == dep.ROLLBACK) == (2 in trainer.restored)           # a rollback still restores v1 first
    assert metric(trainer, "rounds_held_total") == 3


def test_the_setting_off_trains_over_an_undecided_canary(tmp_path, tiny_model):
    cfg = lora_config(tmp_path, tiny_model, batch_size=8, micro_batch_size=8, hold_while_canary=False)
    write(cfg.data_dir, transitions(1, "a"))
    trainer = Trainer(cfg)
    trainer.load_or_init()
    trainer.train_round()
    dep.record(cfg.data_dir, [dep.row("", 0, dep.SERVE, time_unix_nano=1),
                              dep.row("", 1, dep.CANARY, checkpoint=str(trainer.model_source), share=0.1,
                                      time_unix_nano=2)])
    write(cfg.data_dir, transitions(2, "b"))
    assert trainer.train_round()[0]["policy_version"] == 2
    assert metric(trainer, "rounds_held_total") == 0


def test_each_policy_holds_on_its_own_canary(tmp_path):
    from types import SimpleNamespace

    from lightspan.trainer.config import TrainerConfig
    from lightspan.trainer.metrics import TrainerMetrics

    dep.record(tmp_path, [dep.row("a", 1, dep.SERVE, time_unix_nano=1),
                          dep.row("a", 2, dep.CANARY, share=0.1, time_unix_nano=2),
                          dep.row("b", 2, dep.SERVE, time_unix_nano=3)])
    config = TrainerConfig(data_dir=str(tmp_path), model="m", metrics_port=0)
    trainers = {name: SimpleNamespace(data_dir=tmp_path, policy=name, version=2, config=config, holding=None,
                                      restored=set(), metrics=TrainerMetrics(), from_main=lambda v: v)
                for name in ("a", "b", "c")}
    assert {name: deployed.follow(t) for name, t in trainers.items()} == {"a": True, "b": False, "c": False}
    assert trainers["a"].holding == 2 and trainers["a"].metrics.counters["rounds_held_total"] == 1
    assert trainers["b"].metrics.counters["rounds_held_total"] == 0
