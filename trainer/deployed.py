"""What the canary decisions (``deployments``: lightspan.store.deployments, rollout/canary.py) ask
of the trainer.

1. **Keep what serves.** The serving version and the candidate are both called while a canary
   runs: LoRA weight sync does not unload their versioned adapters after a push, and pruning keeps
   their checkpoints (the gateway loads an arm's adapter from its checkpoint into a replica that
   lacks it). :func:`in_use`.
2. **Train from what serves.** A rolled-back version is not built upon: when the version the
   trainer stands at is rolled back, its next step starts from the serving version's weights and
   optimizer state (:func:`restore`), as a new version (version numbers never repeat: the next is
   one above the rolled-back one). The transitions the rolled-back version was trained on stay
   consumed; the cursor does not move back. Done once per rolled-back version in a process, and
   again after a restart that resumes from that version's checkpoint. Under FSDP (sharded
   parameters and optimizer state) the restore is refused with an error in the log: stop the
   trainer and start it from the serving checkpoint instead. When what serves is not a trainer
   checkpoint (the initial model directory of a run with reload sync), a warning says so and
   training goes on from the rolled-back version.
3. **Wait for the decision** (``hold_while_canary``, on by default). While the version the trainer
   stands at is the undecided canary, a round trains and publishes nothing (:func:`hold_reason`,
   :func:`follow`): a newer version would replace the canary before its decision (the gateway
   makes every newer version the candidate), and at a traffic's pace a decision can take longer
   than a schedule's period, so no canary would ever be decided. The transitions wait; once the
   canary is promoted or rolled back the next round trains on them (after a rollback, from the
   serving version: 2.). A canary of another version (the gateway has not yet planned the
   trainer's newer one, or the trainer resumed an older checkpoint) holds nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lightspan.store import deployments
from lightspan.trainer import checkpoints as ckpt
from lightspan.trainer.lora import is_adapter

log = logging.getLogger(__name__)


def current(data_dir, policy: str | None) -> deployments.Deployment | None:
    """The deployment of ``policy`` (None: the unnamed one), or None before any decision."""
    try:
        return deployments.state(data_dir).get(policy or "")
    except FileNotFoundError:
        return None


def in_use(d: deployments.Deployment | None) -> dict[int, Path]:
    """The versions vLLM must keep serving now, with their checkpoints: the serving one and the candidate."""
    if d is None:
        return {}
    arms = ((d.serving, d.serving_checkpoint), (d.candidate, d.candidate_checkpoint))
    return {v: Path(p).resolve() for v, p in arms if v is not None and p}


def rolled_back_to(d: deployments.Deployment | None, version: int) -> Path | None:
    """The serving version's checkpoint when ``version`` is rolled back (and one serves), else None."""
    if d is None or version not in d.rolled_back or d.serving is None or not d.serving_checkpoint:
        return None
    path = Path(d.serving_checkpoint)
    return path if (path / ckpt.STATE_FILE).is_file() else None


def restore(model, optimizer, checkpoint: Path, *, adapter: str, learning_rate: float, weight_decay: float) -> None:
    """Set ``model`` (unwrapped) and ``optimizer`` to ``checkpoint``'s weights and optimizer state: the
    LoRA adapter ``adapter`` for an adapter checkpoint, every weight for a full one."""
    if is_adapter(checkpoint):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        files = sorted(checkpoint.glob("adapter_model*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{checkpoint} has no adapter_model.safetensors")
        weights = {k: v for f in files for k, v in load_file(str(f)).items()}
        result = set_peft_model_state_dict(model, weights, adapter_name=adapter)
        unexpected = getattr(result, "unexpected_keys", None) or []
        if unexpected:
            raise ValueError(f"{checkpoint}: adapter weights the model lacks: {unexpected[:3]}")
    else:
        source = ckpt.load_model(checkpoint)
        missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
        if unexpected or [k for k in missing if "lora_" not in k]:
            raise ValueError(f"{checkpoint}: weights do not match the model (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    optimizer.load_state_dict(ckpt.read_state(checkpoint)["optimizer"])
    for group in optimizer.param_groups:      # the config, not the checkpoint, sets these (as on resume)
        group.update(lr=learning_rate, weight_decay=weight_decay)


def follow_rollback(trainer, d: deployments.Deployment | None = None) -> bool:
    """If ``trainer``'s version was rolled back, restore the serving version into it (once per
    version in this process); whether it did. ``d``: the policy's deployment, read here if not given."""
    version = trainer.version
    if version in trainer.restored:
        return False
    d = d or current(trainer.data_dir, trainer.policy)
    checkpoint = rolled_back_to(d, version)
    if checkpoint is None:
        if d is not None and version in d.rolled_back:
            trainer.restored.add(version)
            log.warning("version %d was rolled back, but what serves (%s) is not a trainer checkpoint to go on "
                        "from: training goes on from version %d; restart the trainer from a checkpoint to change "
                        "that", version, d.serving_checkpoint or "nothing", version)
        return False
    trainer.restored.add(version)
    if trainer.sharded:
        log.error("version %d was rolled back, but under FSDP the trainer cannot restore %s in place: "
                  "stop it and start it from that checkpoint", version, checkpoint)
        return False
    cfg = trainer.config
    restore(trainer.accelerator.unwrap_model(trainer.model), trainer.optimizer, checkpoint,
            adapter=trainer.policy or "default", learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay)
    log.warning("%sversion %d was rolled back: training goes on from the serving version's checkpoint %s "
                "(the next version is %d)", f"{trainer.policy}: " if trainer.policy else "", version, checkpoint,
                version + 1)
    return True


def hold_reason(d: deployments.Deployment | None, version: int, *, enabled: bool = True) -> str | None:
    """Why a round must not train on from ``version`` (the trainer's latest published version): it
    is the undecided canary of deployment ``d``; None (train) when it is not, or ``enabled`` is off."""
    if not enabled or d is None or d.candidate != version or d.decided(version):
        return None
    return f"holding version {version + 1}: the canary of version {version} is not decided yet"


def follow(trainer) -> bool:
    """Before a round's step: follow a rollback (:func:`follow_rollback`), then whether to hold
    (:func:`hold_reason`; rank 0 decides for every rank). A hold is logged once and counted each round."""
    d = current(trainer.data_dir, trainer.policy)      # the deployment state, read once a round
    follow_rollback(trainer, d)
    reason = trainer.from_main(hold_reason(d, trainer.version, enabled=trainer.config.hold_while_canary))
    if reason is None:
        trainer.holding = None
        return False
    if trainer.holding != trainer.version:
        trainer.holding = trainer.version
        log.info("%s%s", f"{trainer.policy}: " if trainer.policy else "", reason)
    trainer.metrics.round_held()
    return True
