"""Benchmark: a trainer batch from the store to the loss's tensors, without the model.

    .venv/bin/python bench/trainer_batches.py [--transitions 256] [--prompt 1024] [--completion 512]
        [--micro 8] [--rounds 5] [--json]

``--transitions`` transitions (random token ids, a completion mask on every other one, prompt and
completion lengths ±25 % around ``--prompt`` and ``--completion``) are written to a temporary
store's ``transitions`` table; then, ``--rounds`` times after one warm-up, the two halves of what
the trainer does before its forward pass are timed apart:

1. ``next_batch``: choose the batch in DuckDB and read its rows (trainer/batches.py);
2. ``micro_batches``: cut them into ``--micro``-sized micro-batches of padded tensors (collate),
   as rank 0 of one does.

Medians in milliseconds. For a before/after comparison run it against another checkout laid out
as the installed package: ``PYTHONPATH=DIR .venv/bin/python bench/trainer_batches.py`` (the script
reads the batch as ``Batch.table`` where it exists, else as ``Batch.rows``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa

from lightspan import store
from lightspan.trainer.batches import Cursor, micro_batches, next_batch
from lightspan.trainer.config import TrainerConfig

VOCAB = 32_000


def transitions(n: int, prompt: int, completion: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        p, c = (int(rng.integers(int(x * 0.75), int(x * 1.25) + 1)) for x in (prompt, completion))
        rows.append({
            "transition_id": f"t{i:06d}", "rollout_id": f"r{i}", "task_id": f"task{i // 8}", "split": "train",
            "agent_name": "bench", "call_index": 0, "num_calls": 1,
            "prompt_token_ids": rng.integers(0, VOCAB, p).tolist(),
            "completion_token_ids": rng.integers(0, VOCAB, c).tolist(),
            "completion_logprobs": (-rng.random(c) * 5).tolist(),
            "completion_mask": (rng.random(c) < 0.8).astype(int).tolist() if i % 2 else None,
            "model_version": 0, "temperature": 0.7 if i % 3 else None, "reward": float(i % 2),
            "credit": None, "advantage": 1.0 if i % 2 else -1.0, "credit_policy": "identical",
            "advantage_estimator": "grpo", "build_id": "b0", "created_unix_nano": i})
    return pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transitions", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store.write_table(tmp, "transitions", transitions(args.transitions, args.prompt, args.completion))
        cfg = TrainerConfig(model="unused", data_dir=tmp, sync="none", batch_size=args.transitions,
                            max_staleness=10**6)
        times = {"next_batch": [], "micro_batches": []}
        for round_ in range(args.rounds + 1):
            t0 = time.perf_counter()
            batch = next_batch(tmp, cfg, version=0, cursor=Cursor(), vocab_size=VOCAB, max_len=10**6)
            t1 = time.perf_counter()
            data = batch.table if hasattr(batch, "table") else batch.rows
            micro, live = micro_batches(data, rank=0, num_ranks=1, size=args.micro, pad_id=0, device="cpu")
            t2 = time.perf_counter()
            assert live == len(micro) == -(-args.transitions // args.micro)
            if round_:
                times["next_batch"].append((t1 - t0) * 1e3)
                times["micro_batches"].append((t2 - t1) * 1e3)
    result = {"transitions": args.transitions, "prompt": args.prompt, "completion": args.completion,
              "micro": args.micro, "rounds": args.rounds,
              **{f"{k}_ms": round(statistics.median(v), 1) for k, v in times.items()}}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>16}: {value}")
    return result


if __name__ == "__main__":
    main()
