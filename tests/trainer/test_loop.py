"""The training loop on the tiny model with synthetic transitions (trainer/loop.py, batches.py, checkpoints.py,
driver.py, config.py)."""

import json
import logging
import math

import pyarrow as pa
import pytest
import torch
from safetensors import safe_open

from lightspan import store
from lightspan.core.config import ConfigError, parse_duration, resolve
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.batches import Cursor, collate
from lightspan.trainer.checkpoints import CONFIG_FILE, STATE_FILE
from lightspan.trainer.driver import run
from lightspan.trainer.loop import Trainer
from lightspan.trainer.loss import policy_loss, token_logprobs

torch.set_num_threads(1)

PROMPT = [60, 61, 62, 63, 64]
GOOD = [[65, 66, 67, 68], [66, 67, 68, 65], [67, 68], [68, 65, 66]]       # advantage +1
BAD = [[100, 101, 102, 103], [101, 102, 103], [102, 103, 100, 101], [103, 100]]  # advantage -1


def transition(tid, completion, advantage, *, created, version=0, split="train", logprobs=None, reward=None):
    return {"transition_id": tid, "rollout_id": f"r-{tid}", "task_id": "t0", "split": split,
            "agent_name": "test", "call_index": 0, "num_calls": 1, "prompt_token_ids": PROMPT,
            "completion_token_ids": completion,
            # the tiny model is near uniform over 260 tokens: log(1/260) ~ -5.56 is close to on-policy
            "completion_logprobs": [-5.5] * len(completion) if logprobs is None else logprobs,
            "model_version": version, "reward": float(advantage > 0) if reward is None else reward,
            "credit": None, "advantage": advantage, "credit_policy": "identical",
            "advantage_estimator": "grpo", "build_id": "b0", "created_unix_nano": created}


