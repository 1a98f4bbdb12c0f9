"""Does ``lightspan train --algo sft`` move SmolLM2-135M-Instruct on hosted-model traces? (issue 35, 2)

A store of calls as a hosted model's traces look (messages, no token ids, each call its own trace, a
person's reward on each): "What is A + B?" answered by a stand-in for the hosted model, which here is
this script writing the right answer in one fixed wording ("The answer is C."), plus a share of
wrong answers rated 0. ``--select "human_reward >= 1"`` trains on the good ones; held-out calls
(``split = 'val'``) are scored before and after. Exact match under teacher forcing (what the summary
reports) is checked against real greedy decoding of the held-out prompts with transformers.

    heavy-slot --slot B .venv/bin/python bench/sft_warm_start.py [--model DIR] [--out bench/sft_warm_start.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import torch

from lightspan import store
from lightspan.models import DEFAULT_SMOLLM2_DIR
from lightspan.store.schema import REWARD_SCOPE
from lightspan.trainer import sft
from lightspan.trainer.config import TrainerConfig

T0 = 1_800_000_000 * 10**9


def span(trace: str, n: int, name: str, at: int, **cols) -> dict:
    row = {f.name: None for f in store.SPAN_SCHEMA}
    row.update(trace_id=trace, span_id=f"{n:016x}", name=name, kind="CLIENT", service_name="calc-bot",
               start_time_unix_nano=T0 + at, end_time_unix_nano=T0 + at + 10, status_code="UNSET",
               received_unix_nano=T0 + at + 10, **cols)
    return row


def hosted_store(data_dir: Path, *, train: int, val: int, wrong: int, seed: int) -> list[tuple[str, str]]:
    """The calls and rewards; returns the held-out (question, answer) pairs."""
    rng = random.Random(seed)
    rows, held_out = [], []
    for i in range(train + val + wrong):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        question = f"What is {a} + {b}?"
        answer = f"The answer is {a + b + (rng.randint(1, 9) if i >= train + val else 0)}."
        split = "val" if train <= i < train + val else "train"
        trace = f"{i:032x}"
        inputs = json.dumps([{"role": "user", "parts": [{"type": "text", "content": question}]}])
        outputs = json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": answer}],
                               "finish_reason": "stop"}])
        rows.append(span(trace, 2 * i + 1, "chat hosted", 100 * i, operation_name="chat", request_model="hosted",
                         input_messages=inputs, output_messages=outputs, split=split))
        rows.append(span(trace, 2 * i + 2, "lightspan.reward", 100 * i + 50, reward=float(i < train + val),
                         reward_name="human", scope_name=REWARD_SCOPE,
                         attributes=[("lightspan.reward.source", json.dumps("human"))]))
        if split == "val":
            held_out.append((question, answer))
    store.write_table(data_dir, "spans", pa.Table.from_pylist(rows, schema=store.SPAN_SCHEMA),
                      partition="date=2026-12-05")
    return held_out


def greedy_exact(model_dir: Path, held_out: list[tuple[str, str]]) -> int:
    """Held-out replies greedy decoding (transformers) reproduces exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hits = 0
    for question, answer in held_out:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=16, do_sample=False)
        hits += tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip() == answer
    return hits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_SMOLLM2_DIR))
    p.add_argument("--train", type=int, default=48)
    p.add_argument("--val", type=int, default=24)
    p.add_argument("--wrong", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--lora-r", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        held_out = hosted_store(data, train=args.train, val=args.val, wrong=args.wrong, seed=0)
        cfg = TrainerConfig(data_dir=str(data), model=args.model, algo="sft", sync="none", select="human_reward >= 1",
                            sft_epochs=args.epochs, learning_rate=args.lr, lora_r=args.lora_r, batch_size=8,
                            micro_batch_size=8, torch_threads=args.threads, metrics_port=0)
        t0, cpu0 = time.monotonic(), time.process_time()
        summary = sft.run(cfg)
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        before = greedy_exact(Path(args.model), held_out)
        checkpoint = data / "checkpoints" / f"v{summary['train/sft/policy_version']:06d}"
        after = greedy_exact(checkpoint / "merged" if (checkpoint / "merged").is_dir() else checkpoint, held_out) \
            if not args.lora_r else None
    result = {"config": vars(args), "summary": summary, "run_wall_s": wall, "run_cpu_s": cpu,
              "greedy_exact_before": before / len(held_out),
              "greedy_exact_after": None if after is None else after / len(held_out)}
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    logging.getLogger("bench").info("%s", text)


if __name__ == "__main__":
    main()
