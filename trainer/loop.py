"""The training loop: new transitions in, a new policy version out, pushed to vLLM.

One step, flat (``Trainer.train_once``)::

    next_batch   transitions after the cursor, oldest first: skip (and count) the stale, the
                 malformed and the zero-advantage ones (no gradient), take <= batch_size
                 (trainer/batches.py)
    step         micro-batches -> token logprobs -> clipped, IS-corrected loss (trainer/loss.py)
                 -> accumulated gradient -> clip -> AdamW (trainer/step.py); version + 1
    save         output_dir/v{version:06d}/: safetensors + tokenizer + trainer_state.pt +
                 trainer_config.json, written to a temp dir and renamed (trainer/checkpoints.py)
    publish      weight sync (trainer/sync.py) -> verify one fixed sequence against vLLM ->
                 data_dir/policy.json (atomic) -> prune old checkpoints -> one train_steps row

Everything resume needs is in ``checkpoints.RESUME_STATE`` and saved in every checkpoint, so a
restarted trainer continues exactly: same weights, optimizer moments, RNG and data cursor.
The cursor (created_unix_nano, transition_id) moves with the checkpoint, so each transition
is trained at most once. The process around the loop (``lightspan train``: schedule, signals,
``/metrics``) is trainer/driver.py; what a multi-process launch adds is trainer/distributed.py.

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
   'nccl' (it would broadcast shards) and sync 'reload' with LoRA (it would merge into a shard).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from pathlib import Path

import pyarrow as pa
import torch

from lightspan import store
from lightspan.core.config import ConfigError
from lightspan.trainer import checkpoints as ckpt
from lightspan.trainer import deployed
from lightspan.trainer import distributed as dist
from lightspan.trainer.batches import Batch, Cursor, next_batch
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.lora import MERGED, is_adapter, save_merged, trainable_parameters, with_lora
from lightspan.trainer.loss import token_logprobs
from lightspan.trainer.metrics import TrainerMetrics, entropy_warning
from lightspan.trainer.nccl import NcclSync
from lightspan.trainer.replicas import ReplicaSync
from lightspan.trainer.step import learning_rate_at, optimise
from lightspan.trainer.sync import LoraSync, NoSync, ReloadSync, SyncError, WeightSync

log = logging.getLogger(__name__)

VERIFY_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 30 = 42."


class Trainer:
    """Model, optimizer, data cursor and RNG of one training run; see the module docstring.

    The driver (``driver.run``) uses :meth:`load_or_init`, :meth:`start`, :meth:`train_once`,
    :meth:`from_main`, :attr:`is_main` and :meth:`wait_for_everyone`.
    """

    def __init__(self, config: TrainerConfig, *, sync: WeightSync | None = None, policy: str | None = None,
                 accelerator=None):
        from accelerate import Accelerator

        self.config = config
        # a named policy (trainer/policies.py): its adapter, transitions, checkpoints and policy.json entry
        self.policy = policy
        self.data_dir = store.data_dir(config.data_dir)
        self.output_dir = Path(config.output_dir) if config.output_dir else self.data_dir / "checkpoints"
        def backend(url: str) -> WeightSync:
            # what vLLM serves before the first push, known once load_or_init has run
            return {"reload": lambda: ReloadSync(url, serving=lambda: self.served_at_start),
                    "lora": lambda: LoraSync(url, config.served_model_name, keep=lambda: deployed.in_use(
                        deployed.current(self.data_dir, self.policy))),
                    # the live tensors, not a checkpoint: the model exists after load_or_init
                    "nccl": lambda: NcclSync(url, lambda: self.accelerator.unwrap_model(self.model)),
                    }.get(config.sync, NoSync)()
        # several replicas: each gets its backend, created at its first push (trainer/replicas.py)
        self.sync = sync or (ReplicaSync(config.vllm_replicas, backend, self.data_dir) if config.vllm_replicas
                             else backend(config.vllm_url))
        self.metrics = TrainerMetrics()           # served on /metrics by driver.run()
        self.accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
        dist.fsdp_on_cpu(self.accelerator)
        self.sharded = self.accelerator.distributed_type.value == "FSDP"     # module docstring, 6
        if self.sharded and config.sync == "nccl":
            raise ConfigError("trainer", "sync", "'nccl' broadcasts rank 0's parameters, which under FSDP are "
                              "shards", "pass --sync reload (rank 0 saves the gathered weights), or launch with "
                              "deploy/accelerate/ddp.yaml")
        if self.sharded and config.sync == "reload" and config.lora_r:
            raise ConfigError("trainer", "sync", "'reload' with lora_r merges the adapter into rank 0's base, "
                              "which under FSDP is a shard", "pass --sync lora (vLLM loads the adapter), or "
                              "launch with deploy/accelerate/ddp.yaml")
        # the resume state (checkpoints.RESUME_STATE), set by load_or_init
        self.version, self.cursor, self.run_id = 0, Cursor(), ""
        self.model = self.optimizer = self.ref_model = self.tokenizer = None
        self.model_source: Path | None = None     # where tokenizer files are copied from
        self.served_at_start: Path | None = None  # what vLLM serves before the first push
        self.param_names: list[str] = []          # the optimizer's parameters, in its order
        self.restored: set[int] = set()           # rolled-back versions left for the serving one (deployed.py)
        self.holding: int | None = None           # the undecided canary a hold waits on (deployed.py)

    # ---- for the driver ---------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """Whether this process is rank 0 (the only one, without a multi-process launch)."""
        return self.accelerator.is_main_process

    def from_main(self, value):
        """Rank 0's ``value`` on every rank."""
        return dist.from_main(self.accelerator, value)

    def wait_for_everyone(self) -> None:
        """A barrier: no rank leaves while a peer still talks to it."""
        self.accelerator.wait_for_everyone()

    def start(self) -> None:
        """Publish the policy the run starts from (:meth:`ensure_published`), every rank taking part:
        under FSDP the check's logprobs and the version-0 adapter are collectives."""
        expected = self._expected_logprobs()
        gathered = self._gather_full_state() if self._saves_at_start() else None
        self._on_main(lambda: self.ensure_published(expected, gathered))

    def launch_problem(self) -> str | None:
        """Why this launch cannot train, or None."""
        return dist.launch_problem(self.accelerator)

    # ---- state ------------------------------------------------------------------------------
    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints in output_dir, oldest first."""
        return ckpt.checkpoints(self.output_dir)

    def load_or_init(self, base=None) -> None:
        """Resume from the newest checkpoint in output_dir exactly, else start at version 0.
        ``base``: another policy's peft model, to add this policy's adapter to (trainer/policies.py)."""
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
        # a LoRA checkpoint holds the adapter only: the base is config.model
        model = base if base is not None else ckpt.load_model(Path(cfg.model) if cfg.lora_r else source)
        if cfg.lora_r:
            model = with_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                              targets=cfg.lora_target_modules, seed=cfg.seed, adapter_dir=source if found else None,
                              adapter_name=self.policy or "default")
        self._activate(model)
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
            state = ckpt.read_state(source, mmap=self.sharded)
            if not self.sharded:
                optimizer.load_state_dict(state["optimizer"])
            self.version, self.cursor, self.run_id = state["version"], Cursor(*state["cursor"]), state["run_id"]
            ckpt.set_rng(state["rng"])
            log.info("resumed version %d from %s (cursor %s)", self.version, source, self.cursor)
        else:
            self.version, self.cursor, self.run_id = 0, Cursor(), self.from_main(uuid.uuid4().hex)
            torch.manual_seed(cfg.seed)
            random.seed(cfg.seed)
            log.info("starting at version 0 from %s", source)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        if state is not None and self.sharded:
            dist.load_sharded_optimizer(self.accelerator, self.model, self.optimizer, state["optimizer"],
                                        param_names=self.param_names)
        if state is not None:
            for group in self.optimizer.param_groups:   # the config, not the checkpoint, sets these
                group.update(lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        self.model_source = source
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as exc:
            log.warning("no tokenizer in %s (%s): verifying syncs with fixed token ids", source, exc)
        self.served_at_start = self._served_dir()
        if cfg.beta and not cfg.lora_r:      # with LoRA the reference is the base, adapters disabled
            ref_model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
            ref_model.requires_grad_(False).eval().to(self.accelerator.device)
            if self.sharded:                 # sharded like the policy; its forward is a collective too
                from trl.models.utils import prepare_fsdp

                ref_model = prepare_fsdp(ref_model, self.accelerator)
            self.ref_model = ref_model

    def _activate(self, model=None) -> None:
        """Make this policy's adapter the active and only trainable one (trainer/lora.py, 4.)."""
        if self.policy is not None:
            (model if model is not None else self.accelerator.unwrap_model(self.model)).set_adapter(self.policy)

    def _served(self, checkpoint: Path) -> Path:
        """What vLLM loads for ``checkpoint``: itself, or with sync 'reload' and LoRA the base with
        the adapter merged (trainer/lora.py, 5.), written from the live model, which is that version."""
        if not (self.config.lora_r and self.config.sync == "reload"):
            return checkpoint
        return save_merged(self.accelerator.unwrap_model(self.model), self.policy or "default",
                           checkpoint / MERGED, Path(self.config.model))

    def _served_dir(self) -> Path | None:
        """What vLLM most likely serves: the published checkpoint, else (at version 0) the model."""
        published = store.policy.read(self.data_dir)
        if published is not None and Path(published.path).is_dir():
            return Path(published.path)
        return Path(self.config.model) if self.version == 0 else None

    # ---- FSDP (module docstring, 6) ---------------------------------------------------------
    def _gather_full_state(self) -> tuple[dict, dict] | None:
        """Under FSDP, the model and optimizer state gathered onto rank 0 (``distributed.gather_full_state``):
        every rank calls it. None without FSDP, where rank 0 holds everything itself."""
        if not self.sharded:
            return None
        return dist.gather_full_state(self.accelerator, self.model, self.optimizer, param_names=self.param_names,
                                      lora=bool(self.config.lora_r))

    def _expected_logprobs(self) -> tuple[list[int], list[float]] | None:
        """Under FSDP a forward pass is a collective, so every rank computes the sync check's
        logprobs (``verify_sequence``) before rank 0 publishes; None otherwise (rank 0 computes them)."""
        return self.verify_sequence() if self.sharded and self._verifies() else None

    def _saves_at_start(self) -> bool:
        """With sync 'lora' a run that starts from the base saves the version-0 adapter to load it."""
        return self.config.sync == "lora" and self.model_source == Path(self.config.model)

    def _verifies(self) -> bool:
        """Whether publish checks the served logprobs against the trainer's."""
        return self.config.verify_sync and self.sync.verifies

    def _on_main(self, fn):
        return dist.on_main(self.accelerator, fn)

    # ---- data -------------------------------------------------------------------------------
    def next_batch(self) -> Batch | None:
        """The next batch after the cursor, or None if fewer than min_transitions are trainable."""
        model_config = self.accelerator.unwrap_model(self.model).config
        return next_batch(self.data_dir, self.config, version=self.version, cursor=self.cursor,
                          policy=self.policy, vocab_size=model_config.vocab_size,
                          max_len=getattr(model_config, "max_position_embeddings", None) or 2**31 - 1)

    # ---- optimisation -----------------------------------------------------------------------
    def step(self, batch: Batch) -> dict:
        """One optimizer step per pass over ``batch`` (num_iterations passes, trainer/step.py); version + 1."""
        self._activate()
        lr = learning_rate_at(self.config, self.version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        metrics = optimise(self.accelerator, self.model, self.optimizer, batch, self.config,
                           ref_model=self.ref_model, pad_id=self._pad_id())
        self.version += 1
        self.cursor = batch.cursor
        return metrics

    def _pad_id(self) -> int:
        pad_id = getattr(self.tokenizer, "pad_token_id", None)
        return pad_id if pad_id is not None else 0      # masked out either way

    # ---- checkpoints and publishing --------------------------------------------------------
    def save(self, version: int, gathered: tuple[dict, dict] | None = None) -> Path:
        """Write output_dir/v{version:06d}/ (``checkpoints.save``) and resume from it next.
        Under FSDP ``gathered`` is ``_gather_full_state()``: the shards' model and optimizer state."""
        if self.sharded and gathered is None:
            raise RuntimeError("under FSDP save() needs the state every rank gathered (_gather_full_state)")
        model_state, optimizer_state = gathered if gathered is not None else (None, None)
        state = ckpt.resume_state(version, (self.cursor.created_unix_nano, self.cursor.transition_id), self.run_id,
                                  self.optimizer.state_dict() if optimizer_state is None else optimizer_state)
        self.model_source = ckpt.save(self.output_dir, version, self.accelerator.unwrap_model(self.model),
                                      model_source=self.model_source, state=state, config=self.config,
                                      model_state=model_state, adapter=self.policy)
        return self.model_source

    def prune(self) -> None:
        """Delete all but the newest keep_checkpoints checkpoints. Called after a sync succeeded:
        until then the previous one is what vLLM falls back to if the reload fails."""
        ckpt.prune(self.output_dir, self.config.keep_checkpoints,
                   protect=set(deployed.in_use(deployed.current(self.data_dir, self.policy)).values()))

    def verify_sequence(self) -> tuple[list[int], list[float]]:
        """A fixed short token sequence and the trainer's logprobs of its tokens 1 .. n-1."""
        model = self.accelerator.unwrap_model(self.model)
        self._activate(model)
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
        checkpoint = self._served(checkpoint)
        try:
            sync_metrics = self.sync.push(checkpoint, self.version)
        except SyncError:
            self.metrics.sync_failed()
            raise
        if "sync_seconds" in sync_metrics:            # a push took place (sync 'none' times nothing)
            self.metrics.observe_sync(sync_metrics["sync_seconds"])
        diff = None
        if self._verifies():
            ids, expected = expected or self.verify_sequence()
            diff = self.sync.verify(self.config.served_model_name, ids, expected)
            level = logging.WARNING if diff > 1e-3 else logging.INFO
            log.log(level, "version %d: max |logprob(vLLM) - logprob(trainer)| = %.2e", self.version, diff)
        store.policy.write(self.data_dir, self.version, checkpoint, name=self.policy)
        self.prune()
        if metrics is None:
            self.metrics.set_version(self.version)
            return {}
        floor = self.config.entropy_floor or None
        # the step's seconds spent syncing: 0 when nothing was pushed (the histogram observes pushes only)
        row = {**metrics, "sync_seconds": 0.0, **sync_metrics, "sync_max_abs_logprob_diff": diff,
               "run_id": self.run_id, "policy": self.policy, "entropy_floor": floor,
               "entropy_below_floor": int(entropy_warning(metrics.get("entropy"), floor) is not None),
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
        published = store.policy.read(self.data_dir, self.policy)
        self.metrics.set_version(self.version)
        if self.config.sync == "lora":
            # vLLM forgets adapters loaded at run time when it restarts, and starts with none under
            # the stable name: load the current one on every start (version 0: B = 0, the base)
            self.publish(self.save(0, gathered) if self._saves_at_start() else self.model_source, expected=expected)
            return
        if published is not None and published.version == self.version:
            return
        if self.version == 0:                 # vLLM was started on the initial model: nothing to push
            store.policy.write(self.data_dir, 0, self.config.model, name=self.policy)
        else:
            log.info("policy.json says %s, the trainer is at version %d: publishing it",
                     published and published.version, self.version)
            self.publish(self.model_source, expected=expected)

    def train_once(self) -> dict | None:
        """One step if there is a batch: returns the train_steps row, or None."""
        if deployed.follow(self):              # rolled back: from what serves; an undecided canary: hold
            return None
        batch = self._on_main(lambda: store.retry_vanished(self.next_batch))
        if batch is None:
            return None
        metrics = self.step(batch)
        gathered, expected = self._gather_full_state(), self._expected_logprobs()   # collectives under FSDP
        row = self._on_main(lambda: self.publish(self.save(self.version, gathered), metrics, expected))
        log.info("%sversion %d: %d transitions, %d tokens, loss %.4f, reward %s, clip %.3f, IS %.3f, "
                 "entropy %.3f, skipped %d stale / %d zero-advantage / %d malformed, %.2f s + sync %.2f s",
                 f"{self.policy}: " if self.policy else "", self.version, row["num_transitions"], row["num_tokens"], row["loss"], row["reward_mean"],
                 row["clip_ratio"], row["is_ratio_mean"], row["entropy"], row["skipped_stale"],
                 row["zero_advantage"], row["skipped_malformed"], row["step_seconds"], row["sync_seconds"])
        if (warning := entropy_warning(row["entropy"], row["entropy_floor"])) is not None:
            log.warning("%sversion %d: %s", f"{self.policy}: " if self.policy else "", self.version, warning)
        return row

    def train_round(self) -> list[dict]:
        """What the driver calls: :meth:`train_once`'s row, if any, as a list (a round of several
        policies, trainer/policies.py, has one per policy that trained)."""
        row = self.train_once()
        return [] if row is None else [row]
