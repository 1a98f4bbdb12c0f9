"""The trainer's tokens per second on long rollouts' rows against short ones' (issue 31).

Each store (a data directory a run left, e.g. ``lightspan experiment --data-dir D``) is built
``per_rollout`` in a scratch copy (as bench/long_horizon.py builds it), and ``--steps`` GRPO steps of
``trainer.step.optimise`` run on its rows, ``--rows`` rows a step (the first rows, cycling), with the
settings the examples train with (SmolLM2-135M-Instruct, LoRA r 16, lr 3e-4, micro-batches sized by
the trainer's own token budget). What is measured is the step's cost, not learning: every row's
advantage is set to +1 or -1 (alternating by rollout), since a store's real advantages may all be 0
(examples/coding's seed 0 never solved a task) and the advantage's value does not change the work.

Per store, medians over the steps after the first (a warm-up), in one process, stores taking turns:
trained (completion-mask) tokens per second and all tokens (prompt + completion) per second, by the
step's own clock (``tokens_per_second``, as train_steps records it) and by the process's CPU time;
the rows' mean length; micro-batches a step. The ratio is each store's against the first one's.

    .venv/bin/python bench/trainer_throughput.py demo=DATA_DIR coding=DATA_DIR [--rows 16] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds

sys.path.insert(0, str(Path(__file__).resolve().parent))
import long_horizon  # noqa: E402  (the same scratch build)

MODEL_DIR = Path.home() / ".cache" / "lightspan" / "models" / "smollm2-135m-instruct"


def built_rows(data_dir: Path, work: Path) -> pa.Table:
    """``data_dir``'s per_rollout transitions, built in a scratch copy, with advantages of +-1."""
    long_horizon.build_once(data_dir, work)
    table = ds.dataset(str(work / "transitions"), format="parquet").to_table()
    if not table.num_rows:
        raise SystemExit(f"{data_dir}: the build wrote no transitions")
    rollouts = {r: k for k, r in enumerate(dict.fromkeys(table.column("rollout_id").to_pylist()))}
    signs = [1.0 if rollouts[r] % 2 else -1.0 for r in table.column("rollout_id").to_pylist()]
    return table.set_column(table.schema.get_field_index("advantage"), "advantage", pa.array(signs, pa.float64()))


def step_rows(table: pa.Table, k: int, n: int) -> pa.Table:
    """Step ``k``'s ``n`` rows: the table's rows from ``k * n``, cycling."""
    idx = [(k * n + i) % table.num_rows for i in range(n)]
    return table.take(pa.array(idx))


def lengths(table: pa.Table) -> tuple[int, int]:
    """(completion-mask tokens, prompt + completion tokens) of ``table``'s rows."""
    trained = sum(sum(m) for m in table.column("completion_mask").to_pylist())
    total = sum(len(p) + len(c) for p, c in zip(table.column("prompt_token_ids").to_pylist(),
                                                table.column("completion_token_ids").to_pylist()))
    return trained, total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stores", nargs="+", metavar="NAME=DATA_DIR")
    ap.add_argument("--rows", type=int, default=16, help="rows a step (the examples' 4 tasks x 8 samples "
                                                         "is 32 rollouts; fewer keeps a step short)")
    ap.add_argument("--steps", type=int, default=4, help="steps a store; the first is a warm-up")
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first is a warm-up)")

    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from lightspan.trainer.batches import Batch, Cursor
    from lightspan.trainer.config import TrainerConfig
    from lightspan.trainer.lora import trainable_parameters, with_lora
    from lightspan.trainer.step import optimise

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    with tempfile.TemporaryDirectory(prefix="trainer-throughput-") as tmp:
        cfg = TrainerConfig(model=str(args.model), data_dir=tmp, lora_r=16, learning_rate=3e-4, sync="none")
        stores = {}
        for k, spec in enumerate(args.stores):
            name, _, path = spec.partition("=")
            stores[name] = built_rows(Path(path), Path(tmp) / f"build{k}")
        arms = {}
        for name in stores:      # a model and optimizer per store, so one store's steps do not warm another's state
            model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
            model = with_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                              targets=cfg.lora_target_modules, seed=cfg.seed)
            optimizer = torch.optim.AdamW(trainable_parameters(model), lr=cfg.learning_rate)
            arms[name] = accelerator.prepare(model, optimizer)
        samples = {name: [] for name in stores}
        for step in range(args.steps):
            for name, table in stores.items():            # stores take turns
                rows = step_rows(table, step, args.rows)
                model, optimizer = arms[name]
                c0 = time.process_time()
                m = optimise(accelerator, model, optimizer, Batch(table=rows, cursor=Cursor()), cfg,
                             pad_id=int(model.config.pad_token_id or 0))
                cpu = time.process_time() - c0
                trained, total = lengths(rows)
                if step:
                    samples[name].append({"wall_s": m["step_seconds"], "cpu_s": cpu, "trained": trained,
                                          "total": total, "micro_batches": m["micro_batches"],
                                          "budget": m["micro_batch_tokens"]})
    out = []
    for name, steps in samples.items():
        med = lambda f: statistics.median(f(s) for s in steps)  # noqa: E731
        out.append({"store": name, "rows": args.rows, "tokens_per_row": med(lambda s: s["total"]) / args.rows,
                    "trained_tokens_per_row": med(lambda s: s["trained"]) / args.rows,
                    "trained_per_s": med(lambda s: s["trained"] / s["wall_s"]),
                    "total_per_s": med(lambda s: s["total"] / s["wall_s"]),
                    "total_per_cpu_s": med(lambda s: s["total"] / s["cpu_s"]),
                    "micro_batches": med(lambda s: s["micro_batches"]), "budget": steps[-1]["budget"],
                    "steps": steps})
    base = out[0]
    load = os.getloadavg()[0]
    print("| store | tokens / row (trained) | micro-batches | trained tok/s | all tok/s | all tok/CPU-s | "
          f"all tok/CPU-s vs {base['store']} |")
    print("|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['store']} | {r['tokens_per_row']:.0f} ({r['trained_tokens_per_row']:.0f}) | "
              f"{r['micro_batches']:.0f} | {r['trained_per_s']:.0f} | {r['total_per_s']:.0f} | "
              f"{r['total_per_cpu_s']:.0f} | {r['total_per_cpu_s'] / base['total_per_cpu_s']:.2f}x |")
    print(f"{args.rows} rows a step, medians of {args.steps - 1} steps after a warm-up; load (1 min) at the end "
          f"{load:.1f}; micro-batch token budget {base['budget']}")
    if args.json:
        args.json.write_text(json.dumps({"rows": out, "load_1m": load, "argv": sys.argv[1:]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
