"""The trainer's distributed plumbing: what a multi-process run (``accelerate launch``) adds.

Rank 0 alone reads the store, checkpoints, syncs and writes train_steps; the other ranks train on
their share of each batch and take part in every collective (the loop's module docstring,
choices 5 and 6). Here:

- across ranks: :func:`from_main` (rank 0's value on every rank), :func:`on_main` (a function run
  on rank 0 whose result, or error, every rank gets), :func:`across_ranks` (the step's metric
  sums over every rank), :func:`accumulating` (one gradient all-reduce per pass);
- FSDP: :func:`fsdp_on_cpu` (FSDP2 over gloo on a machine without CUDA),
  :func:`gather_full_state` and :func:`load_sharded_optimizer` (checkpoints in one layout whatever
  the launch);
- the process: :func:`distributed`, :func:`leave` (how a rank exits) and :func:`launch_problem`
  (launches the trainer refuses).

On one process every helper is a no-op or a plain call.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import nullcontext
from typing import NoReturn

import torch

from lightspan.trainer.checkpoints import named_optimizer_state, numbered_optimizer_state
from lightspan.trainer.sync import SyncError

log = logging.getLogger(__name__)


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def leave(code: int) -> NoReturn:
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


def launch_problem(accelerator) -> str | None:
    """Why this launch cannot train, or None."""
    if accelerator.distributed_type.value == "DEEPSPEED":
        # save() writes rank 0's model and optimizer: ZeRO's partitions are gathered only for FSDP
        return ("DEEPSPEED is not supported yet: checkpoints do not gather ZeRO-partitioned weights and "
                "optimizer state; launch with deploy/accelerate/fsdp.yaml (sharded) or ddp.yaml")
    if accelerator.distributed_type.value == "FSDP" and accelerator.state.fsdp_plugin.fsdp_version != 2:
        return (f"FSDP version {accelerator.state.fsdp_plugin.fsdp_version} is not supported: set "
                "fsdp_version: 2 (deploy/accelerate/fsdp.yaml)")
    return None


def fsdp_on_cpu(accelerator) -> None:
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


def gather_full_state(accelerator, model, optimizer, *, param_names: list[str],
                      lora: bool) -> tuple[dict, dict] | None:
    """The full model state dict and the optimizer state (numbered as ``optimizer.state_dict()``
    numbers it), gathered from every rank's FSDP shards onto rank 0's CPU. A collective: every
    rank calls it; rank 0 gets the pair, the others None. ``lora``: the adapter only (the frozen
    base is config.model)."""
    from torch.distributed.checkpoint import state_dict as dcp

    options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora)
    model_state = dcp.get_model_state_dict(model, options=options)
    optimizer_state = dcp.get_optimizer_state_dict(model, optimizer.optimizer, options=options)
    if not accelerator.is_main_process:
        return None
    return model_state, numbered_optimizer_state(optimizer_state, param_names)


def load_sharded_optimizer(accelerator, model, optimizer, saved: dict, *, param_names: list[str]) -> None:
    """Give each rank its shard of a checkpoint's full optimizer state: rank 0 broadcasts it."""
    from torch.distributed.checkpoint import state_dict as dcp

    full = named_optimizer_state(saved, param_names) if accelerator.is_main_process else {}
    dcp.set_optimizer_state_dict(model, optimizer.optimizer, full,
                                 options=dcp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def accumulating(accelerator, model, micro: list):
    """Yield (i, micro-batch); all but the last run inside ``no_sync``, so DDP all-reduces the
    accumulated gradient once per pass instead of once per micro-batch."""
    for i, mb in enumerate(micro):
        with accelerator.no_sync(model) if i < len(micro) - 1 else nullcontext():
            yield i, mb


def across_ranks(accelerator, sums: dict, loss_total: float, is_max: float) -> tuple[dict, float, float]:
    """The step's metric sums over every rank's share of the batch (a no-op on one process)."""
    if accelerator.num_processes == 1:
        return sums, loss_total, is_max
    from accelerate.utils import gather_object

    parts = gather_object([(sums, loss_total, is_max)])
    total: dict[str, float] = {}
    for part, _, _ in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total, sum(p[1] for p in parts), max(p[2] for p in parts)


def from_main(accelerator, value):
    """Rank 0's ``value`` on every rank."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


def on_main(accelerator, fn):
    """``fn()`` on rank 0 only (the store, checkpoints and the sync are rank 0's); every rank
    returns its result, or raises its error, so no rank is left waiting at the next collective."""
    if accelerator.num_processes == 1:
        return fn()
    result = error = None
    if accelerator.is_main_process:
        try:
            result = fn()
        except SyncError as exc:
            error = ("sync", (exc.endpoint, exc.status, exc.body, exc.attempts), getattr(exc, "__notes__", []))
            raised = exc
        except BaseException as exc:  # noqa: BLE001 -- any error, Ctrl-C included: the other ranks must hear of it, not hang
            error = ("other", f"{type(exc).__name__}: {exc}", [])
            raised = exc
    result, error = from_main(accelerator, (result, error))
    if error is None:
        return result
    if accelerator.is_main_process:
        raise raised
    if error[0] != "sync":
        raise RuntimeError(f"rank 0 failed: {error[1]}")
    exc = SyncError(*error[1])
    for note in error[2]:
        exc.add_note(note)
    raise exc
