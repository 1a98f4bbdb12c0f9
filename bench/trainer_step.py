"""Benchmark: one trainer step against raw forward+backward and against TRL's GRPOTrainer.

    .venv/bin/python bench/trainer_step.py [--models tiny,smollm2] [--rounds 5] [--threads 2] [--json]

The same batch of synthetic transitions (random token ids, equal prompt and completion lengths,
advantages alternating +1 / -1, behaviour logprobs near a uniform policy's) goes through three
optimizer steps, each on its own copy of the same initial weights (float32, CPU) and its own
torch AdamW (lr 1e-6; the fused kernel for all three, as the trainer uses it: TRL's
``optim="adamw_torch_fused"``), with the same micro-batches (gradient accumulation):

1. lightspan: ``Trainer.step`` (trainer/loop.py), loss ``dapo``, truncated IS against the
   behaviour logprobs on: collate from the rows, token logprobs and entropy, the clipped loss,
   backward, metrics, gradient clipping, AdamW. Timed from the rows in the store's form (the
   Arrow table next_batch reads).
2. raw: the floor any trainer pays on this batch. The micro-batches are collated before the
   clock starts; per micro-batch one forward (the same ``logits_to_keep`` and position ids),
   log-softmax gathered at the completion tokens, ``-(A log p)`` summed over the mask, divided
   by the batch's token count, backward; then AdamW. Reported as (a) forward+backward alone and
   (b) forward+backward+AdamW; the target (≤ 1.15×) is read against (a), the strict one.
3. TRL: ``GRPOTrainer._compute_loss`` — TRL's own loss path (``_get_per_token_logps_and_entropies``,
   the clipped surrogate, ``dapo`` normalisation by ``num_items_in_batch``) — on inputs shaped
   as its ``_generate_and_score_completions`` returns them (prompt ids left-padded, completion
   ids right-padded, masks, advantages, ``num_items_in_batch``) and built before the clock
   starts, then ``accelerator.backward``, the trainer's gradient clipping (max_grad_norm 1.0) and
   AdamW. What is left out is generation, reward scoring and the HF Trainer's logging and
   callbacks: TRL generates its own completions, so only the part that trains on given
   sequences is compared (GRPOTrainer.training_step itself would call ``_prepare_inputs``,
   which generates). TRL here runs without vLLM, so it does no IS correction: lightspan does
   strictly more work per token. TRL's default activation checkpointing is turned off (lightspan
   does not recompute activations either).

The three run interleaved, ``--rounds`` times after one warm-up each, in one process with
``--threads`` torch threads; medians are compared. Prints a table and (``--json``) one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import torch

from lightspan import store
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.batches import Batch, Cursor, collate
from lightspan.trainer.loop import Trainer

SMOLLM2_DIR = Path.home() / ".cache" / "lightspan" / "models" / "smollm2-135m-instruct"
# sequences, prompt tokens, completion tokens, micro-batch
SHAPES = {"tiny": (16, 96, 64, 8), "smollm2": (8, 64, 64, 4)}
LR = 1e-6


def model_dir(name: str, tmp: Path) -> Path:
    if name == "tiny":
        from lightspan.models import build_tiny_model

        return build_tiny_model(tmp / "tiny")
    from lightspan.models import prepare_smollm2

    return prepare_smollm2(SMOLLM2_DIR)


def rows_for(n: int, prompt_len: int, completion_len: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(0, vocab, (prompt_len + completion_len,), generator=g).tolist()
        rows.append({"transition_id": f"t{i}", "rollout_id": f"r{i}", "task_id": f"task{i // 4}",
                     "prompt_token_ids": ids[:prompt_len], "completion_token_ids": ids[prompt_len:],
                     "completion_logprobs": [-math.log(vocab)] * completion_len, "completion_mask": None,
                     "advantage": 1.0 if i % 2 == 0 else -1.0, "temperature": 1.0, "reward": float(i % 2 == 0),
                     "model_version": 0, "created_unix_nano": i})
    return rows


class Lightspan:
    name = "lightspan Trainer.step"

    def __init__(self, path: Path, tmp: Path, rows: list[dict], micro: int):
        fields = TrainerConfig.__dataclass_fields__
        extra = {"metrics_port": 0} if "metrics_port" in fields else {}
        cfg = TrainerConfig(model=str(path), data_dir=str(tmp / "data"), sync="none", loss_type="dapo",
                            micro_batch_size=micro, batch_size=len(rows), learning_rate=LR, **extra)
        self.trainer = Trainer(cfg)
        self.trainer.load_or_init()
        self.table = pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA)   # as next_batch reads it

    def step(self) -> None:
        self.trainer.step(Batch(table=self.table, cursor=Cursor(0, "t"), reward_mean=0.5))


class Raw:
    def __init__(self, model, rows: list[dict], micro: int, optimizer_step: bool):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
        self.micro = [collate(rows[i:i + micro], 0) for i in range(0, len(rows), micro)]
        self.tokens = sum(float(mb.completion_mask.sum()) for mb in self.micro)
        self.optimizer_step = optimizer_step
        self.name = "raw forward+backward" + (" + AdamW" if optimizer_step else "")

    def step(self) -> None:
        self.model.train()
        for mb in self.micro:
            c = mb.completion_mask.size(1)
            position_ids = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=position_ids,
                                logits_to_keep=c + 1).logits[:, :-1]
            logp = torch.log_softmax(logits, -1).gather(-1, mb.input_ids[:, -c:, None]).squeeze(-1)
            loss = -(logp * mb.completion_mask * mb.advantages[:, None]).sum() / self.tokens
            loss.backward()
        if self.optimizer_step:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class TRL:
    name = "TRL GRPOTrainer._compute_loss"

    def __init__(self, model, path: Path, tmp: Path, rows: list[dict], micro: int):
        from datasets import Dataset
        from transformers import AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        batch, completion_len = len(rows), len(rows[0]["completion_token_ids"])
        args = GRPOConfig(output_dir=str(tmp / "trl"), use_cpu=True, bf16=False, report_to=[],
                          per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
                          num_generations=min(4, batch), max_completion_length=completion_len,
                          loss_type="dapo", beta=0.0, learning_rate=LR, max_grad_norm=1.0, logging_steps=10**6,
                          temperature=1.0, save_strategy="no",
                          gradient_checkpointing=False)     # TRL's default is True; lightspan does not recompute
        self.trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                   args=args, train_dataset=Dataset.from_list([{"prompt": "x"}] * batch),
                                   processing_class=AutoTokenizer.from_pretrained(path))
        # set by HF Trainer's training loop, which is not run here; the loss normalisation reads it
        self.trainer.current_gradient_accumulation_steps = batch // micro
        self.model = self.trainer.model
        assert not getattr(self.model, "is_activation_checkpointing", False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0, fused=True)
        self.inputs = []
        tokens = sum(len(r["completion_token_ids"]) for r in rows)
        for i in range(0, batch, micro):
            mb = collate(rows[i:i + micro], self.trainer.processing_class.pad_token_id or 0)
            p = mb.input_ids.size(1) - mb.completion_mask.size(1)
            self.inputs.append({
                "prompt_ids": mb.input_ids[:, :p], "prompt_mask": mb.attention_mask[:, :p],
                "completion_ids": mb.input_ids[:, p:], "completion_mask": mb.completion_mask,
                "advantages": mb.advantages, "old_per_token_logps": None,
                "num_items_in_batch": torch.tensor(float(tokens))})

    def step(self) -> None:
        t = self.trainer
        self.model.train()
        for inputs in self.inputs:
            with t.compute_loss_context_manager():
                loss = t.compute_loss(self.model, inputs)
            t.accelerator.backward(loss)
        t.accelerator.clip_grad_norm_(self.model.parameters(), t.args.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def bench(name: str, rounds: int, tmp: Path) -> dict:
    from transformers import AutoModelForCausalLM

    path = model_dir(name, tmp)
    n, prompt_len, completion_len, micro = SHAPES[name]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = rows_for(n, prompt_len, completion_len, base.config.vocab_size)
    runners = [Lightspan(path, tmp / name, rows, micro), Raw(copy.deepcopy(base), rows, micro, False),
               Raw(copy.deepcopy(base), rows, micro, True), TRL(base, path, tmp / name, rows, micro)]
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    cpu: dict[str, list[float]] = {r.name: [] for r in runners}
    for round_ in range(rounds + 1):
        for r in runners:
            t0, c0 = time.perf_counter(), time.process_time()
            r.step()
            if round_:                                   # round 0 warms up
                times[r.name].append(time.perf_counter() - t0)
                cpu[r.name].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    ours, ours_cpu = med[Lightspan.name], med_cpu[Lightspan.name]
    return {"model": name, "parameters": sum(p.numel() for p in base.parameters()),
            "load_average_1m_after": round(os.getloadavg()[0], 1),
            "batch": {"sequences": n, "prompt_len": prompt_len, "completion_len": completion_len, "micro_batch": micro},
            "median_seconds": {k: round(v, 4) for k, v in med.items()},
            "all_seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
            "ratio_vs_raw_fwd_bwd": round(ours / med["raw forward+backward"], 3),
            "ratio_vs_raw_fwd_bwd_adamw": round(ours / med["raw forward+backward + AdamW"], 3),
            "ratio_vs_trl": round(ours / med[TRL.name], 3),
            # CPU time of this process: what each step costs, less sensitive to other jobs on the machine
            "median_cpu_seconds": {k: round(v, 4) for k, v in med_cpu.items()},
            "cpu_ratio_vs_raw_fwd_bwd": round(ours_cpu / med_cpu["raw forward+backward"], 3),
            "cpu_ratio_vs_raw_fwd_bwd_adamw": round(ours_cpu / med_cpu["raw forward+backward + AdamW"], 3),
            "cpu_ratio_vs_trl": round(ours_cpu / med_cpu[TRL.name], 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    p.add_argument("--rounds", type=int, default=5, help="timed steps per method, after one warm-up")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is a clean measure of work)")
    p.add_argument("--shape", action="append", default=[], metavar="MODEL=B,P,C,M",
                   help="override a model's batch: sequences, prompt and completion tokens, micro-batch "
                        "(e.g. smollm2=4,48,32,2)")
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    args = p.parse_args(argv)
    for item in args.shape:
        name, _, numbers = item.partition("=")
        SHAPES[name] = tuple(int(x) for x in numbers.split(","))
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            torch.manual_seed(0)
            results.append(bench(name.strip(), args.rounds, Path(tmp)))
    lines = []
    for r in results:
        lines.append(f"{r['model']} ({r['parameters'] / 1e6:.1f}M params, {r['batch']}, "
                     f"load average {r['load_average_1m_after']} after)")
        for k, v in r["median_seconds"].items():
            lines.append(f"  {k:<36} median {v:8.4f} s (CPU {r['median_cpu_seconds'][k]:8.4f} s)   "
                         f"{r['all_seconds'][k]}")
        lines.append(f"  lightspan / raw fwd+bwd = {r['ratio_vs_raw_fwd_bwd']} wall, "
                     f"{r['cpu_ratio_vs_raw_fwd_bwd']} CPU   (target <= 1.15)")
        lines.append(f"  lightspan / raw fwd+bwd+AdamW = {r['ratio_vs_raw_fwd_bwd_adamw']} wall, "
                     f"{r['cpu_ratio_vs_raw_fwd_bwd_adamw']} CPU")
        lines.append(f"  lightspan / TRL = {r['ratio_vs_trl']} wall, {r['cpu_ratio_vs_trl']} CPU   (target <= 1.0)")
    sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        sys.stdout.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
