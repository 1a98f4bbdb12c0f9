"""What the instrumentor patches, and how it undoes it: the clients' ``post`` and the JSON decoding
of their HTTP libraries.

openai 3.x and anthropic 2.x are built on ``httpx2``, openai 1.x/2.x and older anthropic releases on
``httpx``; each library's ``Response.json`` that is imported when a client library is wrapped gets
the hook (a client of an HTTP library not hooked is read from its parsed objects, and an Anthropic
call through it is not converted: :func:`hooked`).
"""

from __future__ import annotations

import functools
import importlib
import sys

from opentelemetry.instrumentation.utils import unwrap
from wrapt import wrap_function_wrapper

_WRAPPED: dict[tuple[str, str], object] = {}          # (module, "Class.method") -> the wrapper
_JSON_HOOKS: list[tuple[type, object, object]] = []   # (class, the hook, the original ``json``)


def wrap(module: str, name: str, wrapper) -> None:
    """``wrap_function_wrapper``, once per target (instrument() may run again before an import)."""
    if (module, name) not in _WRAPPED:
        wrap_function_wrapper(module, name, wrapper)
        _WRAPPED[(module, name)] = wrapper


def unwrap_all() -> None:
    while _WRAPPED:
        (module, name), _ = _WRAPPED.popitem()
        owner_name, _, method = name.rpartition(".")
        owner = getattr(importlib.import_module(module), owner_name)
        unwrap(owner, method)


def install_json_hooks(factory) -> None:
    """Hook ``Response.json`` of each HTTP library imported by now (each once)."""
    done = {cls for cls, *_ in _JSON_HOOKS}
    for module in ("httpx2", "httpx"):
        mod = sys.modules.get(module)
        cls = getattr(mod, "Response", None) if mod is not None else None
        if cls is None or cls in done:
            continue
        original = cls.__dict__.get("json")
        if original is None:
            continue
        hook = factory(original)
        cls.json = hook
        _JSON_HOOKS.append((cls, hook, original))
    hooked.cache_clear()


def remove_json_hooks() -> None:
    while _JSON_HOOKS:
        cls, hook, original = _JSON_HOOKS.pop()
        if cls.__dict__.get("json") is hook:  # else another library wrapped it since: ours stays, inert
            cls.json = original
    hooked.cache_clear()


@functools.lru_cache(maxsize=16)
def hooked(response_class: type) -> bool:
    """Whether JSON decoding of ``response_class`` (an HTTP library's Response) is hooked (asked per
    captured call; cached until the hooks change)."""
    return any(issubclass(response_class, cls) for cls, *_ in _JSON_HOOKS)
