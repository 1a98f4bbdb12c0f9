"""Data-parallel training: two processes under ``accelerate launch`` equal one process.

The two-process run is launched as a user would launch it on GPUs, with
deploy/accelerate/ddp.yaml, overriding only the process count and the mixed precision (no bf16
autocast on this CPU-only machine). On a machine without CUDA accelerate's multi-GPU launcher
(torchrun) starts the processes and each falls back to DDP over gloo on the CPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from lightspan import store
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.batches import shard_groups
from lightspan.trainer.driver import run
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def transition(tid, task, prompt, completion, advantage, created, mask=None):
    return {"transition_id": tid, "rollout_id": f"r-{tid}", "task_id": task, "split": "train",
            "agent_name": "test", "call_index": 0, "num_calls": 1, "prompt_token_ids": prompt,
            "completion_token_ids": completion, "completion_mask": mask,
            "completion_logprobs": [-5.4 - 0.01 * (j % 7) for j in range(len(completion))],
            "model_version": 0, "temperature": 0.8, "reward": float(advantage > 0), "credit": None,
            "advantage": advantage, "credit_policy": "identical", "advantage_estimator": "grpo",
            "build_id": "b0", "created_unix_nano": created}


def batches() -> list[dict]:
    """Three batches of 6, 6 and 3 transitions whose groups split unevenly over two ranks."""
    rows, n = [], 0

    def add(step, task, size, base):
        nonlocal n
        for k in range(size):
            n += 1
            prompt = [(base + 7 * k + j) % 250 for j in range(3 + (n % 5))]
            completion = [(base + 3 * k + 11 * j) % 250 for j in range(2 + (n * 3) % 7)]
            mask = [int(j % 3 != 1) for j in range(len(completion))] if n % 4 == 0 else None
            rows.append(transition(f"s{step}-{task}-{k}", task, prompt, completion, 1.0 - 2 * (k % 2) + 0.1 * k,
                                   created=100 * step, mask=mask))

    add(1, "a", 4, 10)          # one large group: rank 0 gets 2 micro-batches, rank 1 one (+ one padding)
    add(1, "b", 1, 60)
    add(1, "c", 1, 90)
    add(2, "d", 3, 120)
    add(2, "e", 3, 150)
    add(3, "f", 3, 200)         # a single group: rank 1 has nothing and runs padding passes only
    return rows


def config_args(data_dir: Path, model: Path) -> dict:
    return {"data_dir": str(data_dir), "model": str(model), "sync": "none", "mode": "continuous",
            "max_steps": STEPS, "poll_interval_s": 0.05, "batch_size": 6, "micro_batch_size": 2,
            "loss_type": "grpo", "learning_rate": 1e-3, "keep_checkpoints": STEPS, "torch_threads": 1,
            "metrics_port": 0}


def test_shard_groups_keeps_groups_whole_and_balances_tokens():
    rows = [{"transition_id": str(i), "task_id": t, "prompt_token_ids": [0] * p, "completion_token_ids": [0]}
            for i, (t, p) in enumerate([("a", 9), ("b", 1), ("a", 9), ("c", 4), ("b", 1), ("d", 2)])]
    shards = shard_groups(rows, 2)
    assert shards == [[0, 2], [1, 3, 4, 5]]        # a (20 tokens) first; c (5), b (4), d (3) to the lighter
    assert shard_groups(rows, 1) == [list(range(6))]
    assert shard_groups(rows[:1], 3) == [[0], [], []]


def test_two_processes_equal_one(tmp_path, tiny_model):
    rows = batches()
    dirs = {name: tmp_path / name for name in ("one", "two")}
    for d in dirs.values():
        store.write_table(d, "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))

    # two ranks, launched as deploy/accelerate/README.md says
    fields = TrainerConfig.__dataclass_fields__
    cli = [f"--{k.replace('_', '-')}={v}" for k, v in config_args(dirs["two"], tiny_model).items() if k in fields]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launched = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "deploy/accelerate/ddp.yaml"),
         "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port()),
         "-m", "lightspan.cli", "train", *cli],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-6000:]
    assert "data parallel over 2 processes" in launched.stderr, launched.stderr[-3000:]

    # one process, in this process, on the same data
    cfg = TrainerConfig(**{k: v for k, v in config_args(dirs["one"], tiny_model).items() if k in fields})
    threads = torch.get_num_threads()
    try:
        assert run(cfg) == 0
    finally:
        torch.set_num_threads(threads)

    def steps(d):
        return store.connect(d).sql("SELECT * FROM train_steps ORDER BY step").to_arrow_table().to_pylist()

    one, two = steps(dirs["one"]), steps(dirs["two"])
    assert [r["step"] for r in two] == [1, 2, 3], "rank 0 alone writes one train_steps row per step"
    assert [r["num_transitions"] for r in two] == [r["num_transitions"] for r in one] == [6, 6, 3]
    for a, b in zip(one, two):
        assert a["num_tokens"] == b["num_tokens"]
        for key in ("loss", "entropy", "is_ratio_mean", "clip_ratio", "advantage_abs_mean", "reward_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key

    final = [load_file(dirs[n] / "checkpoints" / f"v{STEPS:06d}" / "model.safetensors") for n in ("one", "two")]
    initial = load_file(tiny_model / "model.safetensors")
    assert final[0].keys() == final[1].keys()
    moved = max(float((final[0][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3, "training did not change the weights: the comparison would be vacuous"
    for k in final[0]:
        diff = float((final[0][k] - final[1][k]).abs().max())
        assert diff < 1e-5, (k, diff)

    state = [torch.load(dirs[n] / "checkpoints" / f"v{STEPS:06d}" / "trainer_state.pt", weights_only=True)
             for n in ("one", "two")]
    assert state[0]["cursor"] == state[1]["cursor"] == (300, "s3-f-2")
    # Adam's update hardly depends on the gradient's scale; its moments do: they show that the
    # ranks' gradients add up to the full batch's, not to a fraction of it
    moments = [s["optimizer"]["state"] for s in state]
    assert moments[0].keys() == moments[1].keys()
    for i in moments[0]:
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = moments[0][i][key], moments[1][i][key]
            relative = float((a - b).norm() / a.norm().clamp(min=1e-30))
            assert relative < 1e-4, (i, key, relative)
    assert state[0]["version"] == state[1]["version"] == STEPS
    assert sorted(p.name for p in (dirs["two"] / "checkpoints").iterdir()) == ["v000001", "v000002", "v000003"]
    policy = json.loads((dirs["two"] / "policy.json").read_text())
    assert policy["version"] == STEPS and policy["path"] == str((dirs["two"] / "checkpoints" / "v000003").resolve())
