"""The lightspan instrumentor: token ids and logprobs on every GenAI span, with no code change.

``opentelemetry-instrument`` loads it through the ``opentelemetry_instrumentor`` entry point.
It wraps the ``openai`` client's ``post`` (sync and async), which runs inside whichever GenAI
span the OpenAI instrumentation opened (traceloop's or OTel's), so the attributes land on it:

1. requests bound for an RL endpoint (``LIGHTSPAN_CAPTURE_URLS``, comma-separated base URLs;
   loopback addresses when unset; ``none`` when a gateway captures instead) ask vLLM for ``return_token_ids`` and sampled-token
   ``logprobs``; hosted APIs, which reject unknown fields, are never touched;
2. the response's prompt ids, completion ids (one list per choice, ``n > 1`` included) and
   logprobs are recorded as little-endian bytes (DESIGN §3.1), with the serving policy version
   (``LIGHTSPAN_MODEL_VERSION``) and ``lightspan.capture.status`` (``ok`` or why not);
3. streams (``stream=True``, sync and async, chat and completions) are tapped: the stream object
   the caller gets is the same one, its chunks are the same, and the ids collected from them are
   recorded when the stream ends — before the OpenAI instrumentation's own end-of-stream handling
   ends its span. A stream abandoned early keeps ``capture.status=stream_incomplete``;
4. when the current span is not an LLM span (no OpenAI instrumentation installed, or only an
   agent's own span), it opens a GenAI span of its own around the call;
5. when two LLM spans nest for one call (both traceloop's and OTel's OpenAI instrumentation are
   installed, or a framework's LLM span encloses the client's), the ids go on the innermost and
   the enclosing one is marked ``capture.status=duplicate`` with ``capture.duplicate_of`` = the
   inner span id. Seeing the enclosing span needs a span processor on the SDK tracer provider,
   added at ``instrument()``; with no SDK there are no spans to mark.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Collection
from contextlib import nullcontext
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.instrumentation.utils import unwrap
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.trace import Status, StatusCode
from wrapt import wrap_function_wrapper

from lightspan.tracing import semconv
from lightspan.tracing.capture import (  # noqa: F401  (re-exported: the instrumentor's API)
    Capture,
    attributes_from_response,
    operation as _operation,
    with_capture,
)

log = logging.getLogger(__name__)

_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
_TRACER_NAME = "lightspan.instrumentor"
_LLM_OPERATIONS = frozenset({"chat", "text_completion", "completion", "generate_content"})


def capture_urls() -> list[str]:
    """The configured RL endpoints; ``none`` matches no URL (the gateway captures these calls)."""
    raw = os.environ.get("LIGHTSPAN_CAPTURE_URLS", "")
    return [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]


def should_capture(base_url: str, path: str, urls: list[str]) -> bool:
    """Capture only chat/completions calls to a configured RL endpoint (loopback by default)."""
    if _operation(path) is None:
        return False
    base = str(base_url).rstrip("/")
    if urls:
        return any(base == u or base.startswith(u + "/") for u in urls)
    return (urlsplit(base).hostname or "") in _LOOPBACK


def model_version() -> int | None:
    version = os.environ.get("LIGHTSPAN_MODEL_VERSION", "").strip()
    return int(version) if version.lstrip("-").isdigit() else None


def is_llm_span(span) -> bool:
    """A live SDK span that describes one LLM call (GenAI or traceloop's older operation name)."""
    attrs = getattr(span, "attributes", None)
    if not attrs:
        return False
    op = attrs.get(semconv.GEN_AI_OPERATION_NAME) or attrs.get(semconv.LLM_REQUEST_TYPE)
    return op in _LLM_OPERATIONS


class _Nesting(SpanProcessor):
    """Remembers, for each span started under an LLM span, the nearest enclosing LLM span.

    A child span knows only its parent's id; the parent span object is in the context only at the
    moment the child starts, so it is looked up here. Weak keys: nothing outlives its span.
    """

    def __init__(self):
        self.enclosing: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.active = True

    def on_start(self, span, parent_context=None) -> None:
        if not self.active:
            return
        parent = trace.get_current_span(parent_context)
        if not parent.is_recording():
            return
        try:
            outer = parent if is_llm_span(parent) else self.enclosing.get(parent)
            if outer is not None:
                self.enclosing[span] = outer
        except TypeError:  # a span type that cannot be weakly referenced: no nesting to track
            pass


_NESTING = _Nesting()
_PROVIDERS: weakref.WeakSet = weakref.WeakSet()
_tracer_provider = None


def _mark_enclosing(inner) -> None:
    """Mark every LLM span enclosing ``inner`` as a duplicate of it."""
    inner_id = format(inner.get_span_context().span_id, "016x")
    outer = _NESTING.enclosing.get(inner)
    while outer is not None:
        if outer.is_recording():
            outer.set_attributes({semconv.CAPTURE_STATUS: "duplicate", semconv.CAPTURE_DUPLICATE_OF: inner_id})
        outer = _NESTING.enclosing.get(outer)


def _prepare(instance, args, kwargs):
    """(operation, stream?, kwargs to call with) for a call to capture; operation None otherwise."""
    path = args[0] if args else kwargs.get("path", "")
    body = kwargs.get("body")
    if not isinstance(body, dict) or not should_capture(getattr(instance, "base_url", ""), path, capture_urls()):
        return None, False, kwargs
    op = _operation(path)
    stream = bool(kwargs.get("stream") or body.get("stream"))
    return op, stream, {**kwargs, "body": with_capture(body, op)}


def _target(op: str, kwargs):
    """(span to record on, whether we opened it): the current LLM span, or a new GenAI span."""
    body = kwargs.get("body") or {}
    current = trace.get_current_span()
    if is_llm_span(current):
        _mark_enclosing(current)
        _sampling(current, body)
        return current, False
    model = body.get("model", "")
    span = trace.get_tracer(_TRACER_NAME, tracer_provider=_tracer_provider).start_span(
        f"{op} {model}".strip(), kind=trace.SpanKind.CLIENT,
        attributes={semconv.GEN_AI_OPERATION_NAME: op, semconv.GEN_AI_REQUEST_MODEL: model})
    _mark_enclosing(span)  # an LLM span further up (under a framework's own span) describes this call too
    _sampling(span, body)
    return span, True


def _sampling(span, body: dict) -> None:
    """The request's temperature: vLLM's processed logprobs are those of the tempered distribution,
    so the trainer must temper its logits the same way to compare with them."""
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and span.is_recording():
        span.set_attribute(semconv.GEN_AI_REQUEST_TEMPERATURE, float(temperature))


def _record(span, cap: Capture, owned: bool) -> None:
    if not span.is_recording():
        return
    try:
        attrs = cap.attributes(model_version())
        if owned:
            attrs.update(cap.genai_attributes())
        span.set_attributes(attrs)
    except Exception:  # never break the agent's call over telemetry
        log.debug("lightspan: could not record token ids", exc_info=True)
        span.set_attribute(semconv.CAPTURE_STATUS, "capture_error")


def _failed(span, owned: bool, exc: BaseException) -> None:
    if owned:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc)))
        span.end()