def write(data_dir, rows):
    store.write_table(data_dir, "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))


def good_and_bad(created, prefix="x"):
    return ([transition(f"{prefix}-good-{i}", c, 1.0, created=created) for i, c in enumerate(GOOD)]
            + [transition(f"{prefix}-bad-{i}", c, -1.0, created=created) for i, c in enumerate(BAD)])


def make_config(tmp_path, tiny_model, **kwargs):
    return TrainerConfig(**{"data_dir": str(tmp_path / "data"), "model": str(tiny_model), "sync": "none",
                            "torch_threads": 1, **kwargs})


def mean_logprob(trainer, completions):
    mb = collate([{"prompt_token_ids": PROMPT, "completion_token_ids": c, "completion_logprobs": [0.0] * len(c),
                   "advantage": 0.0} for c in completions], 0)
    with torch.no_grad():
        lp, _ = token_logprobs(trainer.model, mb.input_ids, mb.attention_mask, mb.completion_mask)
    return float(lp.sum() / mb.completion_mask.sum())


def test_step_moves_positive_completions_up_and_writes_a_train_step(tmp_path, tiny_model):
    cfg = make_config(tmp_path, tiny_model, learning_rate=1e-2, micro_batch_size=3, max_staleness=0)
    rows = good_and_bad(created=100) + [
        transition("zero", [70, 71], 0.0, created=100),                         # no gradient
        transition("unversioned", [70, 71], 1.0, created=100, version=None),    # staleness unknown
        transition("misaligned", [70, 71], 1.0, created=100, logprobs=[-1.0]),  # malformed
        transition("held-out", [70, 71], 1.0, created=100, split="val"),        # never trained
    ]
    write(cfg.data_dir, rows)
    trainer = Trainer(cfg)
    trainer.load_or_init()
    before = mean_logprob(trainer, GOOD), mean_logprob(trainer, BAD)

    row = trainer.train_once()

    after = mean_logprob(trainer, GOOD), mean_logprob(trainer, BAD)
    assert after[0] > before[0] + 0.1, (before, after)
    assert after[1] < before[1] - 0.1, (before, after)
    counts = row["num_transitions"], row["zero_advantage"], row["skipped_stale"], row["skipped_malformed"]
    assert counts == (8, 1, 1, 1)
    assert row["num_tokens"] == sum(map(len, GOOD + BAD))
    assert row["is_ratio_mean"] == pytest.approx(1.0, abs=0.2)
    assert trainer.version == 1 and trainer.cursor == Cursor(100, "zero")

    steps = store.connect(cfg.data_dir).sql("SELECT * FROM train_steps").to_arrow_table().to_pylist()
    assert len(steps) == 1
    step = steps[0]
    assert step["policy_version"] == 1 and step["num_transitions"] == 8 and step["skipped_stale"] == 1
    assert step["reward_mean"] == pytest.approx(5 / 10)      # 10 fresh rollouts consumed (4 good + misaligned rewarded)
    assert step["advantage_abs_mean"] == 1.0 and step["kl"] == 0.0 and step["step_seconds"] > 0
    assert step["sync_max_abs_logprob_diff"] is None          # sync 'none': nothing to verify

    checkpoint = tmp_path / "data" / "checkpoints" / "v000001"
    policy = json.loads((tmp_path / "data" / "policy.json").read_text())
    assert policy["version"] == 1 and policy["path"] == str(checkpoint.resolve())
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", STATE_FILE):
        assert (checkpoint / name).is_file(), name
    assert json.loads((checkpoint / CONFIG_FILE).read_text())["loss_type"] == cfg.loss_type
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        assert "lm_head.weight" in f.keys()                     # untied: vLLM reloads the head too
    assert json.loads((checkpoint / "config.json").read_text())["tie_word_embeddings"] is False

    # everything up to the cursor is consumed; later transitions are read, stale ones counted
    assert trainer.next_batch() is None
    write(cfg.data_dir, [transition("old-0", [70], 1.0, created=200, version=0),
                         transition("old-1", [71], 1.0, created=200, version=0),
                         transition("new-0", [72], -1.0, created=200, version=1)])
    batch = trainer.next_batch()
    assert [r["transition_id"] for r in batch.rows] == ["new-0"]
    assert batch.skipped_stale == 2 and batch.staleness_mean == 0 and batch.cursor == Cursor(200, "old-1")


def test_resume_is_exact(tmp_path, tiny_model):
    straight = make_config(tmp_path / "a", tiny_model, learning_rate=1e-3, batch_size=4, micro_batch_size=3)
    resumed = make_config(tmp_path / "b", tiny_model, learning_rate=1e-3, batch_size=4, micro_batch_size=3,
                          keep_checkpoints=1)
    for cfg in (straight, resumed):
        write(cfg.data_dir, good_and_bad(created=10, prefix="first"))

    a = Trainer(straight)
    a.load_or_init()
    a.train_once()
    a.train_once()

    b = Trainer(resumed)
    b.load_or_init()
    b.train_once()
    cursor_after_one = b.cursor
    del b
    c = Trainer(resumed)
    c.load_or_init()
    assert c.version == 1 and c.cursor == cursor_after_one
    policy = tmp_path / "b" / "data" / "policy.json"
    policy.unlink()                                 # as if the trainer died between save and publish
    c.ensure_published()
    assert json.loads(policy.read_text())["version"] == 1
    c.train_once()

    assert a.version == c.version == 2 and a.cursor == c.cursor == Cursor(10, "first-good-3")
    with safe_open(tiny_model / "model.safetensors", "pt") as f:
        assert not torch.equal(f.get_tensor("lm_head.weight"), a.model.lm_head.weight)   # it did train
    for (name, pa_), (_, pc) in zip(a.model.named_parameters(), c.model.named_parameters()):
        assert torch.equal(pa_, pc), name
    for sa, sc in zip(a.optimizer.state_dict()["state"].values(), c.optimizer.state_dict()["state"].values()):
        assert all(torch.equal(sa[k], sc[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert [p.name for p in (tmp_path / "b" / "data" / "checkpoints").iterdir()] == ["v000002"]


def test_several_passes_clip_and_the_kl_term_grows(tmp_path, tiny_model):
    cfg = make_config(tmp_path, tiny_model, learning_rate=2e-2, num_iterations=3, beta=0.1)
    write(cfg.data_dir, good_and_bad(created=1))
    trainer = Trainer(cfg)
    trainer.load_or_init()
    row = trainer.train_once()
    # pass 1 is at pi_old = pi_ref; passes 2 and 3 have moved away from both
    assert row["clip_ratio"] > 0 and row["kl"] > 0 and row["ratio_mean"] != 1.0


def test_config_errors_name_the_field():
    cases = [
        (dict(mode="every"), "trainer.every"),
        (dict(mode="every", every="soon"), "trainer.every"),
        (dict(learning_rate=0.0), "trainer.learning_rate"),
        (dict(epsilon=-0.1), "trainer.epsilon"),
        (dict(epsilon_high=-1.0), "trainer.epsilon_high"),
        (dict(loss_type="ppo"), "trainer.loss_type"),
        (dict(model=""), "trainer.model"),
    ]
    for kwargs, name in cases:
        with pytest.raises(ConfigError) as err:
            TrainerConfig(**{"model": "m", **kwargs})
        assert err.value.field == name and name in str(err.value)
    with pytest.raises(ConfigError, match="trainer.is_correction"):
        resolve(TrainerConfig, section="trainer", environ={"LIGHTSPAN_TRAINER_IS_CORRECTION": "tis"},
                cli={"model": "m"})
    cfg = resolve(TrainerConfig, section="trainer", environ={"LIGHTSPAN_DATA_DIR": "/d"},
                  cli={"model": "m", "mode": "every", "every": "1h30m"})
    assert cfg.data_dir == "/d" and parse_duration(cfg.every) == 5400
    assert parse_duration("10s") == 10 and parse_duration("30m") == 1800 and parse_duration("250ms") == 0.25


def test_run_once_without_data_says_so(tmp_path, tiny_model, caplog):
    caplog.set_level(logging.INFO, logger="lightspan.trainer")
    cfg = make_config(tmp_path, tiny_model, mode="once")
    assert run(cfg) == 0
    assert "nothing to train" in caplog.text
    assert json.loads((tmp_path / "data" / "policy.json").read_text())["version"] == 0


def test_run_continuous_stops_after_max_steps(tmp_path, tiny_model):
    cfg = make_config(tmp_path, tiny_model, mode="continuous", max_steps=2, batch_size=4, poll_interval_s=0.01)
    write(cfg.data_dir, good_and_bad(created=5))
    assert run(cfg) == 0
    assert json.loads((tmp_path / "data" / "policy.json").read_text())["version"] == 2
    assert store.connect(cfg.data_dir).execute("SELECT count(*) FROM train_steps").fetchone()[0] == 2


def test_the_stored_grad_norm_is_the_norm_the_step_clipped(tmp_path, tiny_model):
    cfg = make_config(tmp_path, tiny_model, learning_rate=1e-2, max_grad_norm=1e-3, micro_batch_size=16)
    write(cfg.data_dir, good_and_bad(created=1))
    trainer = Trainer(cfg)
    trainer.load_or_init()
    # the step's gradient, computed here on the same batch: one micro-batch, one pass (ratio 1)
    mb = collate(trainer.next_batch().rows, 0)
    logprobs, _ = token_logprobs(trainer.model, mb.input_ids, mb.attention_mask, mb.completion_mask, mb.temperatures)
    loss, _ = policy_loss(logprobs, logprobs.detach(), mb.advantages, mb.completion_mask, loss_type=cfg.loss_type,
                          epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, behaviour_logprobs=mb.behaviour_logprobs,
                          is_correction=cfg.is_correction, is_cap=cfg.is_cap, is_floor=cfg.is_floor)
    loss.backward()
    expected = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.model.parameters()
                                                           if p.grad is not None])))
    trainer.model.zero_grad(set_to_none=True)

    row = trainer.train_once()

    stored = store.connect(cfg.data_dir).execute("SELECT grad_norm FROM train_steps").fetchone()[0]
    assert stored == pytest.approx(expected, rel=1e-4)
    assert stored > 100 * cfg.max_grad_norm            # the norm before clipping, not after
    assert row["grad_norm"] == stored == trainer.metrics.gauges["grad_norm"]


