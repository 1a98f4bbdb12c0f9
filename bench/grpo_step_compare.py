"""Diagnosis: GRPO step by step, lightspan's trainer step against TRL's ``GRPOTrainer``, on the same batches.

    .venv/bin/python bench/grpo_step_compare.py [--steps 3] [--seed 0] [--model DIR] [--out FILE.json]

Both sides start from the same weights (SmolLM2-135M-Instruct as ``lightspan model smollm2`` makes it,
or ``--model``) and the same LoRA initialisation (TRL's adapter, copied into lightspan's), with the
settings ``bench/learning_vs_trl.py`` gives each (:func:`learning_vs_trl.trl_config`,
:func:`learning_vs_trl.lightspan_trainer_config`), and are fed the same batches:

1. **TRL** runs ``GRPOTrainer.train`` for ``--steps`` steps, unchanged: its own prompt tokenisation,
   transformers generation (4 prompts x 8 completions at temperature 0.7, 24 new tokens), the demo's
   reward, its advantages, ``_compute_loss``, its optimizer, scheduler and gradient clip. Wrappers
   only record: each generation batch (prompt and completion token ids, rewards, advantages), the
   sampling policy's logprobs of the sampled tokens (lightspan's ``token_logprobs`` on TRL's weights
   at that moment, tempered), TRL's own ``_get_per_token_logps_and_entropies`` on the same tokens,
   the pre-clip gradient norm and learning rate TRL logs, and the adapter's weights after each step.
2. **lightspan** trains on those batches, twice from the same start: as its trainer does now, and as
   it did before issue 33 (the zero-advantage sequences left out of the loss's normaliser): transitions built as the store holds them (prompt and
   completion ids, the sampling logprobs as vLLM's recorded ``completion_logprobs``, temperature 0.7,
   the advantage of ``lightningrl.advantages.grpo`` over the rewards, rows with advantage 0 left out
   as ``trainer.batches.next_batch`` leaves them out), one ``trainer.step.optimise`` per batch.

Per step it prints and writes: advantages (each side's, the ratio of their scales), the number of
sequences each loss divides by, the pre-clip gradient norms, whether the clip bound, the learning
rate and AdamW's hyper-parameters, the logprob agreement, the importance weights lightspan applied,
each side's parameter update norm and the cosine between the two updates, and the policy entropy.

Generation is TRL's (transformers), not vLLM's: vLLM's logprobs match transformers' to 1e-5 on
this model (docs/architecture.md), so the sampling logprobs are computed here instead.
``--fake-rewards`` (for a random tiny model, whose replies never score) draws each completion's reward
at random, 1 or 1.2 a tenth of the time and 0 otherwise (about SmolLM2's start on the additions), the
same on both sides: a check of the mechanics, not a finding about learning.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning_vs_trl as lvt  # noqa: E402  (the settings both sides run with)

log = logging.getLogger("grpo_step_compare")


def _adapter(model) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) parameters by name, without peft's adapter-name infix differences."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[n].flatten() for n in sorted(params)])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


# --- TRL: the real trainer, recorded ----------------------------------------------------------------

def run_trl(args, model_dir: str, work: Path) -> tuple[dict, list[dict], list[dict]]:
    """TRL's ``--steps`` steps; returns (the adapter at start, the batches it trained on, per-step records)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from lightspan.agents.math_agent import INSTRUCTION, score
    from lightspan.demo import make_tasks
    from lightspan.trainer.loss import token_logprobs

    train, _ = make_tasks(args.seed, args.steps * args.tasks_per_step, 0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{t['question']} {INSTRUCTION}"}],
                                  "answer": t["answer"]} for t in train])
    fake = random.Random(args.seed)

    def reward(completions, answer, **_):
        if args.fake_rewards:
            # about SmolLM2's start on the additions: a tenth solved, so about half the groups of 8 informative
            return [(1.2 if fake.random() < 0.5 else 1.0) if fake.random() < 0.1 else 0.0 for _ in completions]
        return [score(c[0]["content"], a) for c, a in zip(completions, answer)]

    config, lora = lvt.trl_config(args, work)
    batches: list[dict] = []
    records: list[dict] = []
    start: dict = {}

    class Record(TrainerCallback):
        def on_train_begin(self, targs, state, control, model=None, **kw):
            start.update(_adapter(model))
            records.append({"adapter": _adapter(model)})

        def on_step_end(self, targs, state, control, model=None, **kw):
            records.append({"adapter": _adapter(model)})

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=[Record()])
    score_batch = trainer._generate_and_score_completions

    def recorded(inputs):
        out = score_batch(inputs)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        c = out["completion_ids"].size(1)
        with torch.no_grad():
            trl_logps, trl_entropy, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, attention, c, compute_entropy=True)
            temps = torch.full((ids.size(0),), float(config.temperature))
            sampling, _ = token_logprobs(trainer.model, ids, attention, out["completion_mask"], temps)
        mask = out["completion_mask"].bool()
        prompts = [p[m.bool()].tolist() for p, m in zip(out["prompt_ids"], out["prompt_mask"])]
        completions = [cid[m].tolist() for cid, m in zip(out["completion_ids"], mask)]
        batches.append({
            "prompt_token_ids": prompts, "completion_token_ids": completions,
            "completion_logprobs": [s[m].tolist() for s, m in zip(sampling, mask)],
            "rewards": list(trainer._logs["rewards"]["reward"])[-len(prompts):],
            "trl_advantages": out["advantages"].tolist(),
            "logprob_max_abs_diff": float((trl_logps - sampling).abs()[mask].max()),
            "trl_entropy": float(trl_entropy[mask].mean())})
        return out

    trainer._generate_and_score_completions = recorded
    cpu0 = time.process_time()
    trainer.train()
    cpu = time.process_time() - cpu0
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    group = trainer.optimizer.param_groups[0]
    for k, h in enumerate(logs):
        delta = _flat(records[k + 1]["adapter"]) - _flat(records[k]["adapter"])
        records[k + 1].update({"grad_norm": float(h["grad_norm"]), "lr": float(h["learning_rate"]),
                               "loss": float(h["loss"]), "entropy": float(h.get("entropy", float("nan"))),
                               "delta": delta})
    optimizer = {"class": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                               else trainer.optimizer).__name__,
                 "betas": list(group["betas"]), "eps": group["eps"], "weight_decay": group["weight_decay"],
                 "max_grad_norm": config.max_grad_norm, "scheduler": str(config.lr_scheduler_type),
                 "warmup_steps": config.warmup_steps, "cpu_s": cpu}
    return start, batches, [optimizer, *records[1:]]


