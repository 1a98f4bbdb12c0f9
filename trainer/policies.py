"""Several policies trained side by side in one ``lightspan train``: one LoRA adapter each over one base.

With ``--policies FILE`` (lightspan/store/policies.py) :class:`PolicyTrainers` holds one
:class:`~lightspan.trainer.loop.Trainer` per policy, each with its own config (the policy's fields
over ``[trainer]``), adapter, optimizer state, data cursor, version, checkpoints
(``OUTPUT_DIR/<name>/v{N:06d}/``), train_steps rows (column ``policy``), policy.json entry and
Prometheus series (label ``policy``). They share the process, its accelerator and one peft model
over the one base model: each policy's adapter is a named adapter of it, made active (and the only
trainable one) for that policy's forward passes, saves and checks (trainer/lora.py, 4.).

A round (:meth:`PolicyTrainers.train_round`, what the driver runs once, continuously or on a
schedule) gives each policy that has a batch one step, in the file's order, and syncs that
policy's adapter at once: vLLM loads ``<name>-v<N>`` and points ``<name>`` at it in place
(trainer/sync.py, ``LoraSync``), so the other policies' served adapters are never touched and a
policy with no new data keeps serving its version. Each sync is verified against that adapter's
served logprobs.

Choices:
1. One process rather than a trainer per policy: the base is loaded (and held) once, and the
   steps are the same computation either way (bench/README.md, "Several policies": step and sync
   times per policy against one policy's). The policies step one after another, not at once.
2. Multi-process launches (``accelerate launch``) are refused with several policies: DDP and
   FSDP would wrap the one shared model once per policy. Train them in one process each
   (``--policies`` with a file of one policy each) to scale out.
3. Each policy's checkpoint holds the process's RNG state as it saved; on resume the policy loaded
   last sets it. Nothing in a LoRA step draws from it unless lora_dropout > 0.
4. ``max_steps`` counts rounds: a round that trained any policy is one step of the run.
"""

from __future__ import annotations

import logging

from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.loop import Trainer
from lightspan.trainer.metrics import PolicyMetrics

log = logging.getLogger(__name__)


class PolicyTrainers:
    """The policies of one run (module docstring); the driver's interface of :class:`Trainer`."""

    def __init__(self, config: TrainerConfig):
        if not config.policy_configs:
            raise ValueError("PolicyTrainers needs a config with policies (TrainerConfig.policies)")
        self.config = config
        first = Trainer(config.policy_configs[0][1], policy=config.policy_configs[0][0].name)
        self.trainers = [first] + [Trainer(own, policy=p.name, accelerator=first.accelerator)
                                   for p, own in config.policy_configs[1:]]
        self.accelerator = first.accelerator
        self.data_dir = first.data_dir
        self.metrics = PolicyMetrics({t.policy: t.metrics for t in self.trainers})

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def from_main(self, value):
        return self.trainers[0].from_main(value)

    def wait_for_everyone(self) -> None:
        self.accelerator.wait_for_everyone()

    def launch_problem(self) -> str | None:
        if self.accelerator.num_processes > 1:
            return (f"several policies ({', '.join(t.policy for t in self.trainers)}) train in one process, over "
                    "one shared model: launch without accelerate launch, or one process per policy (each with "
                    "a policies file of its own)")
        return self.trainers[0].launch_problem()

    def load_or_init(self) -> None:
        """Load the base once; add each policy's adapter (resumed from its newest checkpoint, or new)."""
        base = None
        for t in self.trainers:
            t.load_or_init(base=base)
            base = self.accelerator.unwrap_model(t.model)

    def start(self) -> None:
        """Publish every policy's current adapter (vLLM forgets adapters loaded at run time)."""
        for t in self.trainers:
            t.start()

    def train_round(self) -> list[dict]:
        """One step of each policy that has a batch, each synced as it finishes; their train_steps rows."""
        rows = []
        for t in self.trainers:
            row = t.train_once()
            if row is not None:
                rows.append(row)
        return rows
