"""The training loop: new transitions in, a new policy version out, pushed to vLLM.

One step, flat (``Trainer.train_once``)::

    next_batch   transitions after the cursor, oldest first: skip (and count) the stale, the
                 malformed and the zero-advantage ones (no gradient), take <= batch_size
    step         micro-batches -> token logprobs -> clipped, IS-corrected loss (trainer/loss.py)
                 -> accumulated gradient -> clip -> AdamW; version + 1
    save         output_dir/v{version:06d}/: safetensors + tokenizer + trainer_state.pt +
                 trainer_config.json, written to a temp dir and renamed
    publish      weight sync (trainer/sync.py) -> verify one fixed sequence against vLLM ->
                 data_dir/policy.json (atomic) -> prune old checkpoints -> one train_steps row

Everything resume needs is in :data:`RESUME_STATE` and saved in every checkpoint, so a
restarted trainer continues exactly: same weights, optimizer moments, RNG and data cursor.
The cursor (created_unix_nano, transition_id) moves with the checkpoint, so each transition
is trained at most once.

Choices worth knowing:
1. A transition without a model_version counts as stale: its staleness cannot be bounded.
2. Zero-advantage transitions are left out even when beta > 0, where they would carry only
   the KL term's gradient.
3. A transition rebuilt after the cursor passed it (same transition_id, later
   created_unix_nano) is trained again; within one batch only the newest build counts.
4. If the weight sync fails the checkpoint stays saved and the run exits with code 1; the
   next start publishes it (``ensure_published``) before training on.
5. Data parallel under ``accelerate launch`` (deploy/accelerate/): rank 0 alone reads the
   store, checkpoints, syncs and writes train_steps; it broadcasts each batch, every rank trains
   on its share of the batch's groups (``shard_groups``: whole groups, balanced by tokens), and
   the loss is normalised by the whole batch's counts and scaled by the number of ranks, so
   DDP's gradient average equals one process's gradient on the full batch. Every rank runs the
   same number of micro-batches (extra ones carry weight 0): DDP and FSDP collectives must pair.
   The checkpoint holds rank 0's RNG; output_dir must be on storage every rank can read.
6. FSDP (FSDP2, deploy/accelerate/fsdp.yaml): every rank gathers the full model and optimizer
   state onto rank 0's CPU before rank 0 saves, so a checkpoint has the same layout whatever the
   launch (plain HF safetensors, the optimizer as ``optimizer.state_dict()`` numbers it) and
   resumes under any number of ranks; on resume rank 0 broadcasts the optimizer state and each
   rank keeps its shard. Forward passes are collectives: the sync check's logprobs are computed
   on every rank before rank 0 publishes. The KL reference is sharded too (TRL's prepare_fsdp);
   with LoRA only the adapters are gathered (the frozen base is config.model). Refused: sync
   'nccl' (it would broadcast shards).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pyarrow as pa
import torch

from lightspan import store
from lightspan.config import ConfigError, to_dict
from lightspan.progress import progress
from lightspan.trainer.config import TrainerConfig, parse_duration
from lightspan.trainer.lora import is_adapter, reference, trainable_parameters, with_lora
from lightspan.trainer.loss import BatchTotals, policy_loss, token_logprobs
from lightspan.trainer.metrics import TrainerMetrics, start_server
from lightspan.trainer.sync import LoraSync, NcclSync, NoSync, ReloadSync, SyncError, WeightSync, verify

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "trainer_config.json"       # config.json is the model's: vLLM reads it
RESUME_STATE = ("version", "cursor", "run_id", "optimizer", "rng")
VERIFY_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 30 = 42."
_CHECKPOINT = re.compile(r"v(\d{6,})")
# model files save_pretrained writes itself; everything else in the model dir is copied along
_MODEL_FILES = re.compile(r"(config\.json|generation_config\.json|adapter_config\.json|.*\.safetensors|.*\.bin|.*\.index\.json|"
                          r".*\.gguf|.*\.pt|.*\.pth)")


@dataclass(frozen=True, order=True)
class Cursor:
    """The last transition consumed, in (created_unix_nano, transition_id) order."""

    created_unix_nano: int = -1
    transition_id: str = ""


@dataclass
class Batch:
    rows: list[dict]                  # transitions to train on, oldest first
    cursor: Cursor                    # where the cursor goes once they are trained
    skipped_stale: int = 0            # model_version < version - max_staleness, or unknown
    skipped_malformed: int = 0        # no tokens, logprobs misaligned, ids outside the vocab, too long
    zero_advantage: int = 0           # no gradient: left out of the forward pass
    reward_mean: float | None = None  # over the rollouts of the fresh transitions consumed
    staleness_mean: float = 0.0       # version - model_version over the trained rows


@dataclass
class MicroBatch:
    input_ids: torch.Tensor           # (B, P + C): prompts left-padded, completions right-padded
    attention_mask: torch.Tensor      # (B, P + C)
    completion_mask: torch.Tensor     # (B, C): 1 on the tokens the loss trains
    behaviour_logprobs: torch.Tensor  # (B, C): vLLM's logprobs at sampling time
    advantages: torch.Tensor          # (B,)
    temperatures: torch.Tensor        # (B,): the sampling temperature vLLM's logprobs were taken at


def collate(rows: list[dict], pad_id: int, device: torch.device | str = "cpu") -> MicroBatch:
    """Left-pad the prompts and right-pad the completions, so completions end the sequence.

    A row's ``completion_mask`` (per-rollout transitions) is 0 on completion tokens the model did
    not sample (tool output, user turns): they stay in the attention, out of the loss. Without
    one (null) every completion token is trained.
    """
    from trl.trainer.utils import pad

    def ints(key):
        return [torch.tensor(r[key], dtype=torch.long) for r in rows]

    prompts, completions = ints("prompt_token_ids"), ints("completion_token_ids")
    ones = lambda ts: [torch.ones_like(t) for t in ts]  # noqa: E731
    trained = [torch.tensor(r["completion_mask"], dtype=torch.long) if r.get("completion_mask") is not None
               else torch.ones_like(c) for r, c in zip(rows, completions)]
    input_ids = torch.cat([pad(prompts, pad_id, "left"), pad(completions, pad_id, "right")], dim=1)
    completion_mask = pad(trained, 0, "right")
    attention_mask = torch.cat([pad(ones(prompts), 0, "left"), pad(ones(completions), 0, "right")], dim=1)
    behaviour = pad([torch.tensor(r["completion_logprobs"], dtype=torch.float32) for r in rows], 0.0, "right")
    advantages = torch.tensor([float(r["advantage"]) for r in rows], dtype=torch.float32)
    # vLLM's processed logprobs are of the tempered distribution softmax(z / T); no temperature
    # recorded, or greedy (0), means the untempered one
    temperatures = torch.tensor([float(r.get("temperature") or 1.0) for r in rows], dtype=torch.float32)
    return MicroBatch(*(t.to(device) for t in (input_ids, attention_mask, completion_mask, behaviour, advantages,
                                                temperatures)))


def shard_groups(rows: list[dict], num_shards: int) -> list[list[int]]:
    """Split a batch between ranks: row indices per shard, each shard in batch order.

    A group (the transitions of one task, else of one rollout) stays on one rank. Groups go,
    largest first, to the shard with the fewest tokens so far (ties: the lower shard), so every
    rank computes the same split. A shard may be empty when there are fewer groups than ranks.
    """
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(r.get("task_id") or r.get("rollout_id") or r["transition_id"], []).append(i)

    def tokens(indices: list[int]) -> int:
        return sum(len(rows[i]["prompt_token_ids"]) + len(rows[i]["completion_token_ids"]) for i in indices)

    shards: list[list[int]] = [[] for _ in range(num_shards)]
    load = [0] * num_shards
    for indices in sorted(groups.values(), key=lambda g: (-tokens(g), g[0])):
        k = min(range(num_shards), key=lambda j: (load[j], j))
        shards[k] += indices
        load[k] += tokens(indices)
    return [sorted(s) for s in shards]


# The new transitions after the cursor, classified once. Only light columns: the token lists
# of the rows chosen are read afterwards, by key. A temp table keeps one snapshot: files that
# land while a batch is chosen wait for the next one instead of being skipped by the cursor.
_NEW_SQL = """
CREATE OR REPLACE TEMP TABLE new AS
SELECT transition_id, created_unix_nano, rollout_id, reward, model_version,
       coalesce(model_version >= $min_version, false) AS fresh,
       coalesce(len(completion_token_ids) > 0
                AND len(completion_logprobs) = len(completion_token_ids)
                AND len(prompt_token_ids) > 0
                AND list_min(prompt_token_ids) >= 0 AND list_max(prompt_token_ids) < $vocab
                AND list_min(completion_token_ids) >= 0 AND list_max(completion_token_ids) < $vocab
                AND len(prompt_token_ids) + len(completion_token_ids) <= $max_len
                AND (completion_mask IS NULL OR len(completion_mask) = len(completion_token_ids))
                AND isfinite(coalesce(advantage, 0)), false) AS wellformed,
       coalesce(advantage, 0) <> 0 AS nonzero
