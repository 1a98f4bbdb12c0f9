"""``lightspan train --algo sft``: supervised fine-tuning on captured calls, a warm start from a hosted
model's traces, under the same checkpoint, sync and policy-version contracts as GRPO.

One run, flat (:func:`run`)::

    load         the Trainer's own load_or_init: the newest checkpoint in output_dir, else --model
                 (LoRA or full, as GRPO); publish the starting policy (Trainer.start)
    select       the calls of ``select`` and of ``val_select`` (trainer/sft_data.py), re-tokenised with
                 the policy's chat template; unrenderable calls counted by reason
    evaluate     the held-out calls before training: loss, token accuracy, exact match
    fit          sft_epochs passes over the examples in a seeded order, batch_size examples per AdamW
                 step; the loss is the mean negative log-likelihood of the assistant tokens
    evaluate     the held-out calls after training
    save/publish version + 1: output_dir/v{version:06d}/ (trainer/checkpoints.py), weight sync and
                 its check, policy.json, one train_steps row (Trainer.publish)

Choices worth knowing:
1. A run makes one policy version, whatever its number of optimizer steps: a warm start is one job,
   and its half-trained states are never served. Its train_steps row has the last epoch's mean loss,
   the examples (num_transitions), the assistant tokens trained over all epochs (num_tokens), the
   last step's grad_norm; the GRPO-only columns are null.
2. The data cursor is not moved: GRPO (``lightspan train``, resuming from this checkpoint) then reads
   the transitions it would have read, at version + 1, with the SFT run's AdamW moments (the
   checkpoint's optimizer state, as for any resume; the learning rate is the new run's).
3. Held-out evaluation scores the assistant reply under teacher forcing: the mean per-token loss,
   the share of tokens that are the model's argmax, and exact match, the share of replies whose every
   token is the argmax given the reference prefix, which is what greedy decoding reproduces
   exactly (ties aside). No generation is needed.
4. The loss is normalised by the optimizer step's assistant tokens (each token counts once, as in
   TRL's SFTTrainer), at temperature 1; nothing is sampled, so there is no importance weight.
5. One process: a multi-process launch is refused (``accelerate launch`` is for GRPO).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from pathlib import Path

import torch
from trl.trainer.utils import selective_log_softmax

from lightspan.core.config import ConfigError
from lightspan.trainer import sft_data
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.loop import Trainer
from lightspan.trainer.sft_data import Example

log = logging.getLogger(__name__)

PREFIX = "train/sft/"
SUMMARY_FILE = "sft_summary.json"


def pad(examples: list[Example], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, loss_mask) of ``examples``, right-padded; loss_mask[:, t] is 1 where
    token t + 1 is an assistant token (the targets of logits[:, t])."""
    width = max(len(e.prompt_ids) + len(e.completion_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    mask = torch.zeros((len(examples), width - 1), dtype=torch.float32)
    for i, e in enumerate(examples):
        p, n = len(e.prompt_ids), len(e.prompt_ids) + len(e.completion_ids)
        ids[i, :n] = torch.tensor(e.prompt_ids + e.completion_ids)
        attention[i, :n] = 1
        mask[i, p - 1:n - 1] = 1.0
    return ids.to(device), attention.to(device), mask.to(device)


def token_nll(model, ids: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor):
    """Per-token negative log-likelihood of the targets ids[:, 1:] (0 off the mask), and whether each
    target is the model's argmax."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    targets = ids[:, 1:]
    nll = -selective_log_softmax(logits, targets) * mask
    return nll, (logits.argmax(-1) == targets)


def evaluate(model, examples: list[Example], *, micro_batch_size: int, pad_id: int, device) -> dict:
    """Held-out scores of ``examples`` (module docstring, 3): loss, token_accuracy, exact_match."""
    if not examples:
        return {}
    was_training = model.training
    model.eval()
    nll_sum, tokens, correct, exact = 0.0, 0, 0, 0
    with torch.no_grad():
        for start in range(0, len(examples), micro_batch_size):
            ids, attention, mask = pad(examples[start:start + micro_batch_size], pad_id, device)
            nll, hit = token_nll(model, ids, attention, mask)
            on = mask.bool()
            nll_sum += float(nll.sum())
            tokens += int(on.sum())
            correct += int((hit & on).sum())
            exact += int(((hit | ~on).all(dim=1)).sum())
    model.train(was_training)
    return {"loss": nll_sum / tokens, "token_accuracy": correct / tokens, "exact_match": exact / len(examples)}


def fit(accelerator, model, optimizer, examples: list[Example], config: TrainerConfig, *, pad_id: int) -> dict:
    """sft_epochs passes over ``examples`` (module docstring, 4); returns the fit's metrics."""
    rng = random.Random(config.seed)
    size = config.batch_size or len(examples)
    model.train()
    epoch_losses, steps, grad_norm, trained = [], 0, 0.0, 0
    for _ in range(config.sft_epochs):
        order = list(examples)
        rng.shuffle(order)
        nll_sum, tokens = 0.0, 0
        for start in range(0, len(order), size):
            batch = order[start:start + size]
            total = sum(len(e.completion_ids) for e in batch)
            for m in range(0, len(batch), config.micro_batch_size):
                ids, attention, mask = pad(batch[m:m + config.micro_batch_size], pad_id, accelerator.device)
                nll, _ = token_nll(model, ids, attention, mask)
                accelerator.backward(nll.sum() / total)
                nll_sum += float(nll.detach().sum())
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or float("inf")))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            tokens += total
        epoch_losses.append(nll_sum / tokens)
        trained += tokens
    return {"epoch_losses": epoch_losses, "optimizer_steps": steps, "grad_norm": grad_norm, "tokens": trained}


