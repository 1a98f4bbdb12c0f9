"""``lightspan train``: the trainer's process around :class:`~lightspan.trainer.loop.Trainer`.

:func:`run` builds the Trainer, refuses launches it cannot train (DeepSpeed, FSDP1), loads the
checkpoint or the model, publishes the starting policy, serves ``/metrics`` and then steps once,
continuously (polling when idle) or on a schedule (``every``), until ``max_steps`` or SIGINT /
SIGTERM (the current step finishes first; a second signal stops at once). With policies
(``--policies``) the Trainer is trainer/policies.py's: each round steps every policy that has data. A failed weight sync
ends the run with exit code 1 (the loop's module docstring, choice 4). Under ``accelerate launch``
every rank runs this; ranks stop together, at rank 0's signal, and exit through
``distributed.leave``.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from lightspan.core.config import ConfigError, parse_duration
from lightspan.core.progress import progress
from lightspan.core.schedule import install_stop_handlers, restore_handlers
from lightspan.trainer import distributed as dist
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.loop import Trainer
from lightspan.trainer.metrics import start_server
from lightspan.trainer.policies import PolicyTrainers
from lightspan.trainer.sync import SyncError

log = logging.getLogger(__name__)


def run(config: TrainerConfig) -> int:
    """``lightspan train``: once, continuously, or every ``config.every``; returns the exit code
    (a process of a multi-process run exits with it instead: ``distributed.leave``)."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    # several policies: one trainer per policy over one base model (trainer/policies.py)
    trainer = PolicyTrainers(config) if config.policy_configs else Trainer(config)
    if not dist.distributed():
        return _run(trainer, config)
    code = 1
    try:
        code = _run(trainer, config)
    except ConfigError as e:  # as ``lightspan`` answers a bad config: exit 2, naming the field
        log.error("%s", e)
        code = 2
    except BaseException:
        log.exception("the trainer failed on this rank")
    dist.leave(code)


def _run(trainer: Trainer | PolicyTrainers, config: TrainerConfig) -> int:
    """Refuse what is not supported, load the checkpoint or the model, then train."""
    problem = trainer.launch_problem()
    if problem:
        log.error("%s", problem)
        return 2
    if not trainer.is_main:                          # rank 0 logs for the run
        logging.getLogger("lightspan").setLevel(logging.WARNING)
    elif trainer.accelerator.num_processes > 1:
        log.info("data parallel over %d processes (%s)", trainer.accelerator.num_processes,
                 trainer.accelerator.distributed_type.value)
    trainer.load_or_init()
    return _train(trainer, config)


def _train(trainer: Trainer | PolicyTrainers, config: TrainerConfig) -> int:
    """The run itself: publish the starting policy, then train once, continuously or on a schedule."""
    stop = threading.Event()
    previous = install_stop_handlers(stop, "step")
    server = None
    try:
        trainer.start()
        # /metrics answers (the compose health check) once the policy is served, never before
        server = start_server(trainer.metrics, config.metrics_host, config.metrics_port) \
            if trainer.is_main else None
        if config.mode == "once":
            if not trainer.train_round():
                log.info("nothing to train: fewer than %d new trainable transitions in %s",
                         config.min_transitions, trainer.data_dir)
            trainer.wait_for_everyone()
            return 0
        period = parse_duration(config.every) if config.mode == "every" else config.poll_interval_s
        steps, deadline = 0, time.monotonic()
        with progress(f"training ({config.mode})", config.max_steps or None, unit="steps",
                      show=trainer.is_main) as bar:
            while not trainer.from_main(stop.is_set()):     # ranks stop together, at rank 0's signal
                rows = trainer.train_round()
                steps += bool(rows)     # with several policies a round is a step (trainer/policies.py, 4.)
                if rows:
                    bar.advance()
                    bar.update(", ".join(_describe(row) for row in rows))
                if config.max_steps and steps >= config.max_steps:
                    log.info("stopping after %d steps (max_steps)", steps)
                    break
                if config.mode == "continuous":
                    if not rows:                 # more data may be waiting: poll again only when idle
                        stop.wait(period)
                else:
                    if not rows:
                        log.info("nothing to train this round")
                    deadline = max(deadline + period, time.monotonic())   # a step past its slot skips ticks
                    stop.wait(deadline - time.monotonic())
        trainer.wait_for_everyone()   # no rank leaves while a peer still talks to it
        return 0
    except SyncError as exc:
        log.error("%s", exc)
        return 1
    finally:
        restore_handlers(previous)
        if server is not None:
            server.stop()


def _describe(row: dict) -> str:
    reward = row.get("reward_mean")
    return (f"{row['policy'] + ' ' if row.get('policy') else ''}version {row['policy_version']}"
            + ("" if reward is None else f", reward {reward:.3f}"))