def test_rows_with_missing_or_non_finite_logprobs_are_malformed_and_never_reach_the_loss(tmp_path, tiny_model):
    cfg = make_config(tmp_path, tiny_model, learning_rate=1e-2)
    write(cfg.data_dir, good_and_bad(created=100) + [
        transition("nan", [70, 71], 1.0, created=100, logprobs=[-5.5, float("nan")]),
        transition("inf", [70, 71], -1.0, created=100, logprobs=[float("-inf"), -5.5]),
        transition("null", [70, 71], 1.0, created=100, logprobs=[-5.5, None]),
    ])
    trainer = Trainer(cfg)
    trainer.load_or_init()
    row = trainer.train_once()
    assert row["skipped_malformed"] == 3 and row["num_transitions"] == 8
    assert all(math.isfinite(row[k]) for k in ("loss", "is_ratio_mean", "grad_norm"))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_the_trainer_steps_at_the_scheduled_rate(tmp_path, tiny_model):
    # decayed to 0 after one version: the first step moves the weights, the second cannot
    c = make_config(tmp_path, tiny_model, learning_rate=1e-2, lr_schedule="linear", lr_decay_steps=1,
                    lr_final_ratio=0.0, batch_size=8, micro_batch_size=8, max_staleness=4)
    write(c.data_dir, good_and_bad(created=1, prefix="a"))
    trainer = Trainer(c)
    trainer.load_or_init()
    weights = lambda: [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]  # noqa: E731
    start = weights()
    trainer.train_once()
    first = weights()
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
    assert any(not torch.equal(a, b) for a, b in zip(start, first))
    write(c.data_dir, good_and_bad(created=2, prefix="b"))
    trainer.train_once()
    assert trainer.version == 2 and trainer.optimizer.param_groups[0]["lr"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(first, weights()))
