"""The trainer's CPU per step with shared prompt prefixes run once (trainer/prefix.py) against every
row's whole prompt, on the batches a real run trained on.

For each store (the data directory a ``lightspan experiment`` left), the transitions of its first
``--steps`` builds (one Parquet part per step, in the order written; the rows with a nonzero
advantage, as the trainer takes them) are trained by two arms side by side, in one process, taking
turns batch by batch: ``plain`` (``shared_prefix_tokens`` 0) and ``shared`` (the default, 32). Each
arm has its own SmolLM2-135M-Instruct with LoRA r 16 and its own AdamW (lr 3e-4), the settings the
examples train with, one torch thread (as ``lightspan experiment``'s trainer on 2 cores), and the
same token budget a pass (``--micro-batch-tokens``, which the shared
arm counts with each prefix once). Measured per step: the process's CPU
seconds of ``trainer.step.optimise``, its micro-batches, and the step's loss (the two arms' losses
agree to float rounding on the first batch; later batches drift apart with the weights).

    .venv/bin/python bench/shared_prefix.py gsm8k=DATA_DIR [sandbox=DATA_DIR ...] [--steps 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

MODEL_DIR = Path.home() / ".cache" / "lightspan" / "models" / "smollm2-135m-instruct"
ARMS = {"plain": 0, "shared": 32}


def step_batches(data_dir: Path, steps: int) -> list:
    """The nonzero-advantage training rows of the store's first ``steps`` transition parts."""
    parts = sorted((data_dir / "transitions").rglob("*.parquet"), key=lambda p: p.stat().st_mtime)
    batches = []
    for part in parts:
        table = pq.read_table(part)
        table = table.filter(pc.not_equal(pc.fill_null(table.column("advantage"), 0.0), 0.0))
        if "split" in table.column_names:
            table = table.filter(pc.equal(pc.fill_null(table.column("split"), "train"), "train"))
        if table.num_rows:
            batches.append(table)
        if len(batches) == steps:
            break
    if not batches:
        raise SystemExit(f"{data_dir}: no transitions with a nonzero advantage")
    return batches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stores", nargs="+", metavar="NAME=DATA_DIR")
    ap.add_argument("--steps", type=int, default=3, help="batches a store (its first builds)")
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384,
                    help="both arms' token budget a pass (fixed: the budget derived from the machine's free "
                         "memory moves with the other work on it); 0 derives it as the trainer does")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (the trainer lightspan experiment starts on 2 cores has 1; more threads "
                         "on a loaded machine spin in OpenMP and their CPU seconds measure the load, not the step)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from lightspan.trainer.batches import Batch, Cursor
    from lightspan.trainer.config import TrainerConfig
    from lightspan.trainer.lora import trainable_parameters, with_lora
    from lightspan.trainer.step import optimise

    torch.set_num_threads(args.threads)
    accelerator = Accelerator(cpu=True)
    out = []
    for spec in args.stores:
        name, _, path = spec.partition("=")
        batches = step_batches(Path(path), args.steps)
        arms = {}
        for arm, shared in ARMS.items():
            torch.manual_seed(0)
            cfg = TrainerConfig(model=str(args.model), data_dir=path, lora_r=16, learning_rate=3e-4, sync="none",
                                shared_prefix_tokens=shared, micro_batch_tokens=args.micro_batch_tokens)
            model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
            model = with_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                              targets=cfg.lora_target_modules, seed=cfg.seed)
            optimizer = torch.optim.AdamW(trainable_parameters(model), lr=cfg.learning_rate)
            arms[arm] = (cfg, *accelerator.prepare(model, optimizer))
        rows = {arm: [] for arm in ARMS}
        for k, table in enumerate(batches):
            for arm in (ARMS if k % 2 == 0 else reversed(list(ARMS))):     # each arm first in turn
                cfg, model, optimizer = arms[arm]
                c0 = time.process_time()
                m = optimise(accelerator, model, optimizer, Batch(table=table, cursor=Cursor()), cfg,
                             pad_id=int(model.config.pad_token_id or 0))
                rows[arm].append({"cpu_s": time.process_time() - c0, "micro_batches": m["micro_batches"],
                                  "loss": m["loss"], "rows": table.num_rows,
                                  "tokens": sum(map(len, table.column("prompt_token_ids").to_pylist()))
                                  + sum(map(len, table.column("completion_token_ids").to_pylist()))})
                print(f"{name} batch {k} {arm}: {rows[arm][-1]}", file=sys.stderr, flush=True)
        ratios = [p["cpu_s"] / s["cpu_s"] for p, s in zip(rows["plain"], rows["shared"])]
        out.append({"store": name, "batches": len(batches), "rows": [r["rows"] for r in rows["plain"]],
                    "tokens": [r["tokens"] for r in rows["plain"]],
                    "plain_cpu_s": [round(r["cpu_s"], 1) for r in rows["plain"]],
                    "shared_cpu_s": [round(r["cpu_s"], 1) for r in rows["shared"]],
                    "micro_batches": {arm: [r["micro_batches"] for r in rows[arm]] for arm in ARMS},
                    "first_loss": {arm: rows[arm][0]["loss"] for arm in ARMS},
                    "speedup_median": statistics.median(ratios), "speedups": [round(r, 2) for r in ratios]})
    load = os.getloadavg()[0]
    print("| store | batches (rows) | trainer CPU-s a step, plain | shared prefix | speed-up, median [range] |")
    print("|---|---|---|---|---|")
    for r in out:
        print(f"| {r['store']} | {r['batches']} ({', '.join(map(str, r['rows']))}) | "
              f"{statistics.median(r['plain_cpu_s']):.1f} | {statistics.median(r['shared_cpu_s']):.1f} | "
              f"{r['speedup_median']:.2f}x [{min(r['speedups']):.2f}, {max(r['speedups']):.2f}] |")
    print(f"load (1 min) at the end {load:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"stores": out, "load_1m": load, "argv": sys.argv[1:]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
