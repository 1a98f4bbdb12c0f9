"""Benchmark: serving a LoRA adapter as an adapter (vLLM --enable-lora) or merged into the base
(lightspan train --sync reload with --lora-r), side by side: vLLM's CPU per batch of rollouts, and
the sync's time.

    .venv/bin/python bench/lora_serving.py [--rounds 4] [--requests 32] [--tokens 24] [--lora-r 16]

Two real vLLM servers (``lightspan.inference``, SmolLM2-135M-Instruct as ``lightspan model
smollm2`` makes it, 2 OpenMP threads each) run at once:

- **adapter**: ``--enable-lora``; the adapter is loaded with ``/v1/load_lora_adapter``
  (``LoraSync``) and requests name it;
- **merged**: no LoRA; the base with the same adapter merged (``trainer/lora.py``'s
  ``save_merged``) is reloaded in place (``ReloadSync``).

The adapter is a real one: a ``Trainer`` with LoRA r ``--lora-r`` on q/k/v/o takes one step on
synthetic transitions, so B is not zero. Both servers are checked to serve the same logprobs.
Then, round by round, the same batch goes to one server and then the other: ``--requests`` chat
requests at once (the demo's additions in its agent's wording, ``--tokens`` new tokens,
temperature 0.7, logprobs and token ids, as the demo's rollouts ask), and each server's CPU
seconds (its process tree, ``lightspan.runs.tree_cpu_seconds``) and wall time per batch are
recorded. Last, each sync is timed ``--rounds`` times: the adapter's save + load, against the
merged weights' save + reload. Printed: medians and the ratio merged / adapter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import requests
import torch

from lightspan import inference, store
from lightspan.models import DEFAULT_SMOLLM2_DIR, prepare_smollm2
from lightspan.runs import free_ports, tree_cpu_seconds
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.loop import Trainer
from lightspan.trainer.lora import save_merged
from lightspan.trainer.sync import LoraSync, ReloadSync, prompt_logprobs
from vllm_servers import medians, servers


def trained_adapter(model_dir: Path, work: Path, r: int) -> Trainer:
    """A Trainer whose LoRA adapter took one step (B != 0) on synthetic transitions."""
    cfg = TrainerConfig(model=str(model_dir), data_dir=str(work / "data"), sync="none", lora_r=r,
                        lora_alpha=2.0 * r, learning_rate=1e-2, torch_threads=1, metrics_port=0)
    rows = [{"transition_id": f"t{i}", "rollout_id": f"r{i}", "task_id": "t", "split": "train",
             "prompt_token_ids": list(range(20, 40)), "completion_token_ids": [50 + i, 60 + i, 70 + i],
             "completion_logprobs": [-3.0] * 3, "model_version": 0, "reward": float(i % 2),
             "advantage": 1.0 if i % 2 else -1.0, "created_unix_nano": 1} for i in range(8)]
    store.write_table(cfg.data_dir, "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))
    trainer = Trainer(cfg)
    trainer.load_or_init()
    trainer.train_once()
    return trainer


def batch(url: str, model: str, n: int, tokens: int, pool: ThreadPoolExecutor) -> int:
    def call(i: int) -> int:
        r = requests.post(f"{url}/v1/chat/completions", timeout=600, json={
            "model": model, "max_tokens": tokens, "temperature": 0.7, "logprobs": True, "return_token_ids": True,
            "messages": [{"role": "user", "content": f"What is {11 + i} + {38 + 2 * i}? End your reply with "
                                                     "'Answer: <number>'."}]})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    return sum(pool.map(call, range(n)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--lora-r", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    prepare_smollm2(DEFAULT_SMOLLM2_DIR)
    work = Path(tempfile.mkdtemp(prefix="lora-serving-"))
    trainer = trained_adapter(DEFAULT_SMOLLM2_DIR, work, args.lora_r)
    model = trainer.accelerator.unwrap_model(trainer.model)
    adapter_dir = trainer.checkpoints()[-1][1]       # its step saved version 1
    adapter_port, merged_port = free_ports(2)
    cfgs = {"adapter": inference.VLLMConfig(model=str(DEFAULT_SMOLLM2_DIR), port=adapter_port, lora_rank=args.lora_r),
            "merged": inference.VLLMConfig(model=str(DEFAULT_SMOLLM2_DIR), port=merged_port)}
    with servers(cfgs, work) as procs:
        adapter_url, merged_url = cfgs["adapter"].url, cfgs["merged"].url
        LoraSync(adapter_url, "policy").push(adapter_dir, 1)
        ReloadSync(merged_url).push(save_merged(model, "default", work / "merged-1", DEFAULT_SMOLLM2_DIR), 1)
        ids = list(range(30, 62))
        diff = max(abs(a - b) for a, b in zip(prompt_logprobs(adapter_url, "policy", ids),
                                              prompt_logprobs(merged_url, "policy", ids)))
        rows = {"adapter": [], "merged": []}
        with ThreadPoolExecutor(args.requests) as pool:
            for side, cfg in cfgs.items():          # warm-up
                batch(cfg.url, "policy", args.requests, args.tokens, pool)
            for _ in range(args.rounds):
                for side, cfg in cfgs.items():
                    c0, t0 = tree_cpu_seconds(procs[side].pid), time.monotonic()
                    n = batch(cfg.url, "policy", args.requests, args.tokens, pool)
                    rows[side].append({"cpu_s": tree_cpu_seconds(procs[side].pid) - c0,
                                       "wall_s": time.monotonic() - t0, "tokens": n})
        syncs = {"adapter": [], "merged": []}
        for version in range(2, 2 + args.rounds):
            t0 = time.monotonic()
            LoraSync(adapter_url, "policy").push(trainer.save(version), version)
            syncs["adapter"].append(time.monotonic() - t0)
            t0 = time.monotonic()
            ReloadSync(merged_url).push(save_merged(model, "default", work / f"merged-{version}",
                                                    DEFAULT_SMOLLM2_DIR), version)
            syncs["merged"].append(time.monotonic() - t0)
    med = medians(rows)
    for side in rows:
        print(f"{side:>8}: vLLM CPU {med[side]['cpu_s']:.1f} s, wall {med[side]['wall_s']:.1f} s per batch of "
              f"{args.requests} ({med[side]['tokens']:.0f} tokens); sync {statistics.median(syncs[side]):.2f} s "
              f"(median of {args.rounds})")
    print(f"merged / adapter: CPU {med['merged']['cpu_s'] / med['adapter']['cpu_s']:.2f}x, wall "
          f"{med['merged']['wall_s'] / med['adapter']['wall_s']:.2f}x; served logprobs differ by at most {diff:.1e}")
    print(json.dumps({"rows": rows, "syncs": syncs, "max_logprob_diff": diff, "argv": sys.argv[1:]}))


if __name__ == "__main__":
    main()