def _add(cap: Capture, chunk) -> bool:
    try:
        cap.add(chunk)
        return True
    except Exception:
        log.debug("lightspan: unreadable stream chunk", exc_info=True)
        return False


def _end_of_stream(span, cap: Capture, owned: bool, readable: bool) -> None:
    if readable:
        _record(span, cap, owned)
    elif span.is_recording():
        span.set_attribute(semconv.CAPTURE_STATUS, "capture_error")


def _tap(iterator, cap: Capture, span, owned: bool):
    """The stream's chunks, unchanged; records the ids once the last one has been read."""
    finished, readable = False, True
    try:
        for chunk in iterator:
            readable = _add(cap, chunk) and readable
            yield chunk
        finished = True
        # still inside the caller's __next__: the OpenAI instrumentation ends its span only after
        # StopIteration reaches it, so these attributes land first
        _end_of_stream(span, cap, owned, readable)
    finally:
        if not finished:
            getattr(iterator, "close", lambda: None)()
        if owned:
            span.end()


async def _atap(iterator, cap: Capture, span, owned: bool):
    finished, readable = False, True
    try:
        async for chunk in iterator:
            readable = _add(cap, chunk) and readable
            yield chunk
        finished = True
        _end_of_stream(span, cap, owned, readable)
    finally:
        if not finished and hasattr(iterator, "aclose"):
            await iterator.aclose()
        if owned:
            span.end()


