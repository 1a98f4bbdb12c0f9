"""Benchmark: two policies against one on the same data — step and sync time per policy, and vLLM's
throughput serving two adapters against one.

    .venv/bin/python bench/policies.py [--model smollm2|tiny] [--rounds 5] [--lora-r 16] [--json]

1. ONE real vLLM (``lightspan.inference``, ``--enable-lora --max-lora-rank R``, runtime adapter
   loading, ``--max-loras 7``: the three adapters below, stable and versioned names, + 1) serves the
   base as ``policy-base`` and the adapters ``one``, ``writer`` and ``checker``.
2. Training, interleaved round by round after one warm-up round: the single policy (a ``Trainer``
   with LoRA r R on q/k/v/o, served as ``one``, its own data directory) takes one step on a batch of
   synthetic transitions, then the two policies (``PolicyTrainers``, ``writer`` and ``checker``, the
   same r, one shared base, their own data directory) take one step each on a batch of the same
   shape. Each step is timed as the trainer runs it (``next_batch`` → ``Trainer.step`` →
   ``Trainer.publish(Trainer.save(...))``): the step (wall and this process's CPU seconds) and the
   sync (``sync_seconds``: the adapter's load under ``<name>-v<N>`` and ``<name>``, the unload of the
   old version); the verification is timed apart. Reported: medians, and each policy's median over
   the single policy's (goal ≤ 1.1).
3. Serving, interleaved: ``--requests`` completions at once (``--prompt`` prompt tokens,
   ``--tokens`` sampled tokens each, ``ignore_eos``) to one adapter (``writer``), to two (half
   ``writer``, half ``checker``) and to the base; completion tokens per second of wall time, medians
   over ``--rounds``, and two adapters over one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
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
from lightspan.runs import free_ports
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.loop import Trainer
from lightspan.trainer.policies import PolicyTrainers

SMOLLM2_DIR = Path.home() / ".cache" / "lightspan" / "models" / "smollm2-135m-instruct"
# sequences, prompt tokens, completion tokens, micro-batch
SHAPES = {"tiny": (16, 96, 64, 8), "smollm2": (4, 48, 32, 2)}
log = logging.getLogger("bench.policies")


def model_dir(name: str, tmp: Path) -> Path:
    if name == "tiny":
        from lightspan.models import build_tiny_model

        return build_tiny_model(tmp / "tiny")
    from lightspan.models import prepare_smollm2

    return prepare_smollm2(SMOLLM2_DIR)


def write_batch(data_dir: Path, policy: str | None, version: int, created: int, shape, vocab: int, seed: int) -> None:
    n, prompt, completion, _ = shape
    rng = random.Random(seed)
    rows = [{"transition_id": f"{policy}-{created}-{i}", "rollout_id": f"r-{created}-{i}", "task_id": f"t{i // 2}",
             "prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt)],
             "completion_token_ids": [rng.randrange(vocab) for _ in range(completion)],
             "completion_logprobs": [-8.0] * completion, "model_version": version, "reward": float(i % 2),
             "advantage": 1.0 if i % 2 else -1.0, "created_unix_nano": created, "policy": policy}
            for i in range(n)]
    store.write_table(data_dir, "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))


def timed_step(trainer: Trainer) -> dict:
    """What ``train_once`` does on one process, with the step's CPU time and the verification apart."""
    batch = trainer.next_batch()
    assert batch is not None, "no batch: the data was not written"
    cpu = time.process_time()
    metrics = trainer.step(batch)
    cpu = time.process_time() - cpu
    t0 = time.monotonic()
    row = trainer.publish(trainer.save(trainer.version), metrics)
    return {"step": row["step_seconds"], "step_cpu": cpu, "sync": row["sync_seconds"],
            "publish": time.monotonic() - t0, "diff": row["sync_max_abs_logprob_diff"]}


