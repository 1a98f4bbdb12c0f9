"""LoRA training (trainer/lora.py through trainer/loop.py) on the tiny model: no vLLM here."""

import json

import pyarrow as pa
import pytest
import torch
from safetensors import safe_open

from lightspan import store
from lightspan.core.config import ConfigError
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.batches import collate
from lightspan.trainer.checkpoints import STATE_FILE
from lightspan.trainer.loop import Trainer
from lightspan.trainer.lora import merged_state_dict, reference, save_merged
from lightspan.trainer.loss import token_logprobs

torch.set_num_threads(1)

PROMPT = [60, 61, 62, 63, 64]
GOOD = [[65, 66, 67, 68], [66, 67, 68, 65], [67, 68], [68, 65, 66]]
BAD = [[100, 101, 102, 103], [101, 102, 103], [102, 103, 100, 101], [103, 100]]


def transitions(created, prefix):
    return [{"transition_id": f"{prefix}-{kind}-{i}", "rollout_id": f"r-{prefix}-{kind}-{i}", "task_id": "t0",
             "split": "train", "prompt_token_ids": PROMPT, "completion_token_ids": c,
             "completion_logprobs": [-5.5] * len(c), "model_version": 0, "reward": float(adv > 0),
             "advantage": adv, "created_unix_nano": created}
            for kind, adv, completions in (("good", 1.0, GOOD), ("bad", -1.0, BAD)) for i, c in enumerate(completions)]


def write(data_dir, rows):
    store.write_table(data_dir, "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))


def lora_config(tmp_path, tiny_model, **kwargs):
    return TrainerConfig(**{"data_dir": str(tmp_path / "data"), "model": str(tiny_model), "sync": "none",
                            "torch_threads": 1, "lora_r": 8, "lora_alpha": 16.0, "learning_rate": 1e-2,
                            "metrics_port": 0, **kwargs})


def logprobs_of(model, completions):
    mb = collate([{"prompt_token_ids": PROMPT, "completion_token_ids": c, "completion_logprobs": [0.0] * len(c),
                   "advantage": 0.0} for c in completions], 0)
    with torch.no_grad():
        return token_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_mask)[0]


