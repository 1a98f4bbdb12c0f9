"""Run an agent given as a class, the way Agent Lightning's local runner does: import
``MODULE.CLASS`` (or ``MODULE:CLASS``), call ``CLASS().run()``, and await it if it is a coroutine.

Agent Lightning's agents are classes with a ``run`` method and often no ``__main__`` (its gsm8k
example's ``ChatAgent`` and ``CompletionAgent``); this runs them unchanged under ``lightspan
rollout``, with the environment the runner gives every agent (``AGL_OPENAI_BASE_URL``,
``AGL_EVENT_URL``, ``AGL_KEY`` and the ``env_map`` variables)::

    lightspan rollout --tasks gsm8k.jsonl --env-map QUESTION=input.question,ANSWER=input.answer \\
        -- python -m lightspan.rollout.agent_class examples.gsm8k.gsm8k_agent.ChatAgent

The module is imported from the working directory (``python -m`` puts it on ``sys.path``), as
with Agent Lightning's ``PYTHONPATH`` set to its repository. The exit code is 0 when ``run``
returns, 1 (with the traceback) when it raises. Standard library only: it runs in the agent's
environment.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
import traceback


def load(path: str) -> type:
    """The class named by ``MODULE.CLASS`` or ``MODULE:CLASS``."""
    module_name, sep, class_name = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not class_name:
        raise ValueError(f"{path!r} names no class: give MODULE.CLASS or MODULE:CLASS")
    loaded = getattr(importlib.import_module(module_name), class_name)
    if not isinstance(loaded, type):
        raise TypeError(f"{path} is not a class")
    return loaded


def run(path: str) -> int:
    try:
        result = load(path)().run()
        if inspect.isawaitable(result):
            asyncio.run(result)
        return 0
    except Exception:  # the agent's own failure: a failed rollout, with its traceback in the log
        traceback.print_exc()
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.stderr.write("usage: python -m lightspan.rollout.agent_class MODULE.CLASS\n")
        return 2
    sys.path.insert(0, "")   # the working directory, also when started as a script
    return run(argv[0])


if __name__ == "__main__":
    sys.exit(main())
