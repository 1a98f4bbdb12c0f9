"""Agent-side helpers: a rollout root span and a reward emitter.

Both work with and without ``opentelemetry-instrument``: they use whatever tracer provider is
installed (a no-op one when there is none). This package is imported inside agent processes, so
it imports only the OpenTelemetry API: never torch, duckdb or the store.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from collections.abc import Iterator, Mapping

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


@contextlib.contextmanager
def rollout(task_id: str, *, rollout_id: str | None = None, split: str | None = None,
            attributes: Mapping[str, object] | None = None) -> Iterator[trace.Span]:
    """Open the root span of one rollout (one episode of one agent on one task).

    Usable as a context manager or a decorator. Without it, rollouts are grouped by the
    resource attributes the runner sets, falling back to the trace id.
    """
    attrs = {semconv.ROLLOUT_ID: rollout_id or uuid.uuid4().hex, semconv.TASK_ID: str(task_id)}
    if split:
        attrs[semconv.SPLIT] = split
    attrs.update(attributes or {})
    with trace.get_tracer(_TRACER_NAME).start_as_current_span(semconv.SPAN_ROLLOUT, attributes=attrs) as span:
        yield span
