"""Read at start-up by every Python process of the vLLM server lightspan starts.

lightspan/inference.py puts this folder first on the server's ``PYTHONPATH`` (only the server's:
lightspan never imports vllm), so the API server, its engine core and the engine's worker, which
vLLM starts with ``spawn`` on CPU, all read it. It imports nothing of vLLM's: it waits for vLLM to
import its shared-memory message queue and then sets two of its values.

The queue's readers (the engine core waiting for its worker's output, the worker waiting for the
next step) busy-wait after a read, calling ``sched_yield`` in a loop, for ``SpinCondition``'s
``busy_loop_s`` (vLLM: 1 s), then sleep until the writer's notification or, at the latest, for
``SHM_READER_RECHECK_INTERVAL_MS`` (vLLM: 5 s), when they look at the queue again. On a GPU a step
takes milliseconds; on a CPU the worker's decode step takes 0.1-0.3 s, so the engine core spins a
whole core all the while, beside the worker that needs it (docs/architecture.md, "Inference").

- ``LIGHTSPAN_VLLM_READER_SPIN_S``: the busy wait, in seconds.
- ``LIGHTSPAN_VLLM_READER_RECHECK_S``: the longest sleep, in seconds. vLLM's notifications are best
  effort: its writer's socket drops one sent within about a millisecond of the last (a high-water
  mark of 1), and a reader that slept through it waits for the recheck. With vLLM's 1 s busy wait
  that happens only after an idle second; with a short one it can happen at any step of a small
  fast model, so the recheck must be short too (measured: bench/README.md, "vLLM's queue readers").

Unset, vLLM's own. vLLM 0.32 has no setting for either; an open pull request
(vllm-project/vllm#52814) would add ``VLLM_SHM_BROADCAST_BUSY_LOOP_S``, which lightspan/inference.py
should set instead once the pinned vLLM has it.
"""

import importlib.util
import inspect
import os
import sys
import warnings

_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
_SPIN = os.environ.get("LIGHTSPAN_VLLM_READER_SPIN_S", "")
_RECHECK = os.environ.get("LIGHTSPAN_VLLM_READER_RECHECK_S", "")


def _set_spin(module) -> None:
    """``SpinCondition``'s ``busy_loop_s`` default made ``_SPIN``, where the class is as expected."""
    cls = getattr(module, "SpinCondition", None)
    init = cls.__init__ if isinstance(cls, type) else None
    try:
        params = list(inspect.signature(init).parameters) if init is not None else []
    except (TypeError, ValueError):
        params = []
    if params[-1:] != ["busy_loop_s"] or not init.__defaults__:
        warnings.warn(f"lightspan: vLLM's {_MODULE}.SpinCondition has no busy_loop_s last: its readers "
                      "keep vLLM's busy wait", RuntimeWarning, stacklevel=1)
        return
    init.__defaults__ = (*init.__defaults__[:-1], float(_SPIN))


def _set_recheck(module) -> None:
    """The module's ``SHM_READER_RECHECK_INTERVAL_MS`` made ``_RECHECK``, where it is an int."""
    if type(getattr(module, "SHM_READER_RECHECK_INTERVAL_MS", None)) is not int:
        warnings.warn(f"lightspan: vLLM's {_MODULE} has no SHM_READER_RECHECK_INTERVAL_MS: its readers keep "
                      "vLLM's recheck", RuntimeWarning, stacklevel=1)
        return
    module.SHM_READER_RECHECK_INTERVAL_MS = max(1, round(float(_RECHECK) * 1000))


def _settle(module) -> None:
    if _SPIN:
        _set_spin(module)
    if _RECHECK:
        _set_recheck(module)


class _Finder:
    """A meta path finder for the one module: its spec, with the values set once it has run."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(_Finder)         # (once; the other finders find it)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _settle(module)

        spec.loader.exec_module = exec_module   # (this module's own loader object)
        return spec


if _SPIN or _RECHECK:
    float(_SPIN or 0), float(_RECHECK or 0)     # (a bad value fails here, at the server's start)
    sys.meta_path.insert(0, _Finder)
