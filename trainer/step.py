"""One optimizer step of the trainer (trainer/loop.py's ``step``): a batch of transitions in, the
policy's weights updated, the step's metrics out.

One pass (``num_iterations`` passes over the batch, each ``mini_batches`` optimizer steps)::

    mini-batches (of whole rollouts) -> micro-batches (this rank's share,
    trainer/batches.py) -> token logprobs at each call's temperature -> clipped, IS-corrected loss
    against the recorded vLLM logprobs (trainer/loss.py), normalised by the mini-batch's counts ->
    accumulated gradient -> clip -> AdamW

pi_old is the current policy detached where nothing has moved it yet (the first mini-batch of the
first pass: ratio 1), and frozen up front for the rest; the KL reference's logprobs (``beta`` > 0)
are computed once, up front. Under DDP the loss is scaled by the number of ranks (trainer/loop.py's
docstring, 5.), and padding micro-batches carry weight 0 and no metrics. What the loss divides by
(``step_totals``: the transition's or the rollout's tokens, rows of loss weight 0 left out) is
counted over the whole mini-batch before it is cut; micro-batches hold at most ``micro_batch_size``
rows and ``micro_batch_tokens`` padded tokens, or the budget trainer/memory.py derives from
``max_memory_gb`` and the model's size.
"""

from __future__ import annotations

import math
import time

import pyarrow as pa
import torch

from lightspan.trainer import distributed as dist
from lightspan.trainer.batches import Batch, micro_batches, rollout_keys, step_totals
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.lora import reference
from lightspan.trainer.loss import BatchTotals, policy_loss, token_logprobs
from lightspan.trainer.memory import step_budget


def learning_rate_at(config: TrainerConfig, version: int) -> float:
    """The learning rate of the step that makes version + 1 (``lr_schedule``): ``learning_rate`` at version 0,
    decayed linearly or on a half cosine to ``learning_rate * lr_final_ratio`` at ``lr_decay_steps``, held after."""
    lr = config.learning_rate
    if config.lr_schedule == "constant":
        return lr
    done = min(version / config.lr_decay_steps, 1.0)
    left = 1.0 - done if config.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return lr * (config.lr_final_ratio + (1.0 - config.lr_final_ratio) * left)