def run(config: TrainerConfig, *, trainer: Trainer | None = None, chat_template: str | None = None) -> dict:
    """One SFT run (module docstring); returns its summary: the ``train/sft/*`` metrics. The calls are
    rendered with ``config.chat_template``'s file, else ``chat_template`` (the template vLLM serves,
    which the CLI knows), else the tokenizer's own."""
    t0 = time.monotonic()
    if trainer is None:
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        trainer = Trainer(config)
        trainer.load_or_init()
    if trainer.accelerator.num_processes > 1:
        raise ConfigError("trainer", "algo", "'sft' runs in one process", "run lightspan train --algo sft "
                          "without accelerate launch")
    tokenizer = trainer.tokenizer
    if tokenizer is not None and (config.chat_template or chat_template):
        tokenizer.chat_template = Path(config.chat_template).read_text() if config.chat_template else chat_template
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError("trainer", "model", f"{trainer.model_source} has no tokenizer with a chat template, "
                          "which SFT renders the captured calls with", "pass a --model directory whose tokenizer "
                          "has a chat_template (tokenizer_config.json or chat_template.jinja)")
    trainer.start()
    model, device, pad_id = trainer.model, trainer.accelerator.device, trainer._pad_id()
    model_config = trainer.accelerator.unwrap_model(model).config
    max_length = config.sft_max_length or getattr(model_config, "max_position_embeddings", None) or 2**31 - 1

    con = sft_data.connect(trainer.data_dir)
    rows = sft_data.select(con, config.select, field="select")
    val_rows = sft_data.select(con, config.val_select, field="val_select") if config.val_select else []
    con.close()
    train, counts = sft_data.examples(rows, tokenizer, max_length=max_length)
    val, val_counts = sft_data.examples(val_rows, tokenizer, max_length=max_length)
    train, held_out = sft_data.split(train, val)
    summary = {"calls_selected": len(rows), "examples": len(train), "held_out_overlap": held_out,
               "duplicates": counts["duplicates"], "assistant_tokens": sum(len(e.completion_ids) for e in train),
               "prompt_tokens": sum(len(e.prompt_ids) for e in train), "unrenderable": _reasons(counts),
               "val/calls_selected": len(val_rows), "val/examples": len(val), "val/unrenderable": _reasons(val_counts)}
    for where, found in (("", counts), ("val/", val_counts)):
        for reason in sft_data.REASONS:
            if found[f"unrenderable/{reason}"]:
                log.warning("%s%d selected calls cannot be trained: %s", "held-out: " if where else "",
                            found[f"unrenderable/{reason}"], sft_data.REASONS[reason])
    if not train:
        log.error("no trainable call among the %d that select=%r picked (the counts above say why); nothing "
                  "trained, policy version %d stays", len(rows), config.select, trainer.version)
        return _flat({**summary, "policy_version": trainer.version, "seconds": time.monotonic() - t0})
    score = dict(micro_batch_size=config.micro_batch_size, pad_id=pad_id, device=device)
    before = evaluate(model, val, **score)
    step_t0 = time.monotonic()
    fitted = fit(trainer.accelerator, model, trainer.optimizer, train, config, pad_id=pad_id)
    step_seconds = time.monotonic() - step_t0
    after = evaluate(model, val, **score)
    trainer.version += 1
    row = trainer.publish(trainer.save(trainer.version), {
        "loss": fitted["epoch_losses"][-1], "num_transitions": len(train), "num_tokens": fitted["tokens"],
        "grad_norm": fitted["grad_norm"], "step_seconds": step_seconds, "skipped_stale": 0})
    summary.update({
        "epochs": config.sft_epochs, "optimizer_steps": fitted["optimizer_steps"],
        "loss_first_epoch": fitted["epoch_losses"][0], "loss_last_epoch": fitted["epoch_losses"][-1],
        **{f"val/{k}_before": v for k, v in before.items()}, **{f"val/{k}_after": v for k, v in after.items()},
        "policy_version": trainer.version, "sync_seconds": row.get("sync_seconds", 0.0),
        "seconds": time.monotonic() - t0})
    summary = _flat(summary)
    checkpoint = trainer.model_source
    (checkpoint / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    log.info("sft: version %d from %d calls (%d selected, %d unrenderable, %d duplicates), %d steps, loss %.4f -> "
             "%.4f%s", trainer.version, len(train), len(rows), sum(_reasons(counts).values()), counts["duplicates"], fitted["optimizer_steps"], fitted["epoch_losses"][0], fitted["epoch_losses"][-1],
             f"; held-out loss {before['loss']:.4f} -> {after['loss']:.4f}, exact match "
             f"{before['exact_match']:.3f} -> {after['exact_match']:.3f}" if before else "")
    return summary


def _reasons(counts: Counter) -> dict:
    return {reason: counts[f"unrenderable/{reason}"] for reason in sft_data.REASONS}


def _flat(summary: dict) -> dict:
    """``train/sft/<name>``, with the reason counts as ``train/sft/[val/]unrenderable/<reason>``."""
    out = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            out.update({f"{PREFIX}{key}/{reason}": n for reason, n in value.items()})
        else:
            out[PREFIX + key] = value
    return out
