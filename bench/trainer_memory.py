"""Benchmark: peak memory of one trainer step on long transitions, by micro-batch token budget.

    heavy-slot nice .venv/bin/python bench/trainer_memory.py [--model DIR] [--rows 8] [--prompt 200]
        [--completion 400] [--budgets none,2400,1200,auto] [--max-memory-gb 6] [--threads 2] [--json]

Each setting runs in a fresh child process (``--one``): the model (float32, CPU) is loaded, one
``Trainer.step`` (trainer/loop.py: collate, token logprobs, loss, backward, clip, fused AdamW) runs
on ``--rows`` synthetic transitions of ``--prompt`` + ``--completion`` random token ids, and the
child reports its peak resident set (``ru_maxrss``) before and after the step, the step's CPU
seconds and its micro-batches. Budget ``none`` is the trainer as it was before token budgets: rows
only, ``micro_batch_size`` (= ``--rows``) per micro-batch, so all rows in one pass; ``auto`` is the
budget trainer/memory.py derives from ``--max-memory-gb`` (micro_batch_tokens 0).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache/lightspan/models/smollm2-135m-instruct"


def one(model: str, rows: int, prompt: int, completion: int, budget: str, threads: int, max_memory_gb: float) -> dict:
    import tempfile

    import pyarrow as pa
    import torch

    from lightspan.trainer.batches import Batch, Cursor
    from lightspan.trainer.config import TrainerConfig
    from lightspan.trainer.loop import Trainer

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        tokens = {"none": 10**9, "auto": 0}.get(budget) if budget in ("none", "auto") else int(budget)
        cfg = TrainerConfig(data_dir=tmp, model=model, sync="none", micro_batch_tokens=tokens,
                            max_memory_gb=max_memory_gb, micro_batch_size=rows, verify_sync=False, metrics_port=0)
        trainer = Trainer(cfg)
        trainer.load_or_init()
        vocab = trainer.accelerator.unwrap_model(trainer.model).config.vocab_size
        g = torch.Generator().manual_seed(0)
        table = pa.Table.from_pylist([{
            "transition_id": f"t{i}", "rollout_id": f"r{i}", "task_id": "a",
            "prompt_token_ids": torch.randint(1, vocab, (prompt,), generator=g).tolist(),
            "completion_token_ids": torch.randint(1, vocab, (completion,), generator=g).tolist(),
            "completion_logprobs": [-10.0] * completion, "completion_mask": None,
            "advantage": 1.0 if i % 2 else -1.0, "temperature": 1.0, "reward": 0.0,
            "model_version": 0, "created_unix_nano": i} for i in range(rows)])
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
        cpu0, t0 = time.process_time(), time.monotonic()
        metrics = trainer.step(Batch(table=table, cursor=Cursor()))
        cpu = time.process_time() - cpu0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    return {"budget": budget, "max_memory_gb": max_memory_gb, "rows": rows, "prompt": prompt, "completion": completion,
            "rss_before_gb": before / 2**30, "peak_rss_gb": peak / 2**30, "step_peak_gb": (peak - before) / 2**30,
            "cpu_s": cpu, "wall_s": time.monotonic() - t0, "micro_batches": metrics.get("micro_batches"),
            "micro_batch_tokens": metrics.get("micro_batch_tokens")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--completion", type=int, default=400)
    ap.add_argument("--budgets", default="none,2400,1200,auto")
    ap.add_argument("--max-memory-gb", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.model, args.rows, args.prompt, args.completion, args.one, args.threads,
                             args.max_memory_gb)))
        return
    results = []
    for budget in args.budgets.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", budget, "--model", args.model,
                              "--max-memory-gb", str(args.max_memory_gb),
                              "--rows", str(args.rows), "--prompt", str(args.prompt),
                              "--completion", str(args.completion), "--threads", str(args.threads)],
                             capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if out.returncode:
            results.append({"budget": budget, "error": out.stderr[-2000:]})
        else:
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = results[-1]
        if "error" in r:
            print(f"budget {budget}: failed\n{r['error']}", file=sys.stderr)
        else:
            print(f"budget {budget:>6} ({r['micro_batch_tokens']} tokens): {r['micro_batches']} micro-batches, "
                  f"peak RSS {r['peak_rss_gb']:.2f} GB "
                  f"(+{r['step_peak_gb']:.2f} GB in the step), CPU {r['cpu_s']:.1f} s", flush=True)
    print(f"load: {os.getloadavg()}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