def optimise(accelerator, model, optimizer, batch: Batch, config: TrainerConfig, *, ref_model=None,
             pad_id: int = 0) -> dict:
    """Train ``model`` (accelerate-prepared) on ``batch``; returns the step's metrics (train_steps'
    columns: loss, clip and IS ratios, entropy, KL, grad norm, counts, timings)."""
    cfg, device = config, accelerator.device
    t0 = time.monotonic()
    model.train()
    trained_tokens = 0
    budget = cfg.micro_batch_tokens or step_budget(cfg.max_memory_gb, accelerator.unwrap_model(model), optimizer)
    budget = dist.from_main(accelerator, budget)    # one cut on every rank: their passes must pair
    updates = []                                    # per mini-batch: (totals, micro-batches, live)
    for part, share in split_rollouts(batch.table, cfg.mini_batches, batch.zero_totals):
        totals, table = step_totals(part, cfg.loss_normalisation)    # the mini-batch's, before the cut
        trained_tokens += totals.num_tokens
        # with zero_advantage 'count', the zero-advantage sequences next_batch left out of the forward
        # pass still count in what the loss divides by, as in GRPO's 1/G (trainer/loss.py, deviation 4)
        if cfg.zero_advantage == "count":
            totals = BatchTotals(totals.num_sequences + share.num_sequences, totals.num_tokens + share.num_tokens,
                                 max(totals.max_completion_length, share.max_completion_length))
        micro, live = micro_batches(table, rank=accelerator.process_index,   # this rank's share
                                    num_ranks=accelerator.num_processes, size=cfg.micro_batch_size,
                                    pad_id=pad_id, device=device, max_tokens=budget,
                                    # one process only: two forward calls before one backward is untested
                                    # under DDP's and FSDP's hooks
                                    shared_prefix=cfg.shared_prefix_tokens if accelerator.num_processes == 1 else 0)
        updates.append((totals, micro, live))

    # pi_old: where no update came before, the current logprobs, detached (ratio 1); otherwise frozen now
    old = [[None] * len(micro) for _, micro, _ in updates]
    ref = [[None] * len(micro) for _, micro, _ in updates]
    with torch.no_grad():
        for u, (_, micro, _) in enumerate(updates):
            for i, mb in enumerate(micro):
                if u > 0 or cfg.num_iterations > 1:
                    old[u][i] = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_mask,
                                               mb.temperatures, mb.prefix_len)[0]
                if cfg.beta:
                    with reference(accelerator.unwrap_model(model), ref_model) as ref_policy:
                        ref[u][i] = token_logprobs(ref_policy, mb.input_ids, mb.attention_mask, mb.completion_mask,
                                                   mb.temperatures, mb.prefix_len)[0]

    sums: dict[str, float] = {}     # token-weighted sums of the per-micro-batch metrics
    loss_total, is_max, grad_norm = 0.0, 0.0, 0.0
    steps = cfg.num_iterations * len(updates)
    for _ in range(cfg.num_iterations):
        for u, (totals, micro, live) in enumerate(updates):
            for i, mb in dist.accumulating(accelerator, model, micro):
                logprobs, entropy = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_mask,
                                                   mb.temperatures, mb.prefix_len)
                loss, m = policy_loss(
                    logprobs, logprobs.detach() if old[u][i] is None else old[u][i], mb.advantages,
                    mb.completion_mask, loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                    behaviour_logprobs=mb.behaviour_logprobs, is_correction=cfg.is_correction,
                    is_cap=cfg.is_cap, is_floor=cfg.is_floor, ref_logprobs=ref[u][i], beta=cfg.beta,
                    totals=totals, sizes=mb.sizes, row_weights=mb.row_weights)
                # DDP averages the ranks' gradients; x ranks makes it their sum, the full batch's gradient
                accelerator.backward(loss * (accelerator.num_processes if i < live else 0.0))
                if i >= live:                   # a padding pass (module docstring, 5): no metrics
                    continue
                n = m["num_tokens"]
                m["entropy"] = float(entropy.sum()) / max(n, 1)
                for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "ratio_mean", "is_ratio_mean",
                            "is_truncated", "kl", "entropy"):
                    sums[key] = sums.get(key, 0.0) + m[key] * n
                loss_total += m["loss"]
                is_max = max(is_max, m["is_ratio_max"])
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf")))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    sums, loss_total, is_max = dist.across_ranks(accelerator, sums, loss_total, is_max)

    weight = max(trained_tokens * cfg.num_iterations, 1)
    metrics = {key: value / weight for key, value in sums.items()}
    advantages = batch.table.column("advantage").to_pylist()     # one per transition
    signed = torch.tensor(advantages, dtype=torch.float64)
    metrics["advantage_std"] = float(signed.std(unbiased=False))
    metrics["tokens_per_second"] = trained_tokens * cfg.num_iterations / max(time.monotonic() - t0, 1e-9)
    metrics.update({
        "loss": loss_total / steps, "is_ratio_max": is_max, "grad_norm": grad_norm,
        "num_transitions": batch.table.num_rows, "num_tokens": trained_tokens,
        "reward_mean": batch.reward_mean, "advantage_abs_mean": sum(map(abs, advantages)) / len(advantages),
        "staleness_mean": batch.staleness_mean, "skipped_stale": batch.skipped_stale,
        "skipped_malformed": batch.skipped_malformed, "zero_advantage": batch.zero_advantage,
        "masked": batch.masked, "micro_batches": sum(live for *_, live in updates), "micro_batch_tokens": budget,
        "step_seconds": time.monotonic() - t0})
    return metrics


def split_rollouts(table, parts: int, zero: BatchTotals) -> list[tuple[object, BatchTotals]]:
    """``table`` cut into at most ``parts`` mini-batches of whole rollouts (a transition without a
    rollout is one), in the order of each rollout's first row, of rows as even as whole rollouts
    allow, each with its share of the zero-advantage ``zero``: sequences and tokens pro rata to its
    rows, the longest completion whole."""
    if parts == 1:                                  # the whole batch, as it is
        return [(table, zero)]
    rows_of: dict = {}                              # rollout -> its rows, in the order of first appearance
    for i, key in enumerate(rollout_keys(table)):
        rows_of.setdefault(key, []).append(i)
    n, groups, cuts = table.num_rows, list(rows_of.values()), []
    done = 0
    for rows in groups[:-1]:                        # cut after a rollout once its part has its share
        done += len(rows)
        if len(cuts) < parts - 1 and done >= n * (len(cuts) + 1) / parts:
            cuts.append(done)
    order = pa.array([i for rows in groups for i in rows], pa.int64())

    def upto(row: int) -> tuple[int, int]:       # the zero-advantage share of rows [0, row)
        if row >= n:
            return zero.num_sequences, zero.num_tokens
        return zero.num_sequences * row // n, zero.num_tokens * row // n

    out = []
    for a, b in zip([0, *cuts], [*cuts, n]):
        (s0, t0), (s1, t1) = upto(a) if a else (0, 0), upto(b)
        out.append((table.take(order[a:b]), BatchTotals(s1 - s0, t1 - t0, zero.max_completion_length)))
    return out
