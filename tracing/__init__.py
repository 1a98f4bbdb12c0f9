"""Agent-side helpers: a rollout root span and a reward emitter.

Both work with and without ``opentelemetry-instrument``: they use whatever tracer provider is
installed (a no-op one when there is none). This package is imported inside agent processes, so
it imports only the OpenTelemetry API: never torch, duckdb or the store.
"""

from __future__ import annotations

import functools
import inspect
import math
import uuid
from collections.abc import Mapping

from opentelemetry import trace

from lightspan.tracing import semconv

__all__ = ["emit_reward", "rollout", "semconv"]

_TRACER_NAME = "lightspan.tracing"


def emit_reward(value: float, *, name: str = "reward", attributes: Mapping[str, object] | None = None) -> None:
    """Record a reward as a ``lightspan.reward`` span under the current span.

    The rollout it belongs to comes from the enclosing :func:`rollout` span or from the
    process's resource (``OTEL_RESOURCE_ATTRIBUTES=lightspan.rollout.id=…``, as
    ``lightspan rollout`` sets it). Call it once at the end of a rollout for its final reward, or
    after each step for intermediate rewards (the ``discounted`` credit policy uses them).
    """
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward must be a finite number, got {value!r}")
    attrs = {semconv.REWARD: reward, semconv.REWARD_NAME: str(name)}
    attrs.update(attributes or {})
    with trace.get_tracer(_TRACER_NAME).start_as_current_span(semconv.SPAN_REWARD, attributes=attrs):
        pass


class rollout:  # noqa: N801 (used like a function: ``with rollout(...)`` / ``@rollout(...)``)
    """Open the root span of one rollout (one episode of one agent on one task).

    A context manager (``with rollout("task-7") as span:``) or a decorator of a sync or an async
    function (``@rollout("task-7")``); a decorated function opens a new rollout, with a new id
    unless ``rollout_id`` is given, on every call. Without it, rollouts are grouped by the resource
    attributes the runner sets, falling back to the trace id. With no tracer provider configured it
    does nothing, and raises nothing.
    """

    def __init__(self, task_id: str, *, rollout_id: str | None = None, split: str | None = None,
                 attributes: Mapping[str, object] | None = None):
        self.task_id, self.rollout_id, self.split = str(task_id), rollout_id, split
        self.attributes = dict(attributes or {})
        self._open: list = []  # one entry per active `with`: the object may be re-entered

    def _attributes(self) -> dict:
        attrs = {semconv.ROLLOUT_ID: self.rollout_id or uuid.uuid4().hex, semconv.TASK_ID: self.task_id}
        if self.split:
            attrs[semconv.SPLIT] = self.split
        attrs.update(self.attributes)
        return semconv.genai(attrs)

    def _span(self):
        return trace.get_tracer(_TRACER_NAME).start_as_current_span(semconv.SPAN_ROLLOUT, attributes=self._attributes())

    def __enter__(self) -> trace.Span:
        cm = self._span()
        span = cm.__enter__()
        self._open.append(cm)
        return span

    def __exit__(self, *exc):
        return self._open.pop().__exit__(*exc)

    def __call__(self, func):
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def run_async(*args, **kwargs):
                with self._span():
                    return await func(*args, **kwargs)
            return run_async

        @functools.wraps(func)
        def run(*args, **kwargs):
            with self._span():
                return func(*args, **kwargs)
        return run