FROM transitions
WHERE coalesce(split, 'train') = 'train'
  AND (created_unix_nano > $created OR (created_unix_nano = $created AND transition_id > $tid))
QUALIFY row_number() OVER (PARTITION BY transition_id ORDER BY created_unix_nano DESC) = 1
"""
_UPTO = "(created_unix_nano < $created OR (created_unix_nano = $created AND transition_id <= $tid))"


class Trainer:
    """Model, optimizer, data cursor and RNG of one training run; see the module docstring."""

    def __init__(self, config: TrainerConfig, *, sync: WeightSync | None = None):
        from accelerate import Accelerator

        self.config = config
        self.data_dir = store.data_dir(config.data_dir)
        self.output_dir = Path(config.output_dir) if config.output_dir else self.data_dir / "checkpoints"
        self.sync = sync or {"reload": lambda: ReloadSync(config.vllm_url),
                             "lora": lambda: LoraSync(config.vllm_url, config.served_model_name),
                             # the live tensors, not a checkpoint: the model exists after load_or_init
                             "nccl": lambda: NcclSync(config.vllm_url,
                                                      lambda: self.accelerator.unwrap_model(self.model)),
                             }.get(config.sync, NoSync)()
        self.metrics = TrainerMetrics()           # served on /metrics by run()
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
        _fsdp_on_cpu(self.accelerator)
        self.sharded = self.accelerator.distributed_type.value == "FSDP"     # module docstring, 6
        if self.sharded and config.sync == "nccl":
            raise ConfigError("trainer", "sync", "'nccl' broadcasts rank 0's parameters, which under FSDP are "
                              "shards", "pass --sync reload (rank 0 saves the gathered weights), or launch with "
                              "deploy/accelerate/ddp.yaml")
        # the resume state (RESUME_STATE), set by load_or_init
        self.version = 0
        self.cursor = Cursor()
        self.run_id = ""
        self.model = self.optimizer = self.ref_model = self.tokenizer = None
        self.model_source: Path | None = None     # where tokenizer files are copied from
        self.param_names: list[str] = []          # the optimizer's parameters, in its order

    # ---- state ------------------------------------------------------------------------------
    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints in output_dir, oldest first."""
        if not self.output_dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.output_dir.iterdir()
                 if (m := _CHECKPOINT.fullmatch(p.name)) and (p / STATE_FILE).is_file()]
        return sorted(found)

    def load_or_init(self) -> None:
        """Resume from the newest checkpoint in output_dir exactly, else start at version 0."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cfg = self.config
        found = self.checkpoints()
        source = found[-1][1] if found else Path(cfg.model)
        if found and is_adapter(source) != bool(cfg.lora_r):
            kind = "a LoRA adapter" if is_adapter(source) else "a full model"
            raise ConfigError("trainer", "lora_r", f"the checkpoint to resume, {source}, holds {kind} but "
                              f"lora_r is {cfg.lora_r}",
                              "resume with the setting the run started with, or start a new run in another "
                              "output_dir (--output-dir) from --model")
        base = Path(cfg.model) if cfg.lora_r else source      # a LoRA checkpoint holds the adapter only
        if not (base / "config.json").is_file():
            raise FileNotFoundError(f"no model at {base} (config.json missing): pass --model DIR")
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        _untie(model)
        if cfg.lora_r:
            model = with_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                              targets=cfg.lora_target_modules, seed=cfg.seed, adapter_dir=source if found else None)
        # fused: one kernel over all parameters (on CPU 6x faster than the per-tensor loop over
        # SmolLM2's 163M parameters, bench/README.md), the same update up to float rounding; not
        # for FSDP's sharded parameters (DTensor), where torch 2.13's CPU kernel aborts
        fused = self.accelerator.distributed_type.value != "FSDP"
        optimizer = torch.optim.AdamW(trainable_parameters(model), lr=cfg.learning_rate,
                                      weight_decay=cfg.weight_decay, fused=fused)
        self.param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        state = None
        if found:
            # under FSDP only rank 0 reads the optimizer state (it broadcasts it below): mmap leaves
            # the other ranks' copy on disk
            state = torch.load(source / STATE_FILE, weights_only=True, mmap=self.sharded)
            missing = [k for k in RESUME_STATE if k not in state]
            if missing:
                raise ValueError(f"{source / STATE_FILE} lacks {missing}: not a lightspan checkpoint")
            if not self.sharded:
                optimizer.load_state_dict(state["optimizer"])
            self.version, self.cursor, self.run_id = state["version"], Cursor(*state["cursor"]), state["run_id"]
            _set_rng(state["rng"])
            log.info("resumed version %d from %s (cursor %s)", self.version, source, self.cursor)
        else:
            self.version, self.cursor, self.run_id = 0, Cursor(), self._from_main(uuid.uuid4().hex)
            torch.manual_seed(cfg.seed)
            random.seed(cfg.seed)
            log.info("starting at version 0 from %s", source)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        if state is not None and self.sharded:
            self._load_sharded_optimizer(state["optimizer"])
        if state is not None:
            for group in self.optimizer.param_groups:   # the config, not the checkpoint, sets these
                group.update(lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        self.model_source = source
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as exc:
            log.warning("no tokenizer in %s (%s): verifying syncs with fixed token ids", source, exc)
        if isinstance(self.sync, ReloadSync) and self.sync.serving is None:
            self.sync.serving = self._served_dir()
        if cfg.beta and not cfg.lora_r:      # with LoRA the reference is the base, adapters disabled
            ref_model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
            ref_model.requires_grad_(False).eval().to(self.accelerator.device)
            if self.sharded:                 # sharded like the policy; its forward is a collective too
                from trl.models.utils import prepare_fsdp

                ref_model = prepare_fsdp(ref_model, self.accelerator)
            self.ref_model = ref_model

    def _served_dir(self) -> Path | None:
        """What vLLM most likely serves: the published checkpoint, else (at version 0) the model."""
        published = store.policy.read(self.data_dir)
        if published is not None and Path(published.path).is_dir():
            return Path(published.path)
        return Path(self.config.model) if self.version == 0 else None

    def _resume_state(self, version: int, optimizer: dict | None = None) -> dict:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {"version": version, "cursor": (self.cursor.created_unix_nano, self.cursor.transition_id),
                "run_id": self.run_id, "optimizer": self.optimizer.state_dict() if optimizer is None else optimizer,
                "rng": rng}

    # ---- FSDP (module docstring, 6) ---------------------------------------------------------
    def _gather_full_state(self) -> tuple[dict, dict] | None:
        """Under FSDP, the full model state dict and the optimizer state (numbered as
        ``optimizer.state_dict()`` numbers it), gathered from every rank's shards onto rank 0's CPU.
        A collective: every rank calls it; rank 0 gets the pair, the others None. None without FSDP,
        where rank 0 holds everything itself."""
        if not self.sharded:
            return None
        from torch.distributed.checkpoint import state_dict as dcp

        # rank 0 only, on its CPU; with LoRA the adapter only (the frozen base is config.model)
        options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True,
                                       ignore_frozen_params=bool(self.config.lora_r))
        model_state = dcp.get_model_state_dict(self.model, options=options)
        optimizer_state = dcp.get_optimizer_state_dict(self.model, self.optimizer.optimizer, options=options)
        if not self.accelerator.is_main_process:
            return None
        return model_state, numbered_optimizer_state(optimizer_state, self.param_names)

    def _load_sharded_optimizer(self, saved: dict) -> None:
        """Give each rank its shard of a checkpoint's full optimizer state: rank 0 broadcasts it."""
        from torch.distributed.checkpoint import state_dict as dcp

        full = named_optimizer_state(saved, self.param_names) if self.accelerator.is_main_process else {}
        dcp.set_optimizer_state_dict(self.model, self.optimizer.optimizer, full,
                                     options=dcp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def _expected_logprobs(self) -> tuple[list[int], list[float]] | None:
        """Under FSDP a forward pass is a collective, so every rank computes the sync check's
        logprobs (``verify_sequence``) before rank 0 publishes; None otherwise (rank 0 computes them)."""
        return self.verify_sequence() if self.sharded and self._verifies() else None

    def _saves_at_start(self) -> bool:
        """With sync 'lora' a run that starts from the base saves the version-0 adapter to load it."""
        return self.config.sync == "lora" and self.model_source == Path(self.config.model)

    def _verifies(self) -> bool:
        """Whether publish checks the served logprobs against the trainer's."""
        return self.config.verify_sync and isinstance(self.sync, (ReloadSync, LoraSync, NcclSync))

    # ---- data -------------------------------------------------------------------------------
    def next_batch(self) -> Batch | None:
        """The next batch after the cursor, or None if fewer than min_transitions are trainable."""
        cfg, model_config = self.config, self.accelerator.unwrap_model(self.model).config
        con = store.connect(self.data_dir)
        try:
            con.execute(_NEW_SQL, {
                "min_version": self.version - cfg.max_staleness, "vocab": model_config.vocab_size,
                "max_len": getattr(model_config, "max_position_embeddings", None) or 2**31 - 1,
                "created": self.cursor.created_unix_nano, "tid": self.cursor.transition_id})
            con.execute("CREATE TEMP TABLE chosen AS SELECT created_unix_nano, transition_id FROM new "
                        "WHERE fresh AND wellformed AND nonzero ORDER BY 1, 2 LIMIT $n",
                        {"n": cfg.batch_size or 2**62})
            keys = con.execute("SELECT * FROM chosen ORDER BY 1, 2").fetchall()
            if len(keys) < cfg.min_transitions:
                return None
            if cfg.batch_size and len(keys) == cfg.batch_size:
                cutoff = Cursor(*keys[-1])              # full batch: later rows wait for the next step
            else:
                cutoff = Cursor(*con.execute("SELECT created_unix_nano, transition_id FROM new "
                                             "ORDER BY 1 DESC, 2 DESC LIMIT 1").fetchone())
            upto = {"created": cutoff.created_unix_nano, "tid": cutoff.transition_id}
            stale, malformed, zero = con.execute(f"""
                SELECT count(*) FILTER (WHERE NOT fresh),
                       count(*) FILTER (WHERE fresh AND NOT wellformed),
                       count(*) FILTER (WHERE fresh AND wellformed AND NOT nonzero)
                FROM new WHERE {_UPTO}""", upto).fetchone()
            reward_mean = con.execute(f"""
                SELECT avg(reward) FROM (SELECT any_value(reward) AS reward FROM new
                                         WHERE fresh AND {_UPTO} GROUP BY rollout_id)""", upto).fetchone()[0]
            # the range filter lets DuckDB skip row groups by their min/max statistics
            cur = con.execute("""
                SELECT t.transition_id, t.rollout_id, t.task_id, t.prompt_token_ids, t.completion_token_ids,
                       t.completion_logprobs, t.completion_mask, t.model_version, t.temperature, t.reward, t.advantage,
                       t.created_unix_nano
                FROM transitions t JOIN chosen c USING (created_unix_nano, transition_id)
                WHERE t.created_unix_nano BETWEEN $first AND $last
                ORDER BY t.created_unix_nano, t.transition_id""",
                {"first": keys[0][0], "last": keys[-1][0]})
            names = [d[0] for d in cur.description]
            rows = [dict(zip(names, values)) for values in cur.fetchall()]
        finally:
            con.close()
        rows = list({r["transition_id"]: r for r in rows}.values())   # a file listed twice reads twice
        staleness = [self.version - r["model_version"] for r in rows]
        return Batch(rows=rows, cursor=cutoff, skipped_stale=stale, skipped_malformed=malformed,
                     zero_advantage=zero, reward_mean=reward_mean,
                     staleness_mean=sum(staleness) / len(staleness))

    # ---- optimisation -----------------------------------------------------------------------
    def step(self, batch: Batch) -> dict:
        """One optimizer step per pass over ``batch`` (num_iterations passes); version + 1."""
        cfg, model, device = self.config, self.model, self.accelerator.device
        t0 = time.monotonic()
        model.train()
        pad_id = self._pad_id()
        micro, live = self._micro_batches(batch.rows, pad_id, device)   # this rank's share
        lengths = [len(r["completion_token_ids"]) for r in batch.rows]
        trained = [n if r.get("completion_mask") is None else sum(r["completion_mask"])
                   for r, n in zip(batch.rows, lengths)]
        totals = BatchTotals(len(batch.rows), sum(trained), max(lengths))

        # pi_old: with one pass the current logprobs, detached (ratio 1); with more, frozen now
        old = [None] * len(micro)
        ref = [None] * len(micro)
        with torch.no_grad():
            for i, mb in enumerate(micro):
                if cfg.num_iterations > 1:
                    old[i] = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_mask, mb.temperatures)[0]
                if cfg.beta:
                    with reference(self.accelerator.unwrap_model(model), self.ref_model) as ref_model:
                        ref[i] = token_logprobs(ref_model, mb.input_ids, mb.attention_mask, mb.completion_mask,
                                                mb.temperatures)[0]

        sums: dict[str, float] = {}     # token-weighted sums of the per-micro-batch metrics
        loss_total, is_max, grad_norm = 0.0, 0.0, 0.0
        for _ in range(cfg.num_iterations):
            for i, mb in self._accumulating(micro):
                logprobs, entropy = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_mask,
                                                   mb.temperatures)
                loss, m = policy_loss(
                    logprobs, logprobs.detach() if old[i] is None else old[i], mb.advantages, mb.completion_mask,
                    loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                    behaviour_logprobs=mb.behaviour_logprobs, is_correction=cfg.is_correction,
                    is_cap=cfg.is_cap, is_floor=cfg.is_floor, ref_logprobs=ref[i], beta=cfg.beta,
                    totals=totals)
                # DDP averages the ranks' gradients; x ranks makes it their sum, the full batch's gradient
                self.accelerator.backward(loss * (self.accelerator.num_processes if i < live else 0.0))
                if i >= live:                   # a padding pass (module docstring, 5): no metrics
                    continue
                n = m["num_tokens"]
                m["entropy"] = float(entropy.sum()) / max(n, 1)
                for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "ratio_mean", "is_ratio_mean",
                            "is_truncated", "kl", "entropy"):
                    sums[key] = sums.get(key, 0.0) + m[key] * n
                loss_total += m["loss"]
                is_max = max(is_max, m["is_ratio_max"])
            grad_norm = float(self.accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf")))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        sums, loss_total, is_max = self._across_ranks(sums, loss_total, is_max)

        self.version += 1
        self.cursor = batch.cursor
        weight = max(totals.num_tokens * cfg.num_iterations, 1)
        metrics = {key: value / weight for key, value in sums.items()}
        advantages = [abs(float(r["advantage"])) for r in batch.rows]
        signed = torch.tensor([float(r["advantage"]) for r in batch.rows], dtype=torch.float64)
        metrics["advantage_std"] = float(signed.std(unbiased=False))
        metrics["tokens_per_second"] = totals.num_tokens * cfg.num_iterations / max(time.monotonic() - t0, 1e-9)
        metrics.update({
            "loss": loss_total / cfg.num_iterations, "is_ratio_max": is_max, "grad_norm": grad_norm,
            "num_transitions": len(batch.rows), "num_tokens": totals.num_tokens,
            "reward_mean": batch.reward_mean, "advantage_abs_mean": sum(advantages) / len(advantages),
            "staleness_mean": batch.staleness_mean, "skipped_stale": batch.skipped_stale,
            "skipped_malformed": batch.skipped_malformed, "zero_advantage": batch.zero_advantage,
            "step_seconds": time.monotonic() - t0})
        return metrics

    def _pad_id(self) -> int:
        pad_id = getattr(self.tokenizer, "pad_token_id", None)
        return pad_id if pad_id is not None else 0      # masked out either way

    # ---- data parallel (module docstring, 5) -------------------------------------------------
    def _micro_batches(self, rows: list[dict], pad_id: int, device) -> tuple[list[MicroBatch], int]:
        """This rank's micro-batches and how many of them are real: the others repeat one row and
        are trained with weight 0, so that every rank runs as many passes as the busiest one."""
        acc, size = self.accelerator, self.config.micro_batch_size
        shards = shard_groups(rows, acc.num_processes) if acc.num_processes > 1 else [list(range(len(rows)))]
        mine = [rows[i] for i in shards[acc.process_index]]
        chunks = [mine[i:i + size] for i in range(0, len(mine), size)]
        live = len(chunks)
        chunks += [rows[:1]] * (max(-(-len(s) // size) for s in shards) - live)
        return [collate(c, pad_id, device) for c in chunks], live

    def _accumulating(self, micro: list[MicroBatch]):
        """Yield (i, micro-batch); all but the last run inside ``no_sync``, so DDP all-reduces the
        accumulated gradient once per pass instead of once per micro-batch."""
        for i, mb in enumerate(micro):
            with self.accelerator.no_sync(self.model) if i < len(micro) - 1 else nullcontext():
                yield i, mb

    def _across_ranks(self, sums: dict, loss_total: float, is_max: float) -> tuple[dict, float, float]:
        """The step's metric sums over every rank's share of the batch (a no-op on one process)."""
        if self.accelerator.num_processes == 1:
            return sums, loss_total, is_max
        from accelerate.utils import gather_object

        parts = gather_object([(sums, loss_total, is_max)])
        total: dict[str, float] = {}
        for part, _, _ in parts:
            for key, value in part.items():
                total[key] = total.get(key, 0.0) + value
        return total, sum(p[1] for p in parts), max(p[2] for p in parts)

    def _from_main(self, value):
        """Rank 0's ``value`` on every rank."""
        if self.accelerator.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]

    def _on_main(self, fn):
        """``fn()`` on rank 0 only (the store, checkpoints and the sync are rank 0's); every rank
        returns its result, or raises its error, so no rank is left waiting at the next collective."""
        if self.accelerator.num_processes == 1:
            return fn()
        result = error = None
        if self.accelerator.is_main_process:
            try:
                result = fn()
            except SyncError as exc:
                error = ("sync", (exc.endpoint, exc.status, exc.body, exc.attempts), getattr(exc, "__notes__", []))
                raised = exc
            except BaseException as exc:  # noqa: BLE001 -- any error, Ctrl-C included: the other ranks must hear of it, not hang
                error = ("other", f"{type(exc).__name__}: {exc}", [])
                raised = exc
        result, error = self._from_main((result, error))
        if error is None:
            return result
        if self.accelerator.is_main_process:
            raise raised
        if error[0] != "sync":
            raise RuntimeError(f"rank 0 failed: {error[1]}")
        exc = SyncError(*error[1])
        for note in error[2]:
            exc.add_note(note)
        raise exc

    # ---- checkpoints and publishing --------------------------------------------------------
    def save(self, version: int, gathered: tuple[dict, dict] | None = None) -> Path:
        """Write output_dir/v{version:06d}/: a new directory, complete once it has its name.
        Under FSDP ``gathered`` is ``_gather_full_state()``: the shards' model and optimizer state."""
        if self.sharded and gathered is None:
            raise RuntimeError("under FSDP save() needs the state every rank gathered (_gather_full_state)")
        model_state, optimizer_state = gathered if gathered is not None else (None, None)
        final = self.output_dir / f"v{version:06d}"
        if final.exists():
            raise FileExistsError(f"{final} exists: every version gets a new directory")
        tmp = self.output_dir / f".{final.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model = self.accelerator.unwrap_model(self.model)
        _untie(model)
        model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
        for f in self.model_source.iterdir():
            if f.is_file() and not _MODEL_FILES.fullmatch(f.name) and f.name != CONFIG_FILE:
                shutil.copy2(f, tmp / f.name)
        torch.save(self._resume_state(version, optimizer_state), tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(to_dict(self.config), indent=2) + "\n")
        os.replace(tmp, final)
        self.model_source = final
        return final

    def prune(self) -> None:
        """Delete all but the newest keep_checkpoints checkpoints. Called after a sync succeeded:
        until then the previous one is what vLLM falls back to if the reload fails."""
        for _, old in self.checkpoints()[:-self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
            log.debug("deleted checkpoint %s", old)

    def verify_sequence(self) -> tuple[list[int], list[float]]:
        """A fixed short token sequence and the trainer's logprobs of its tokens 1 .. n-1."""
        model = self.accelerator.unwrap_model(self.model)
        vocab = model.config.vocab_size
        ids = self.tokenizer(VERIFY_TEXT)["input_ids"][:32] if self.tokenizer is not None else []
        if len(ids) < 2 or max(ids) >= vocab:
            ids = [i % vocab for i in range(1, 33)]
        t = torch.tensor([ids], device=self.accelerator.device)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logprobs, _ = token_logprobs(model, t, torch.ones_like(t), torch.ones_like(t[:, 1:]))
        model.train(was_training)
        return ids, logprobs[0].tolist()

    def publish(self, checkpoint: Path, metrics: dict | None = None,
                expected: tuple[list[int], list[float]] | None = None) -> dict:
        """Sync ``checkpoint`` to vLLM, verify it, write policy.json and (given metrics) a train_steps row.
        ``expected``: the check's (ids, logprobs) when every rank computed them (``_expected_logprobs``)."""
        try:
            sync_metrics = self.sync.push(checkpoint, self.version)
        except SyncError:
            self.metrics.sync_failed()
            raise
        if "sync_seconds" in sync_metrics and not isinstance(self.sync, NoSync):
            self.metrics.observe_sync(sync_metrics["sync_seconds"])
        diff = None
        if self._verifies():
            ids, expected = expected or self.verify_sequence()
            diff = verify(self.config.vllm_url, self.config.served_model_name, ids, expected)
            level = logging.WARNING if diff > 1e-3 else logging.INFO
            log.log(level, "version %d: max |logprob(vLLM) - logprob(trainer)| = %.2e", self.version, diff)
        store.policy.write(self.data_dir, self.version, checkpoint)
        self.prune()
        if metrics is None:
            self.metrics.set_version(self.version)
            return {}
        row = {**metrics, **sync_metrics, "sync_max_abs_logprob_diff": diff, "run_id": self.run_id,
               "step": self.version, "policy_version": self.version, "time_unix_nano": time.time_ns()}
        names = store.TRAIN_STEP_SCHEMA.names
        store.write_table(self.data_dir, "train_steps",
                          pa.Table.from_pylist([{k: row.get(k) for k in names}], schema=store.TRAIN_STEP_SCHEMA))
        self.metrics.observe_step(row)      # the gauges change together, with the step's row
        return row

    def ensure_published(self, expected: tuple[list[int], list[float]] | None = None,
                         gathered: tuple[dict, dict] | None = None) -> None:
        """After a crash between save and publish, publish the checkpoint the trainer resumed from;
        with sync 'lora', publish the current adapter on every start. ``expected``: as for publish;
        ``gathered``: as for save (under FSDP, for the version-0 adapter)."""
        published = store.policy.read(self.data_dir)
        self.metrics.set_version(self.version)
        if self.config.sync == "lora":
            # vLLM forgets adapters loaded at run time when it restarts, and starts with none under
            # the stable name: load the current one on every start (version 0: B = 0, the base)
            self.publish(self.save(0, gathered) if self._saves_at_start() else self.model_source, expected=expected)
            return
        if published is not None and published.version == self.version:
            return
        if self.version == 0:                 # vLLM was started on the initial model: nothing to push
            store.policy.write(self.data_dir, 0, self.config.model)
        else:
            log.info("policy.json says %s, the trainer is at version %d: publishing it",
                     published and published.version, self.version)
            self.publish(self.model_source, expected=expected)

    def train_once(self) -> dict | None:
        """One step if there is a batch: returns the train_steps row, or None."""
        batch = self._on_main(lambda: store.retry_vanished(self.next_batch))
        if batch is None:
            return None
        metrics = self.step(batch)
        gathered, expected = self._gather_full_state(), self._expected_logprobs()   # collectives under FSDP
        row = self._on_main(lambda: self.publish(self.save(self.version, gathered), metrics, expected))
        log.info("version %d: %d transitions, %d tokens, loss %.4f, reward %s, clip %.3f, IS %.3f, "
                 "entropy %.3f, skipped %d stale / %d zero-advantage / %d malformed, %.2f s + sync %.2f s",
                 self.version, row["num_transitions"], row["num_tokens"], row["loss"], row["reward_mean"],
                 row["clip_ratio"], row["is_ratio_mean"], row["entropy"], row["skipped_stale"],
                 row["zero_advantage"], row["skipped_malformed"], row["step_seconds"], row["sync_seconds"])
        return row


def _untie(model) -> None:
    """vLLM's in-place reload leaves a tied lm_head stale (FACTS.md): give it its own copy."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None:
        return
    if head.weight is embed.weight:
        log.warning("untying the model's embeddings: lm_head gets its own copy of embed_tokens")
        head.weight = torch.nn.Parameter(embed.weight.detach().clone())
    model.config.tie_word_embeddings = False      # or save_pretrained would drop lm_head.weight


def _set_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def numbered_optimizer_state(state: dict, names: list[str]) -> dict:
    """An optimizer state keyed by parameter name (torch.distributed.checkpoint's full state dict)
    -> the same numbered as ``optimizer.state_dict()`` numbers it: the i-th parameter of ``names``."""
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def named_optimizer_state(state: dict, names: list[str]) -> dict:
    """The inverse of :func:`numbered_optimizer_state`."""
    if len({p for group in state["param_groups"] for p in group["params"]}) != len(names):
        raise ValueError(f"the checkpoint's optimizer holds {sum(len(g['params']) for g in state['param_groups'])} "
                         f"parameters, the model trains {len(names)}: not this model's checkpoint")
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


def _fsdp_on_cpu(accelerator) -> None:
    """Run an FSDP launch on a machine without CUDA as FSDP2 over gloo, not as plain DDP.

    accelerate (1.15) selects FSDP only for GPU-like process groups (AcceleratorState, state.py):
    launched with deploy/accelerate/fsdp.yaml on CPUs it would silently train with DDP (MULTI_CPU).
    torch's FSDP2 (``fully_shard``) shards CPU tensors over gloo, so select it the way accelerate
    does on GPUs: the plugin from the launcher's FSDP_* environment, and the distributed type in
    both shared states (AcceleratorState re-reads PartialState's). tests/trainer/test_fsdp.py runs
    FSDP this way; on GPUs accelerate has already chosen FSDP and this does nothing.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"        # set by accelerate launch
    if state.distributed_type != DistributedType.MULTI_CPU or not fsdp:
        return
    plugin = FullyShardedDataParallelPlugin()
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if accelerator.is_main_process:
        log.info("FSDP on CPU: FSDP%d over %s (accelerate would fall back to DDP)", plugin.fsdp_version,
                 torch.distributed.get_backend())


def run(config: TrainerConfig) -> int:
    """``lightspan train``: once, continuously, or every ``config.every``; returns the exit code
    (a process of a multi-process run exits with it instead: :func:`_leave`)."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    trainer = Trainer(config)
    if not _distributed():
        return _run(trainer, config)
    code = 1
    try:
        code = _run(trainer, config)
    except ConfigError as e:  # as ``lightspan`` answers a bad config: exit 2, naming the field
        log.error("%s", e)
        code = 2
    except BaseException:
        log.exception("the trainer failed on this rank")
    _leave(code)


def _run(trainer: Trainer, config: TrainerConfig) -> int:
    """Refuse what is not supported, load the checkpoint or the model, then train."""
    if trainer.accelerator.distributed_type.value == "DEEPSPEED":
        # save() writes rank 0's model and optimizer: ZeRO's partitions are gathered only for FSDP
        log.error("DEEPSPEED is not supported yet: checkpoints do not gather ZeRO-partitioned weights and "
                  "optimizer state; launch with deploy/accelerate/fsdp.yaml (sharded) or ddp.yaml")
        return 2
    if trainer.sharded and trainer.accelerator.state.fsdp_plugin.fsdp_version != 2:
        log.error("FSDP version %d is not supported: set fsdp_version: 2 (deploy/accelerate/fsdp.yaml)",
                  trainer.accelerator.state.fsdp_plugin.fsdp_version)
        return 2
    if not trainer.accelerator.is_main_process:      # rank 0 logs for the run
        logging.getLogger("lightspan").setLevel(logging.WARNING)
    elif trainer.accelerator.num_processes > 1:
        log.info("data parallel over %d processes (%s)", trainer.accelerator.num_processes,
                 trainer.accelerator.distributed_type.value)
    trainer.load_or_init()
    return _train(trainer, config)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _leave(code: int) -> NoReturn:
    """End a process of a multi-process run here, without tearing torch.distributed down.

    Two teardowns have failed after runs that succeeded. A process group left for interpreter exit
    can abort the process ("terminate called without an active exception"). Destroying the group
    or the DDP reducer that holds it can deadlock: ``ProcessGroupGloo``'s destructor joins its
    worker threads while holding the GIL, and a worker releasing a tensor waits for the GIL (seen
    in CI: the rank hung until the launcher's timeout). Everything the run writes (checkpoints,
    Parquet, logs) is on disk by now, and after a run that succeeded every rank has passed the
    final barrier. So the streams are flushed and the process exits with ``code``; after a
    failure the launcher stops the other ranks, as it does for any worker that exits non-zero.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _train(trainer: Trainer, config: TrainerConfig) -> int:
    """The run itself: publish the starting policy, then train once, continuously or on a schedule."""
    stop = threading.Event()
    previous = _install_stop_handlers(stop)
    server = None
    try:
        # collectives under FSDP, so every rank takes part before rank 0 publishes
        expected = trainer._expected_logprobs()
        gathered = trainer._gather_full_state() if trainer._saves_at_start() else None
        trainer._on_main(lambda: trainer.ensure_published(expected, gathered))
        # /metrics answers (the compose health check) once the policy is served, never before
        server = start_server(trainer.metrics, config.metrics_host, config.metrics_port) \
            if trainer.accelerator.is_main_process else None
        if config.mode == "once":
            if trainer.train_once() is None:
                log.info("nothing to train: fewer than %d new trainable transitions in %s",
                         config.min_transitions, trainer.data_dir)
            trainer.accelerator.wait_for_everyone()
            return 0
        period = parse_duration(config.every) if config.mode == "every" else config.poll_interval_s
        steps, deadline = 0, time.monotonic()
        with progress(f"training ({config.mode})", config.max_steps or None, unit="steps",
                      show=trainer.accelerator.is_main_process) as bar:
            while not trainer._from_main(stop.is_set()):     # ranks stop together, at rank 0's signal
                row = trainer.train_once()
                steps += row is not None
                if row is not None:
                    bar.advance()
                    reward = row.get("reward_mean")
                    bar.update(f"version {row['policy_version']}"
                               + ("" if reward is None else f", reward {reward:.3f}"))
                if config.max_steps and steps >= config.max_steps:
                    log.info("stopping after %d steps (max_steps)", steps)
                    break
                if config.mode == "continuous":
                    if row is None:              # more data may be waiting: poll again only when idle
                        stop.wait(period)
                else:
                    if row is None:
                        log.info("nothing to train this round")
                    deadline = max(deadline + period, time.monotonic())   # a step past its slot skips ticks
                    stop.wait(deadline - time.monotonic())
        trainer.accelerator.wait_for_everyone()   # no rank leaves while a peer still talks to it
        return 0
    except SyncError as exc:
        log.error("%s", exc)
        return 1
    finally:
        _restore_handlers(previous)
        if server is not None:
            server.stop()


def _install_stop_handlers(stop: threading.Event) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame):
        if stop.is_set():                    # a second signal: stop now
            raise KeyboardInterrupt
        log.info("%s: finishing the current step, then stopping", signal.Signals(signum).name)
        stop.set()

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