def test_a_lora_step_trains_every_adapter_parameter_and_nothing_else(tmp_path, tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = lora_config(tmp_path, tiny_model, lora_target_modules="q_proj,v_proj,down_proj", batch_size=8)
    write(cfg.data_dir, transitions(1, "a") + transitions(2, "b"))
    trainer = Trainer(cfg)
    trainer.load_or_init()
    named = dict(trainer.model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    # 2 layers x 3 modules x (A, B)
    assert len(trainable) == 12 and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {id(named[n]) for n in trainable}
    before = {n: p.detach().clone() for n, p in named.items()}

    def changed():
        return {n for n in named if not torch.equal(before[n], named[n])}

    assert trainer.train_once()["num_transitions"] == 8
    # B starts at 0, so the first step's gradient of every A is exactly 0 (LoRA's init, Hu et al.
    # §4.1): the first step moves every B, the second every A too, and the base never
    assert changed() == {n for n in trainable if "lora_B" in n}
    assert trainer.train_once()["num_transitions"] == 8
    assert changed() == trainable

    # the checkpoint is the adapter alone (the export): peft loads it onto the base model
    checkpoint = tmp_path / "data" / "checkpoints" / "v000002"
    assert (checkpoint / "adapter_config.json").is_file() and (checkpoint / STATE_FILE).is_file()
    assert not (checkpoint / "model.safetensors").exists() and (checkpoint / "tokenizer.json").is_file()
    adapter = json.loads((checkpoint / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and sorted(adapter["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    with safe_open(checkpoint / "adapter_model.safetensors", "pt") as f:
        assert len(list(f.keys())) == 12
    exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                         checkpoint).eval()
    trainer.model.eval()
    assert torch.allclose(logprobs_of(exported, GOOD), logprobs_of(trainer.model, GOOD), atol=1e-6)


def test_the_kl_reference_is_the_base_with_adapters_disabled(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM

    cfg = lora_config(tmp_path, tiny_model, beta=0.1, batch_size=8)
    write(cfg.data_dir, transitions(1, "a") + transitions(2, "b"))
    trainer = Trainer(cfg)
    trainer.load_or_init()
    assert trainer.ref_model is None                      # no second copy of the weights
    first = trainer.train_once()
    assert first["kl"] == 0                               # B = 0: version 0 is the base itself
    second = trainer.train_once()
    assert second["kl"] > 0

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    trainer.model.eval()
    with reference(trainer.model) as ref:
        assert torch.allclose(logprobs_of(ref, GOOD), logprobs_of(base, GOOD), atol=1e-6)
    assert not torch.allclose(logprobs_of(trainer.model, GOOD), logprobs_of(base, GOOD), atol=1e-3)


def test_lora_resume_is_exact(tmp_path, tiny_model):
    # dropout > 0: the resumed run must also restore the RNG that draws the dropout masks
    kwargs = dict(batch_size=8, micro_batch_size=3, lora_dropout=0.1, beta=0.05)
    straight, resumed = lora_config(tmp_path / "a", tiny_model, **kwargs), lora_config(tmp_path / "b", tiny_model, **kwargs)
    for cfg in (straight, resumed):
        write(cfg.data_dir, transitions(1, "a") + transitions(2, "b"))
    a = Trainer(straight)
    a.load_or_init()
    a.train_once()
    a.train_once()

    b = Trainer(resumed)
    b.load_or_init()
    b.train_once()
    del b
    c = Trainer(resumed)
    c.load_or_init()
    assert c.version == 1
    c.train_once()

    assert a.version == c.version == 2 and a.cursor == c.cursor
    pa_, pc = dict(a.model.named_parameters()), dict(c.model.named_parameters())
    assert pa_.keys() == pc.keys()
    for name in pa_:
        assert torch.equal(pa_[name], pc[name]), name
    for sa, sc in zip(a.optimizer.state_dict()["state"].values(), c.optimizer.state_dict()["state"].values()):
        assert all(torch.equal(sa[k], sc[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_lora_config_errors_name_the_field():
    for kwargs, name in [(dict(sync="lora"), "trainer.sync"), (dict(lora_r=-1), "trainer.lora_r"),
                         (dict(lora_r=8, sync="lora", lora_dropout=1.0), "trainer.lora_dropout"),
                         (dict(lora_r=8, sync="lora", lora_target_modules=" , "), "trainer.lora_target_modules"),
                         (dict(lora_r=8, sync="nccl"), "trainer.sync")]:
        with pytest.raises(ConfigError) as err:
            TrainerConfig(**{"model": "m", **kwargs})
        assert err.value.field == name


@pytest.mark.parametrize("first_r, then_r", [(8, 0), (0, 8)])
def test_resuming_with_the_other_kind_of_training_fails_naming_lora_r(tmp_path, tiny_model, first_r, then_r):
    first = lora_config(tmp_path, tiny_model, batch_size=8, lora_r=first_r)
    write(first.data_dir, transitions(1, "a"))
    t = Trainer(first)
    t.load_or_init()
    assert t.train_once() is not None and t.version == 1
    other = Trainer(lora_config(tmp_path, tiny_model, batch_size=8, lora_r=then_r))
    with pytest.raises(ConfigError) as err:
        other.load_or_init()
    assert err.value.field == "trainer.lora_r" and "v000001" in str(err.value)


def test_the_merged_weights_are_the_base_with_the_adapter_applied(tmp_path, tiny_model):
    """sync 'reload' with LoRA serves merged_state_dict: under the base checkpoint's own names, equal
    to peft's merge_and_unload of a trained adapter, and a model loaded from save_merged's directory
    gives the adapted model's logprobs."""
    import copy

    from transformers import AutoModelForCausalLM

    cfg = lora_config(tmp_path, tiny_model, batch_size=8)
    write(cfg.data_dir, transitions(1, "a"))
    trainer = Trainer(cfg)
    trainer.load_or_init()
    trainer.train_once()                               # B != 0: the adapter changes the model
    model = trainer.accelerator.unwrap_model(trainer.model)
    merged = merged_state_dict(model)
    with safe_open(str(next(tiny_model.glob("*.safetensors"))), "pt") as base:
        assert set(merged) == set(base.keys())
        changed = {n for n in merged if not torch.equal(merged[n], base.get_tensor(n))}
    assert changed == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo"}
    reference_merge = copy.deepcopy(model).merge_and_unload().state_dict()
    assert all(torch.allclose(merged[n], reference_merge[n], atol=1e-7) for n in merged)

    out = save_merged(model, "default", tmp_path / "served" / "merged", tiny_model)
    assert save_merged(model, "default", out, tiny_model) == out          # complete: written once
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.allclose(logprobs_of(loaded, GOOD), logprobs_of(model, GOOD), atol=1e-5)
    base_model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert not torch.allclose(logprobs_of(loaded, GOOD), logprobs_of(base_model, GOOD), atol=1e-4)