def _tapped(stream, op: str, span, owned: bool):
    """The same Stream/AsyncStream object, its iterator replaced by a tap (so isinstance checks,
    ``with`` blocks, ``.response`` and ``.close()`` are untouched)."""
    iterator = getattr(stream, "_iterator", None)
    if iterator is None:  # with_streaming_response / with_raw_response: not parsed chunks
        if span.is_recording():
            span.set_attribute(semconv.CAPTURE_STATUS, "unparsed_response")
        if owned:
            span.end()
        return stream
    if span.is_recording():
        span.set_attribute(semconv.CAPTURE_STATUS, "stream_incomplete")
    tap = _atap if hasattr(iterator, "__anext__") else _tap
    stream._iterator = tap(iterator, Capture(op), span, owned)
    return stream


def _finish(resp, op: str, stream: bool, span, owned: bool):
    if stream:
        return _tapped(resp, op, span, owned)
    cap = Capture(op)
    _add(cap, resp)
    _record(span, cap, owned)
    if owned:
        span.end()
    return resp


def _sync_post(wrapped, instance, args, kwargs):
    op, stream, kwargs = _prepare(instance, args, kwargs)
    if op is None:
        return wrapped(*args, **kwargs)
    span, owned = _target(op, kwargs)
    try:
        with trace.use_span(span, end_on_exit=False) if owned else nullcontext():
            resp = wrapped(*args, **kwargs)
    except BaseException as exc:
        _failed(span, owned, exc)
        raise
    return _finish(resp, op, stream, span, owned)


async def _async_post(wrapped, instance, args, kwargs):
    op, stream, kwargs = _prepare(instance, args, kwargs)
    if op is None:
        return await wrapped(*args, **kwargs)
    span, owned = _target(op, kwargs)
    try:
        with trace.use_span(span, end_on_exit=False) if owned else nullcontext():
            resp = await wrapped(*args, **kwargs)
    except BaseException as exc:
        _failed(span, owned, exc)
        raise
    return _finish(resp, op, stream, span, owned)


class LightspanInstrumentor(BaseInstrumentor):
    """Adds token-id and logprob capture to the ``openai`` client (see the module docstring)."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("openai >= 1.0.0",)

    def _instrument(self, **kwargs):
        global _tracer_provider
        _tracer_provider = kwargs.get("tracer_provider")
        provider = _tracer_provider or trace.get_tracer_provider()
        # the SDK cannot remove a processor: register once per provider, switch it with `active`
        if hasattr(provider, "add_span_processor") and provider not in _PROVIDERS:
            provider.add_span_processor(_NESTING)
            _PROVIDERS.add(provider)
        _NESTING.active = True
        wrap_function_wrapper("openai._base_client", "SyncAPIClient.post", _sync_post)
        wrap_function_wrapper("openai._base_client", "AsyncAPIClient.post", _async_post)

    def _uninstrument(self, **kwargs):
        import openai._base_client as base

        global _tracer_provider
        _NESTING.active = False
        _tracer_provider = None
        unwrap(base.SyncAPIClient, "post")
        unwrap(base.AsyncAPIClient, "post")