# --- lightspan: its trainer step on the same batches ------------------------------------------------

def transitions(batch: dict, *, group_size: int, epsilon: float, temperature: float, step: int):
    """The batch as the store's transitions: lightningrl's rollout-level GRPO advantages, one group per
    prompt (``group_size`` consecutive completions), rows with advantage 0 left out as next_batch does;
    and the totals of those left out (next_batch's ``Batch.zero_totals``: sequences, tokens, longest)."""
    from lightspan.lightningrl.advantages import grpo
    from lightspan.trainer.loss import BatchTotals

    n = len(batch["rewards"])
    groups = [i // group_size for i in range(n)]
    advantages = grpo(batch["rewards"], groups, epsilon=epsilon)
    rows = [{"transition_id": f"{step}-{i}", "rollout_id": f"{step}-{i}", "task_id": f"{step}-{groups[i]}",
             "prompt_token_ids": batch["prompt_token_ids"][i], "completion_token_ids": batch["completion_token_ids"][i],
             "completion_logprobs": batch["completion_logprobs"][i], "completion_mask": None,
             "model_version": 0, "temperature": temperature, "reward": batch["rewards"][i],
             "advantage": float(advantages[i]), "created_unix_nano": i}
            for i in range(n)]
    batch["lightspan_advantages"] = advantages.tolist()
    zero = [len(r["completion_token_ids"]) for r in rows if r["advantage"] == 0]
    return (pa.Table.from_pylist([r for r in rows if r["advantage"] != 0]),
            BatchTotals(len(zero), sum(zero), max(zero, default=0)))


def run_lightspan(args, model_dir: str, start: dict, batches: list[dict], work: Path, *,
                  count_zero: bool) -> tuple[dict, list[dict]]:
    """lightspan's steps on ``batches``; ``count_zero``: with the zero-advantage sequences in the loss's
    normaliser (next_batch's ``zero_totals``, as since issue 33), else without them (as before)."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from lightspan.lightningrl.config import TransitionsConfig
    from lightspan.trainer.batches import Batch, Cursor
    from lightspan.trainer.lora import trainable_parameters, with_lora
    from lightspan.trainer.step import optimise

    cfg = lvt.lightspan_trainer_config(args, model_dir, work)
    # the arm with the zero-advantage sequences in the normaliser (TRL's 1/G) and the one without (the default)
    cfg = dataclasses.replace(cfg, zero_advantage="count" if count_zero else "exclude")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = with_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                      targets=cfg.lora_target_modules, seed=cfg.seed)
    own = dict(model.named_parameters())
    if set(start) != {n for n, p in own.items() if p.requires_grad}:
        raise SystemExit("the two sides' adapters have different parameters: cannot start them equal")
    with torch.no_grad():
        for name, value in start.items():
            own[name].copy_(value)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  fused=True)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    epsilon = TransitionsConfig.__dataclass_fields__["epsilon"].default
    records, before = [], _adapter(model)
    cpu = 0.0
    for k, b in enumerate(batches):
        table, zero = transitions(b, group_size=args.samples, epsilon=epsilon, temperature=0.7, step=k)
        if not table.num_rows:
            records.append({"skipped": "every advantage 0: lightspan takes no step", "delta": torch.zeros_like(
                _flat(before))})
            continue
        c0 = time.process_time()
        batch = Batch(table=table, cursor=Cursor(), zero_advantage=zero.num_sequences)
        if count_zero:
            batch.zero_totals = zero
        metrics = optimise(accelerator, model, optimizer, batch, cfg,
                           pad_id=int(model.config.pad_token_id or 0))
        cpu += time.process_time() - c0
        after = _adapter(model)
        records.append({**{key: metrics[key] for key in ("grad_norm", "loss", "entropy", "is_ratio_mean",
                                                        "is_truncated", "clip_ratio", "num_transitions")},
                        "delta": _flat(after) - _flat(before)})
        before = after
    group = optimizer.param_groups[0]
    return ({"class": type(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer).__name__,
             "betas": list(group["betas"]), "eps": group["eps"], "weight_decay": group["weight_decay"],
             "max_grad_norm": cfg.max_grad_norm, "scheduler": "constant (no scheduler)", "warmup_steps": 0,
             "lr": group["lr"], "cpu_s": cpu}, records)


# --- the comparison ---------------------------------------------------------------------------------

def compare(batches: list[dict], trl: list[dict], ls: list[dict], before: list[dict], group_size: int) -> list[dict]:
    """Per step: TRL against lightspan (its normaliser as fixed in issue 33) and lightspan as before."""
    rows = []
    for k, (b, t, s, s0) in enumerate(zip(batches, trl, ls, before)):
        trl_adv, ls_adv = np.array(b["trl_advantages"]), np.array(b["lightspan_advantages"])
        nonzero = int(np.count_nonzero(ls_adv))
        lengths = np.array([len(c) for c in b["completion_token_ids"]])
        informative = int(sum(np.ptp(b["rewards"][g:g + group_size]) > 0 for g in range(0, len(lengths), group_size)))
        tn, sn = float(t["delta"].norm()), float(s["delta"].norm())
        row = {
            "step": k + 1, "reward_mean": float(np.mean(b["rewards"])), "groups_with_signal": informative,
            "sequences": len(lengths), "mean_completion_tokens": float(lengths.mean()),
            # advantages: TRL (r - mean) / (std_ddof1 + 1e-4); lightspan (r - mean) / (std_ddof0 + 1e-6)
            "advantage_scale_trl_over_lightspan": float(np.abs(trl_adv).sum() / max(np.abs(ls_adv).sum(), 1e-12)),
            "advantage_max_abs_diff": float(np.abs(trl_adv - ls_adv).max()),
            # the grpo loss divides the sum of per-sequence means by this many sequences
            "loss_divides_by": {"trl": len(lengths), "lightspan": len(lengths), "lightspan_before": nonzero},
            "grad_norm_preclip": {"trl": t.get("grad_norm"), "lightspan": s.get("grad_norm"),
                                  "lightspan_before": s0.get("grad_norm")},
            "lr": t.get("lr"),
            "logprob_max_abs_diff_trl_vs_lightspan": b["logprob_max_abs_diff"],
            "is_ratio_mean_lightspan": s.get("is_ratio_mean"), "is_truncated_lightspan": s.get("is_truncated"),
            "update_norm": {"trl": tn, "lightspan": sn, "lightspan_before": float(s0["delta"].norm())},
            "update_cosine": _cosine(t["delta"], s["delta"]) if tn and sn else None,
            "update_cosine_before": _cosine(t["delta"], s0["delta"]) if tn and float(s0["delta"].norm()) else None,
            "entropy": {"trl": t.get("entropy"), "lightspan": s.get("entropy"), "lightspan_before": s0.get("entropy")},
        }
        if "skipped" in s:
            row["lightspan_skipped"] = s["skipped"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="", help="model directory (default: lightspan model smollm2's)")
    parser.add_argument("--fake-rewards", action="store_true", help="random rewards (a plumbing check on a tiny model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="", help="write the per-step comparison here (JSON)")
    lvt.add_shared_options(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    args.trl_threads, args.max_steps, args.val_tasks = args.threads, args.steps, 0
    from lightspan.models import DEFAULT_SMOLLM2_DIR

    model_dir = args.model or str(DEFAULT_SMOLLM2_DIR)
    with tempfile.TemporaryDirectory(prefix="grpo-step-compare-") as work:
        start, batches, trl = run_trl(args, model_dir, Path(work))
        trl_opt, trl_steps = trl[0], trl[1:]
        ls_opt, ls_steps = run_lightspan(args, model_dir, start, batches, Path(work), count_zero=True)
        _, ls_before = run_lightspan(args, model_dir, start, batches, Path(work), count_zero=False)
    rows = compare(batches, trl_steps, ls_steps, ls_before, args.samples)
    print(f"optimizer  TRL: {json.dumps(trl_opt)}\n      lightspan: {json.dumps(ls_opt)}")
    for r in rows:
        print(json.dumps(r))
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "optimizer": {"trl": trl_opt, "lightspan": ls_opt},
                                              "steps": rows, "batches": [{k: b[k] for k in (
                                                  "rewards", "trl_advantages", "lightspan_advantages")}
                                                  for b in batches]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
