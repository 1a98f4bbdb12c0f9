"""Fully sharded data parallel (FSDP2): two sharded processes equal one process, and resume exactly.

The runs are launched as a user would launch them on GPUs, with deploy/accelerate/fsdp.yaml,
overriding only the process count and the mixed precision (no bf16 on this CPU-only machine).
accelerate alone would turn that launch into DDP on a machine without CUDA; the trainer selects
FSDP2 over gloo instead (trainer/distributed.py, ``fsdp_on_cpu``), so the parameters really are
DTensor shards here, gathered onto rank 0 for every checkpoint.

Tolerances: two ranks sum the same per-token gradients in another order than one process
(reduce-scatter, then Adam), so their weights agree to float32 rounding, far below the change
training makes (> 1e-3); 1e-5 is the bound test_ddp.py uses for the same comparison. A resumed
sharded run repeats the same operations on the same ranks, so it must match bit for bit.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from lightspan import store
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.checkpoints import STATE_FILE, named_optimizer_state, numbered_optimizer_state
from lightspan.trainer.driver import run
from tests.conftest import free_port
from tests.trainer.test_ddp import STEPS, batches, config_args

REPO = Path(__file__).resolve().parents[2]
FIELDS = TrainerConfig.__dataclass_fields__
BETA = 0.05                 # the KL reference model is sharded too: its forward is a collective


def args(data_dir: Path, model: Path, **overrides) -> dict:
    return {**config_args(data_dir, model), "beta": BETA, **overrides}


def launch(data_dir: Path, model: Path, **overrides) -> subprocess.CompletedProcess:
    cli = [f"--{k.replace('_', '-')}={v}" for k, v in args(data_dir, model, **overrides).items() if k in FIELDS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "deploy/accelerate/fsdp.yaml"),
         "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port()),
         "-m", "lightspan.cli", "train", *cli],
        cwd=data_dir.parent, env=env, capture_output=True, text=True, timeout=240, check=False)


def launched_ok(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "data parallel over 2 processes (FSDP)" in done.stderr, done.stderr[-3000:]


def in_process(data_dir: Path, model: Path, **overrides) -> None:
    threads = torch.get_num_threads()
    try:
        assert run(TrainerConfig(**{k: v for k, v in args(data_dir, model, **overrides).items() if k in FIELDS})) == 0
    finally:
        torch.set_num_threads(threads)


def steps(data_dir: Path) -> list[dict]:
    return store.connect(data_dir).sql("SELECT * FROM train_steps ORDER BY step").to_arrow_table().to_pylist()


def checkpoint(data_dir: Path, version: int) -> Path:
    return data_dir / "checkpoints" / f"v{version:06d}"


def weights(data_dir: Path, version: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(checkpoint(data_dir, version) / "model.safetensors")


def trainer_state(data_dir: Path, version: int = STEPS) -> dict:
    return torch.load(checkpoint(data_dir, version) / STATE_FILE, weights_only=True)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_optimizer_state_numbering_round_trips():
    names = ["a.weight", "b.weight", "c.bias"]
    numbered = {"state": {0: {"step": torch.tensor(3.0)}, 2: {"step": torch.tensor(1.0)}},
                "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}]}
    named = named_optimizer_state(numbered, names)
    assert named["param_groups"] == [{"lr": 0.1, "params": ["a.weight", "b.weight"]}, {"lr": 0.2, "params": ["c.bias"]}]
    assert set(named["state"]) == {"a.weight", "c.bias"}          # b has no state yet: it stays absent
    assert numbered_optimizer_state(named, names) == numbered
    with pytest.raises(ValueError, match="not this model's checkpoint"):
        named_optimizer_state(numbered, names[:2])


def test_fsdp_equals_one_process_and_resumes_exactly(tmp_path, tiny_model):
    dirs = {name: tmp_path / name for name in ("one", "fsdp", "resumed")}
    for d in dirs.values():
        store.write_table(d, "transitions", pa.Table.from_pylist(batches(), schema=store.TRANSITION_SCHEMA))

    launched_ok(launch(dirs["fsdp"], tiny_model))                        # 3 steps, uninterrupted
    launched_ok(launch(dirs["resumed"], tiny_model, max_steps=STEPS - 1))   # 2 steps, stop ...
    portable = tmp_path / "portable"                                   # (a sharded checkpoint, resumed by 1 process)
    shutil.copytree(dirs["resumed"], portable)
    resumed = launch(dirs["resumed"], tiny_model, max_steps=1)         # ... and a new launch for the 3rd
    launched_ok(resumed)
    assert f"resumed version {STEPS - 1}" in resumed.stderr
    in_process(dirs["one"], tiny_model)
    in_process(portable, tiny_model, max_steps=1)

    # FSDP takes the same steps as one process
    one, fsdp = steps(dirs["one"]), steps(dirs["fsdp"])
    assert [r["step"] for r in fsdp] == [1, 2, 3], "rank 0 alone writes one train_steps row per step"
    assert [r["num_transitions"] for r in fsdp] == [r["num_transitions"] for r in one] == [6, 6, 3]
    assert one[-1]["kl"] > 0, "the KL term never moved: the reference comparison would be vacuous"
    for a, b in zip(one, fsdp):
        assert a["num_tokens"] == b["num_tokens"]
        for key in ("loss", "kl", "entropy", "is_ratio_mean", "clip_ratio", "advantage_abs_mean", "reward_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key

    initial = load_file(tiny_model / "model.safetensors")
    assert max_diff(weights(dirs["one"]), initial) > 1e-3, "training did not change the weights"
    assert max_diff(weights(dirs["fsdp"]), weights(dirs["one"])) < 1e-5
    # the gathered optimizer state is numbered like one process's: Adam's moments line up
    states = {name: trainer_state(dirs[name]) for name in dirs}
    moments = [states[n]["optimizer"]["state"] for n in ("one", "fsdp")]
    assert moments[0].keys() == moments[1].keys() == set(range(len(initial)))
    for i in moments[0]:
        assert torch.equal(moments[0][i]["step"], moments[1][i]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = moments[0][i][key], moments[1][i][key]
            assert a.shape == b.shape, (i, key)           # full tensors, not rank 0's shard
            relative = float((a - b).norm() / a.norm().clamp(min=1e-30))
            assert relative < 1e-4, (i, key, relative)
    def groups(state):    # the fused kernel is one process's choice (not FSDP's): a speed, not a state
        return [{k: v for k, v in g.items() if k != "fused"} for g in state["optimizer"]["param_groups"]]
    assert groups(states["one"]) == groups(states["fsdp"])

    # stop after 2 steps and resume under FSDP: bit for bit the uninterrupted sharded run
    resumed_rows = steps(dirs["resumed"])
    assert [r["step"] for r in resumed_rows] == [1, 2, 3]
    for key in ("loss", "kl", "entropy", "is_ratio_mean", "clip_ratio"):
        assert resumed_rows[-1][key] == fsdp[-1][key], key
    assert max_diff(weights(dirs["resumed"]), weights(dirs["fsdp"])) == 0.0
    assert states["resumed"]["cursor"] == states["fsdp"]["cursor"] == (300, "s3-f-2")
    for i, state in states["fsdp"]["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(states["resumed"]["optimizer"]["state"][i][key], value), (i, key)
    assert states["resumed"]["run_id"] == trainer_state(dirs["resumed"], 1)["run_id"]

    # the sharded checkpoint after step 2, resumed by one process, ends where one process does
    assert max_diff(weights(portable), weights(dirs["one"])) < 1e-5

    # the saved model is a plain HF model: transformers loads it, with its tokenizer, and it
    # computes what the one-process model computes
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = checkpoint(dirs["fsdp"], STEPS)
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(checkpoint(dirs["one"], STEPS), dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings is False
    ids = torch.tensor([AutoTokenizer.from_pretrained(saved)("12 + 30 = 42")["input_ids"]])
    with torch.no_grad():
        logits, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert float((logits - expected).abs().max()) < 1e-4
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights(dirs["fsdp"])[name]), name


def test_lora_under_fsdp_resumed_equals_one_process(tmp_path, tiny_model):
    # LoRA: only the adapters train; the checkpoint gathers them alone (the frozen base is --model),
    # and the KL reference is the same sharded model with its adapters disabled
    lora = {"lora_r": 8, "learning_rate": 1e-2}
    dirs = {name: tmp_path / name for name in ("one", "fsdp")}
    for d in dirs.values():
        store.write_table(d, "transitions", pa.Table.from_pylist(batches(), schema=store.TRANSITION_SCHEMA))
    launched_ok(launch(dirs["fsdp"], tiny_model, max_steps=STEPS - 1, **lora))
    resumed = launch(dirs["fsdp"], tiny_model, max_steps=1, **lora)
    launched_ok(resumed)
    assert f"resumed version {STEPS - 1}" in resumed.stderr
    in_process(dirs["one"], tiny_model, **lora)

    one, fsdp = steps(dirs["one"]), steps(dirs["fsdp"])
    assert [r["step"] for r in fsdp] == [1, 2, 3] and one[-1]["kl"] > 0
    for a, b in zip(one, fsdp):
        for key in ("loss", "kl", "entropy", "is_ratio_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    adapters = [load_file(checkpoint(dirs[n], STEPS) / "adapter_model.safetensors") for n in ("one", "fsdp")]
    assert adapters[0].keys() == adapters[1].keys() and any("lora_B" in k for k in adapters[0])
    assert max(float(v.abs().max()) for k, v in adapters[0].items() if "lora_B" in k) > 1e-3, "B never moved"
    # one process steps with the fused AdamW kernel, FSDP with the per-tensor one (fused aborts on
    # CPU DTensors): the same update up to float rounding, which lr 1e-2 scales up
    assert max_diff(*adapters) < 5e-5
    moments = [trainer_state(dirs[n])["optimizer"]["state"] for n in ("one", "fsdp")]
    assert moments[0].keys() == moments[1].keys() == set(range(len(adapters[0])))
    for i in moments[0]:
        a, b = moments[0][i]["exp_avg_sq"], moments[1][i]["exp_avg_sq"]
        assert float((a - b).norm() / a.norm().clamp(min=1e-30)) < 1e-4, i

    # the saved adapter is peft's export format: it loads onto the base model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                      str(checkpoint(dirs["fsdp"], STEPS)))
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(adapters[1])
    for name, tensor in loaded.items():
        assert torch.equal(tensor, adapters[1][name.replace(".default", "")]), name


@pytest.fixture
def restore_weights(vllm_server, tmp_path):
    """Give the session's vLLM server its original weights back, from a new directory."""
    yield
    from lightspan.trainer.sync import ReloadSync

    ReloadSync(vllm_server.url).push(shutil.copytree(vllm_server.model_dir, tmp_path / "restore-v0"), 0)


def test_sharded_step_is_synced_into_vllm_and_verified(tmp_path, vllm_server, restore_weights):
    # publish checks vLLM's logprobs against the trainer's; under FSDP that forward pass is a
    # collective, which every rank must run, or rank 0 waits for the others forever
    data_dir = tmp_path / "data"
    store.write_table(data_dir, "transitions", pa.Table.from_pylist(batches()[:6], schema=store.TRANSITION_SCHEMA))
    done = launch(data_dir, vllm_server.model_dir, max_steps=1, sync="reload", vllm_url=vllm_server.url,
                  served_model_name=vllm_server.model_name)
    launched_ok(done)
    [row] = steps(data_dir)
    assert row["policy_version"] == 1 and row["sync_seconds"] > 0
    assert row["sync_max_abs_logprob_diff"] < 1e-4, row["sync_max_abs_logprob_diff"]
    moved = max_diff(weights(data_dir, 1), load_file(vllm_server.model_dir / "model.safetensors"))
    assert moved > 1e-4, "the step did not change the weights: the check would be vacuous"
