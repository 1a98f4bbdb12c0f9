"""``rollout`` and ``emit_reward``: context manager and decorator, with an SDK and without one."""

from __future__ import annotations

import asyncio
import contextlib
import inspect

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightspan.tracing import emit_reward, rollout, semconv


@contextlib.contextmanager
def _global_provider(provider):
    previous = trace._TRACER_PROVIDER  # the API allows setting the global provider only once
    trace._TRACER_PROVIDER = provider
    try:
        yield
    finally:
        trace._TRACER_PROVIDER = previous


@pytest.fixture()
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with _global_provider(provider):
        yield exporter


def _by_name(exporter, name):
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_context_manager(spans):
    with rollout("t1", rollout_id="r1", split="val", attributes={"agent": "a"}) as span:
        assert span.is_recording()
        emit_reward(1.0, name="final")
    (root,) = _by_name(spans, semconv.SPAN_ROLLOUT)
    assert dict(root.attributes) == {semconv.ROLLOUT_ID: "r1", semconv.TASK_ID: "t1", semconv.SPLIT: "val",
                                     "agent": "a"}
    (reward,) = _by_name(spans, semconv.SPAN_REWARD)
    assert reward.parent.span_id == root.context.span_id
    assert reward.attributes[semconv.REWARD_NAME] == "final"


def test_sync_decorator_opens_a_new_rollout_per_call(spans):
    @rollout("t2")
    def episode(x):
        emit_reward(x)
        return x * 2

    assert episode.__name__ == "episode"
    assert [episode(1), episode(2)] == [2, 4]
    roots = _by_name(spans, semconv.SPAN_ROLLOUT)
    assert len({r.attributes[semconv.ROLLOUT_ID] for r in roots}) == 2
    assert {r.attributes[semconv.TASK_ID] for r in roots} == {"t2"}
    rewards = _by_name(spans, semconv.SPAN_REWARD)
    assert [w.parent.span_id for w in rewards] == [r.context.span_id for r in roots]


def test_async_decorator_spans_the_awaited_body(spans):
    @rollout("t3", rollout_id="r3")
    async def episode():
        await asyncio.sleep(0)  # the body runs after the first suspension still inside the rollout
        emit_reward(0.5)
        return "done"

    assert inspect.iscoroutinefunction(episode)
    assert asyncio.run(episode()) == "done"
    (root,) = _by_name(spans, semconv.SPAN_ROLLOUT)
    (reward,) = _by_name(spans, semconv.SPAN_REWARD)
    assert reward.parent.span_id == root.context.span_id
    assert root.end_time >= reward.end_time


def test_exceptions_propagate_and_mark_the_rollout(spans):
    @rollout("t4")
    def failing():
        raise RuntimeError("agent crashed")

    with pytest.raises(RuntimeError):
        failing()
    (root,) = _by_name(spans, semconv.SPAN_ROLLOUT)
    assert root.status.status_code.name == "ERROR"


@pytest.mark.parametrize("provider", [None, trace.NoOpTracerProvider()], ids=["unset", "no-op"])
def test_without_an_sdk_nothing_raises(provider):
    @rollout("t5")
    def sync_episode():
        emit_reward(1.0)
        return 1

    @rollout("t5")
    async def async_episode():
        emit_reward(1.0)
        return 2

    with _global_provider(provider):
        with rollout("t5") as span:
            emit_reward(0.0)
        assert not span.is_recording()
        assert sync_episode() == 1 and asyncio.run(async_episode()) == 2


def test_reward_must_be_finite():
    with pytest.raises(ValueError):
        emit_reward(float("inf"))