def train(args, model: Path, url: str, tmp: Path, vocab: int) -> dict:
    shape = SHAPES[args.model]
    common = dict(model=str(model), vllm_url=url, sync="lora", lora_r=args.lora_r, lora_alpha=2.0 * args.lora_r,
                  learning_rate=1e-4, micro_batch_size=shape[3], batch_size=shape[0], torch_threads=args.threads,
                  metrics_port=0)
    single = Trainer(TrainerConfig(data_dir=str(tmp / "one"), served_model_name="one", **common))
    policies = tmp / "policies.toml"
    policies.write_text('[[policies]]\nname = "writer"\nagents = ["writer"]\n'
                        '[[policies]]\nname = "checker"\nagents = ["checker"]\n')
    pair = PolicyTrainers(TrainerConfig(data_dir=str(tmp / "two"), policies=str(policies), **common))
    single.load_or_init()
    single.start()
    pair.load_or_init()
    pair.start()
    times: dict[str, list[dict]] = {"one": [], "writer": [], "checker": []}
    for r in range(args.rounds + 1):                       # round 0 warms up
        created = r + 1
        write_batch(single.data_dir, None, single.version, created, shape, vocab, seed=r)
        out = {"one": timed_step(single)}
        for t in pair.trainers:
            write_batch(pair.data_dir, t.policy, t.version, created, shape, vocab, seed=r)
        for t in pair.trainers:
            out[t.policy] = timed_step(t)
        log.info("round %d: %s", r, {k: f"step {v['step']:.3f} s (cpu {v['step_cpu']:.3f}), sync {v['sync']:.3f} s"
                                      for k, v in out.items()})
        if r:
            for k, v in out.items():
                times[k].append(v)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("step", "step_cpu", "sync", "publish")}
           for k, v in times.items()}
    worst = max(x["diff"] for v in times.values() for x in v)
    ratios = {k: {m: med[k][m] / med["one"][m] for m in ("step", "step_cpu", "sync")} for k in ("writer", "checker")}
    return {"median": med, "ratio_to_one": ratios, "max_abs_logprob_diff": worst, "shape": shape}


def throughput(url: str, model: str | list[str], args, seed: int) -> float:
    """Completion tokens per second of ``args.requests`` requests at once, spread over ``model``'s names."""
    names = model if isinstance(model, list) else [model]
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 250) for _ in range(args.prompt)] for _ in range(args.requests)]

    def one(i):
        response = requests.post(f"{url}/v1/completions", timeout=600, json={
            "model": names[i % len(names)], "prompt": prompts[i], "max_tokens": args.tokens, "temperature": 1.0,
            "ignore_eos": True, "seed": seed + i})
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    t0 = time.monotonic()
    with ThreadPoolExecutor(args.requests) as pool:
        tokens = sum(pool.map(one, range(args.requests)))
    return tokens / (time.monotonic() - t0)


def serve(args, url: str) -> dict:
    kinds = {"one adapter": "writer", "two adapters": ["writer", "checker"], "base": "policy-base"}
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds + 1):
        for kind, model in kinds.items():
            rate = throughput(url, model, args, seed=1000 * r)
            if r:
                rates[kind].append(rate)
        log.info("serving round %d: %s", r, {k: f"{v[-1]:.1f} tok/s" for k, v in rates.items() if v})
    med = {k: statistics.median(v) for k, v in rates.items()}
    pairs = [b / a for a, b in zip(rates["one adapter"], rates["two adapters"])]
    return {"median_tokens_per_second": med, "two_over_one_median": statistics.median(pairs), "rounds": rates}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-policies-"))
    model = model_dir(args.model, tmp)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    served = tmp / "served.toml"          # what vLLM makes room for: the three adapters
    served.write_text("".join(f'[[policies]]\nname = "{n}"\nagents = ["{n}"]\n' for n in ("one", "writer", "checker")))
    cfg = inference.VLLMConfig(model=str(model), port=free_ports(1)[0], max_model_len=512, lora_rank=args.lora_r,
                               policies=str(served))
    log_path = tmp / "vllm.log"
    proc = inference.start(cfg, log_path)
    try:
        started = inference.wait_healthy(cfg.url, proc, cfg.startup_timeout_s, log_path)
        log.info("vLLM healthy after %.0f s (load average %.1f)", started, os.getloadavg()[0])
        result = {"model": args.model, "lora_r": args.lora_r, "load_average_start": os.getloadavg()[0],
                  "train": train(args, model, cfg.url, tmp, vocab)}
        result["serve"] = serve(args, cfg.url)
        result["load_average_end"] = os.getloadavg()[0]
    finally:
        inference.stop(proc)
    t, s = result["train"], result["serve"]
    out = sys.stdout
    out.write(f"\nmodel {args.model}, LoRA r {args.lora_r}, batch {t['shape']}, {args.rounds} rounds, "
              f"load average {result['load_average_start']:.1f} -> {result['load_average_end']:.1f}\n")
    out.write("policy   step s (cpu s)      sync s   step/one (cpu)   sync/one\n")
    for name, m in t["median"].items():
        r = t["ratio_to_one"].get(name)
        ratio = f"{r['step']:.2f} ({r['step_cpu']:.2f})      {r['sync']:.2f}" if r else "-"
        out.write(f"{name:8} {m['step']:.3f} ({m['step_cpu']:.3f})    {m['sync']:.3f}    {ratio}\n")
    out.write(f"max |logprob(vLLM) - logprob(trainer)| after a sync: {t['max_abs_logprob_diff']:.2e}\n")
    rates = ", ".join(f"{k} {v:.1f}" for k, v in s["median_tokens_per_second"].items())
    out.write(f"serving (tokens/s, median): {rates}; two adapters / one: {s['two_over_one_median']:.2f}\n")
    if args.json:
        out.write(json.dumps(result, default=str) + "\n")
    return 0 if t["max_abs_logprob_diff"] < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
