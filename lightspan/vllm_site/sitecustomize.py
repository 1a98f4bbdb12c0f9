"""Read at start-up by every Python process of the vLLM server lightspan starts.

lightspan/inference.py puts this folder first on the server's ``PYTHONPATH`` (only the server's:
lightspan never imports vllm), so the API server, its engine core and the engine's worker, which
vLLM starts with ``spawn`` on CPU, all read it. It imports nothing of vLLM's: it waits for vLLM to
import its shared-memory message queue and then sets one default.

The setting: how long a reader of that queue (the engine core waiting for its worker's output, the
worker waiting for the next step) busy-waits after a read, calling ``sched_yield`` in a loop, before
it sleeps on the writer's notification (vLLM's ``SpinCondition``, ``busy_loop_s``: 1 s). On a GPU the
wait is microseconds; on a CPU the worker's decode step takes 0.1-0.3 s, so the engine core spins a
whole core all the while, beside the worker that needs it (docs/architecture.md, "Inference").
``LIGHTSPAN_VLLM_READER_SPIN_S``: the seconds; unset, vLLM's own. Sleeping on the notification is
what vLLM's readers do after their busy spell anyway; nothing else changes. vLLM 0.32 has no setting
for it; an open pull request (vllm-project/vllm#52814) would add ``VLLM_SHM_BROADCAST_BUSY_LOOP_S``,
which lightspan/inference.py should set instead once the pinned vLLM has it.
"""

import importlib.util
import inspect
import os
import sys
import warnings

_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
_SPIN = os.environ.get("LIGHTSPAN_VLLM_READER_SPIN_S", "")


def _set_spin(module) -> None:
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


class _Finder:
    """A meta path finder for the one module: its spec, with the default set once it has run."""

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
            _set_spin(module)

        spec.loader.exec_module = exec_module   # (this module's own loader object)
        return spec


if _SPIN:
    float(_SPIN)                                # (a bad value fails here, at the server's start)
    sys.meta_path.insert(0, _Finder)
