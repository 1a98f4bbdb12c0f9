"""The lightspan instrumentor: token ids and logprobs on every GenAI span, with no code change.

``opentelemetry-instrument`` loads it through the ``opentelemetry_instrumentor`` entry point.
It wraps the ``openai`` client's ``post`` (sync and async), which runs inside whichever GenAI
span the OpenAI instrumentation opened (traceloop's or OTel's), so the attributes land on it:

1. requests bound for an RL endpoint (``LIGHTSPAN_CAPTURE_URLS``, comma-separated base URLs;
   loopback addresses when unset; ``none`` when a gateway captures instead) ask vLLM for
   ``return_token_ids`` and sampled-token ``logprobs``; hosted APIs, which reject unknown fields,
   are never touched;
2. the response's prompt ids, completion ids (one list per choice, ``n > 1`` included) and
   logprobs are recorded as little-endian bytes (docs/architecture.md, "Attributes"), with the
   serving policy version (``LIGHTSPAN_MODEL_VERSION``; with several policies,
   ``LIGHTSPAN_POLICY_VERSIONS`` maps the response's model name to its policy and version) and
   ``lightspan.capture.status`` (``ok`` or why not);
3. streams (``stream=True``, sync and async, chat and completions) are decoded by lightspan: the
   stream object the caller gets is the same one, with its server-sent-event decoder replaced
   (``_CapturedDecoder``, over ``sse.SSEParser``); its chunks are the same, and the ids collected
   from them are recorded when the stream ends — before the OpenAI instrumentation's own
   end-of-stream handling ends its span. A stream abandoned early keeps
   ``capture.status=stream_incomplete``;
4. when the current span is not an LLM span (no OpenAI instrumentation installed, or only an
   agent's own span), it opens a GenAI span of its own around the call;
5. when two LLM spans nest for one call (both traceloop's and OTel's OpenAI instrumentation are
   installed, or a framework's LLM span encloses the client's), the ids go on the innermost and
   the enclosing one is marked ``capture.status=duplicate`` with ``capture.duplicate_of`` = the
   inner span id. Seeing the enclosing span needs a span processor on the SDK tracer provider,
   added at ``instrument()``; with no SDK there are no spans to mark;
6. a framework instrumentation may open the call's LLM span *without* making it current and ask
   the instrumentations below it to stand aside (traceloop's LangChain instrumentation: it starts
   ``ChatOpenAI.chat``, detaches it and sets ``suppress_language_model_instrumentation``). Under
   that flag the ids go on the LLM span most recently started in this context, if it is still
   open and holds no capture yet, instead of on a span of our own: one call, one LLM span;
7. raw responses (``with_raw_response``, as LangChain's ``ChatOpenAI`` calls; ``client.post`` with
   the raw-response header, as LiteLLM calls, bypassing ``chat.completions.create`` and so the
   OpenAI instrumentation) are parsed through their own cache, so the caller gets the same object;
8. a captured call's JSON (the response body, or each stream chunk) is decoded by lightspan
   (``capture.loads``: orjson, ``json`` for what orjson refuses): the body in a hook on the
   client's JSON decoding (``httpx2.Response.json``), active only inside a captured call, each
   chunk in its event's ``json()``. The ids and logprobs are read from the decoded dict there, and
   those only lightspan asked for are set to ``null`` before the client builds its models, as vLLM
   answers a request without them: the caller gets what it gets without lightspan, and the client
   builds no model per token for them. That model building was once most of capture's cost;
   decoding vLLM's larger JSON with ``json``, and its larger streams with openai's SSE decoder,
   most of what remained (bench/capture_overhead.py). The hook is a plain function, not a wrapt
   wrapper: every response of every client passes through it, and outside a captured call it
   costs one context-variable read. Where it does not fire (another HTTP client passed to openai),
   the parsed objects are read instead.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import weakref
from collections.abc import Collection
from contextlib import nullcontext
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
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
    loads,
    operation as _operation,
    with_capture,
)
from lightspan.tracing.sse import SSEParser

log = logging.getLogger(__name__)

_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
_TRACER_NAME = "lightspan.instrumentor"
_LLM_OPERATIONS = frozenset({"chat", "text_completion", "completion", "generate_content"})
# the context key (opentelemetry-semantic-conventions-ai) with which a framework's instrumentation
# that already opened the call's LLM span tells the client instrumentations below it to stand aside
_SUPPRESS_LLM_KEY = "suppress_language_model_instrumentation"


def capture_urls() -> list[str]:
    """The configured RL endpoints; ``none`` matches no URL (the gateway captures these calls)."""
    return _parse_urls(os.environ.get("LIGHTSPAN_CAPTURE_URLS", ""))


def _parse_urls(raw: str) -> list[str]:
    return [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]


def should_capture(base_url: str, path: str, urls: list[str]) -> bool:
    """Capture only chat/completions calls to a configured RL endpoint (loopback by default)."""
    if _operation(path) is None:
        return False
    base = str(base_url).rstrip("/")
    if urls:
        return any(base == u or base.startswith(u + "/") for u in urls)
    return (urlsplit(base).hostname or "") in _LOOPBACK


@functools.lru_cache(maxsize=256)
def _capture_operation(base_url: str, path: str, urls_raw: str) -> str | None:
    """The operation of a call to capture, else None; cached: a client calls a few URLs many times
    (the environment variable's value is part of the key, so a change applies at once)."""
    return _operation(path) if should_capture(base_url, path, _parse_urls(urls_raw)) else None


def model_version() -> int | None:
    return _model_version(os.environ.get("LIGHTSPAN_MODEL_VERSION", ""))


def served_policy(model: str | None) -> tuple[str | None, int | None]:
    """(policy, version) that served a call to ``model``: with several policies served
    (``LIGHTSPAN_POLICY_VERSIONS``) the policy of that model name, else none and
    ``LIGHTSPAN_MODEL_VERSION``'s version."""
    versions = _policy_versions(os.environ.get(semconv.POLICY_VERSIONS_ENV, ""))
    if model in versions:
        return model, versions[model]
    return None, model_version()


@functools.lru_cache(maxsize=16)
def _policy_versions(raw: str) -> dict[str, int]:
    return semconv.parse_policy_versions(raw)


@functools.lru_cache(maxsize=16)
def _model_version(raw: str) -> int | None:
    version = raw.strip()
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
        # the span most recently started in this context (thread or task), weakly: a framework's
        # LLM span that was started but not made current is found through it (docstring, 6.)
        self.last_started: contextvars.ContextVar = contextvars.ContextVar("lightspan_last_started", default=None)
        self.active = True

    def pending_llm_span(self):
        """The LLM span just started here but not current, when a framework asked for suppression."""
        if not otel_context.get_value(_SUPPRESS_LLM_KEY):
            return None
        ref = self.last_started.get()
        span = ref() if ref is not None else None
        if span is None or not span.is_recording() or not is_llm_span(span):
            return None
        if semconv.CAPTURE_STATUS in span.attributes:  # already holds another call's capture
            return None
        return span

    def on_start(self, span, parent_context=None) -> None:
        if not self.active:
            return
        try:
            self.last_started.set(weakref.ref(span))
        except TypeError:  # a span type that cannot be weakly referenced
            pass
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
# the capture whose response the openai client is decoding right now (set around the call): the
# JSON hook feeds it
_FEEDING: contextvars.ContextVar = contextvars.ContextVar("lightspan_feeding", default=None)
_PROVIDERS: weakref.WeakSet = weakref.WeakSet()
_tracer_provider = None


def _mark_enclosing(inner) -> None:
    """Mark every LLM span enclosing ``inner`` as a duplicate of it."""
    outer = _NESTING.enclosing.get(inner)
    if outer is None:
        return
    inner_id = format(inner.get_span_context().span_id, "016x")
    while outer is not None:
        if outer.is_recording():
            outer.set_attributes({semconv.CAPTURE_STATUS: "duplicate", semconv.CAPTURE_DUPLICATE_OF: inner_id})
        outer = _NESTING.enclosing.get(outer)


_LAST_BASE_URL: tuple = (None, "")  # (the base URL object seen last, its text)


def _base_url_text(instance) -> str:
    """The client's base URL as text (``str()`` of an httpx URL costs more than the rest of
    ``_prepare``; a client's URL object is immutable, and most agents call one URL)."""
    global _LAST_BASE_URL
    url = getattr(instance, "base_url", "")
    last, text = _LAST_BASE_URL
    if url is not last:
        text = str(url)
        _LAST_BASE_URL = (url, text)
    return text


def _prepare(instance, args, kwargs):
    """(capture, stream?, kwargs to call with) for a call to capture; capture None otherwise."""
    path = args[0] if args else kwargs.get("path", "")
    body = kwargs.get("body")
    if not isinstance(body, dict) or not isinstance(path, str):
        return None, False, kwargs
    op = _capture_operation(_base_url_text(instance), path, os.environ.get("LIGHTSPAN_CAPTURE_URLS", ""))
    if op is None:
        return None, False, kwargs
    stream = bool(kwargs.get("stream") or body.get("stream"))
    options = kwargs.get("options")
    extra = options.get("extra_json") if isinstance(options, dict) else None
    # what the caller asked for: openai merges ``extra_body`` (``options["extra_json"]``) over the body
    cap = Capture.for_request({**body, **extra} if isinstance(extra, dict) and extra else body, op)
    return cap, stream, {**kwargs, "body": with_capture(body, op)}


def _target(op: str, kwargs):
    """(span to record on, whether we opened it): the current LLM span, or a new GenAI span."""
    current = trace.get_current_span()
    if is_llm_span(current):
        _mark_enclosing(current)
        return current, False
    pending = _NESTING.pending_llm_span() if _NESTING.active else None
    if pending is not None:
        _mark_enclosing(pending)
        return pending, False
    model = (kwargs.get("body") or {}).get("model", "")
    span = trace.get_tracer(_TRACER_NAME, tracer_provider=_tracer_provider).start_span(
        f"{op} {model}".strip(), kind=trace.SpanKind.CLIENT,
        attributes={semconv.GEN_AI_OPERATION_NAME: op, semconv.GEN_AI_REQUEST_MODEL: model})
    _mark_enclosing(span)  # an LLM span further up (under a framework's own span) describes this call too
    return span, True


def _record(span, cap: Capture, owned: bool) -> None:
    if not span.is_recording():
        return
    if not cap.readable:
        span.set_attribute(semconv.CAPTURE_STATUS, "capture_error")
        return
    try:
        policy, version = served_policy(cap.model)
        attrs = cap.attributes(version)
        if policy is not None:
            attrs[semconv.POLICY_NAME] = policy
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


def _add(cap: Capture, payload) -> None:
    """Fold a response or chunk (decoded JSON, or the client's parsed object) into ``cap``, handing
    the caller ``null`` for the ids and logprobs only lightspan asked for (``Capture.add``). An
    unreadable payload marks the capture unreadable; the caller's call goes on."""
    try:
        cap.add(payload, hide=True)
    except Exception:
        _unreadable(cap)


def _unreadable(cap: Capture) -> None:
    log.debug("lightspan: unreadable response or stream chunk", exc_info=True)
    cap.readable = False


def _read_captured(cap: Capture, raw):
    """Decode a captured call's JSON (a body, or one stream chunk) and read it into ``cap``."""
    data = loads(raw)
    if type(data) is dict:
        try:
            cap.add_json(data, True)
        except Exception:
            _unreadable(cap)
    return data


def _response_json_hook(original):
    """``Response.json`` of the client's HTTP library: a captured call's body, decoded by
    ``capture.loads`` and read (module docstring, 8.); any other response, untouched."""
    @functools.wraps(original)
    def json(self, **kwargs):
        cap = _FEEDING.get()
        if cap is None or kwargs:
            return original(self, **kwargs)
        return _read_captured(cap, self.content)
    return json


def _json_hook_targets() -> list[tuple[type, object]]:
    """(class, hook factory) for each JSON decoder to hook: openai 3.x is built on ``httpx2``, and
    still takes an ``httpx`` client (hooked when something imported ``httpx`` by ``instrument()``;
    a client of a library not hooked is read from its parsed objects); openai 1.x/2.x use ``httpx``.
    Streams need no hook: their events come from lightspan's own decoder (``_CapturedDecoder``)."""
    import sys

    import openai._base_client  # noqa: F401  (imports the HTTP library this openai version is built on)

    targets = []
    for module in ("httpx2", "httpx"):
        mod = sys.modules.get(module)
        if mod is not None and hasattr(mod, "Response"):
            targets.append((mod.Response, _response_json_hook))
    return targets


# (class, the hook, the original ``json``) of each hook installed
_JSON_HOOKS: list[tuple[type, object, object]] = []


def _install_json_hooks() -> None:
    if _JSON_HOOKS:
        return
    for cls, factory in _json_hook_targets():
        original = cls.__dict__.get("json")
        if original is None:
            continue
        hook = factory(original)
        cls.json = hook
        _JSON_HOOKS.append((cls, hook, original))


def _remove_json_hooks() -> None:
    while _JSON_HOOKS:
        cls, hook, original = _JSON_HOOKS.pop()
        if cls.__dict__.get("json") is hook:  # else another library wrapped it since: ours stays, inert
            cls.json = original


class _CapturedDecoder:
    """The SSE decoder of a captured stream (``Stream._decoder``; openai builds the stream's events
    with it, lazily, when the caller starts reading).

    Its events come from :class:`~lightspan.tracing.sse.SSEParser` and decode their JSON with
    :func:`_read_captured`: each chunk is read into the capture as the client decodes it, and the
    caller gets its chunks as without lightspan (module docstring, 8.). The ids are recorded when
    the ``[DONE]`` event is handed on, or when the bytes end: every chunk before it has been decoded
    by then, and the OpenAI instrumentation ends its span only after the stream ends, so the
    attributes land first. A stream left before its end keeps ``capture.status=stream_incomplete``.
    A decoder of the client's own (``_make_sse_decoder`` overridden) is kept, and its events are
    read as they pass.
    """

    def __init__(self, inner, cap: Capture, span, owned: bool):
        from openai._streaming import SSEDecoder

        self.inner, self.cap, self.span, self.owned = inner, cap, span, owned
        self.own = type(inner) is SSEDecoder  # the decoder SSEParser reproduces (tests/tracing/test_sse.py)
        self.ended = False

    def _parser(self) -> SSEParser:
        cap, event = self.cap, _captured_event_type()
        return SSEParser(lambda name, data, id, retry: event(cap, name, data, id, retry))

    def _pass(self, sse) -> None:
        """Before an event goes out: the capture is recorded as ``[DONE]`` goes; an event of the
        client's own decoder is read into the capture (the client decodes its own copy)."""
        if sse.data.startswith("[DONE]"):
            self._end(True)
        elif not self.own:
            try:
                _read_captured(self.cap, sse.data)
            except Exception:
                _unreadable(self.cap)

    def _end(self, complete: bool) -> None:
        if self.ended:
            return
        self.ended = True
        if complete:
            _record(self.span, self.cap, self.owned)
        if self.owned:
            self.span.end()

    def iter_bytes(self, iterator):
        try:
            if self.own:
                parser = self._parser()
                for chunk in iterator:
                    for sse in parser.feed(chunk):
                        self._pass(sse)
                        yield sse
                    parser.check()
                parser.finish()
                parser.check()
            else:
                for sse in self.inner.iter_bytes(iterator):
                    self._pass(sse)
                    yield sse
            self._end(True)
        finally:
            self._end(False)

    async def aiter_bytes(self, iterator):
        try:
            if self.own:
                parser = self._parser()
                async for chunk in iterator:
                    for sse in parser.feed(chunk):
                        self._pass(sse)
                        yield sse
                    parser.check()
                parser.finish()
                parser.check()
            else:
                async for sse in self.inner.aiter_bytes(iterator):
                    self._pass(sse)
                    yield sse
            self._end(True)
        finally:
            self._end(False)


@functools.lru_cache(maxsize=1)
def _captured_event_type() -> type:
    """openai's ``ServerSentEvent``, whose ``json()`` decodes with lightspan and feeds a capture."""
    from openai._streaming import ServerSentEvent

    class CapturedEvent(ServerSentEvent):
        def __init__(self, cap: Capture, event, data, id, retry):
            super().__init__(event=event, data=data, id=id, retry=retry)
            self._lightspan_capture = cap

        def json(self):
            return _read_captured(self._lightspan_capture, self.data)

    return CapturedEvent


def _tapped(stream, cap: Capture, span, owned: bool):
    """The same Stream/AsyncStream object, its SSE decoder replaced by a ``_CapturedDecoder`` (so
    isinstance checks, ``with`` blocks, ``.response`` and ``.close()`` are untouched)."""
    decoder = getattr(stream, "_decoder", None)
    if decoder is None or getattr(stream, "_iterator", None) is None:
        # with_streaming_response / with_raw_response: not parsed chunks
        if span.is_recording():
            span.set_attribute(semconv.CAPTURE_STATUS, "unparsed_response")
        if owned:
            span.end()
        return stream
    if span.is_recording():
        span.set_attribute(semconv.CAPTURE_STATUS, "stream_incomplete")
    stream._decoder = _CapturedDecoder(decoder, cap, span, owned)
    return stream


@functools.lru_cache(maxsize=1)
def _legacy_response_type() -> type:
    from openai._legacy_response import LegacyAPIResponse

    return LegacyAPIResponse


def _parse_raw(resp, cap: Capture):
    """The parsed body of a ``LegacyAPIResponse``, else None.

    ``with_raw_response`` (LangChain's ``ChatOpenAI``) and direct ``client.post(...)`` calls with the
    raw-response header (LiteLLM) get this wrapper back instead of the parsed completion. Its
    ``parse()`` caches per target type, so parsing it here hands the caller the very same object
    (for a stream: the same Stream, tapped) when it calls ``parse()`` itself. The newer
    ``APIResponse`` of ``with_streaming_response`` is left alone: its body is not read yet, and
    reading it here would take the streaming away from the caller.
    """
    if not isinstance(resp, _legacy_response_type()):
        return None
    token = _FEEDING.set(cap)
    try:
        return resp.parse()
    except Exception:  # the caller's own parse() raises the same error; telemetry stays quiet
        log.debug("lightspan: could not parse a raw response", exc_info=True)
        return None
    finally:
        _FEEDING.reset(token)


def _finish(resp, cap: Capture, stream: bool, span, owned: bool):
    parsed = _parse_raw(resp, cap)
    if parsed is not None:
        _finish(parsed, cap, stream, span, owned)
        return resp
    if stream:
        return _tapped(resp, cap, span, owned)
    if not cap.fed:  # the JSON hook did not see the response: read the parsed object
        _add(cap, resp)
    _record(span, cap, owned)
    if owned:
        span.end()
    return resp


def _sync_post(wrapped, instance, args, kwargs):
    cap, stream, kwargs = _prepare(instance, args, kwargs)
    if cap is None:
        return wrapped(*args, **kwargs)
    span, owned = _target(cap.operation, kwargs)
    try:
        with trace.use_span(span, end_on_exit=False) if owned else nullcontext():
            token = _FEEDING.set(cap)  # the response is decoded inside: the JSON hook feeds ``cap``
            try:
                resp = wrapped(*args, **kwargs)
            finally:
                _FEEDING.reset(token)
    except BaseException as exc:
        _failed(span, owned, exc)
        raise
    return _finish(resp, cap, stream, span, owned)


async def _async_post(wrapped, instance, args, kwargs):
    cap, stream, kwargs = _prepare(instance, args, kwargs)
    if cap is None:
        return await wrapped(*args, **kwargs)
    span, owned = _target(cap.operation, kwargs)
    try:
        with trace.use_span(span, end_on_exit=False) if owned else nullcontext():
            token = _FEEDING.set(cap)  # the response is decoded inside: the JSON hook feeds ``cap``
            try:
                resp = await wrapped(*args, **kwargs)
            finally:
                _FEEDING.reset(token)
    except BaseException as exc:
        _failed(span, owned, exc)
        raise
    return _finish(resp, cap, stream, span, owned)


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
        _install_json_hooks()

    def _uninstrument(self, **kwargs):
        import openai._base_client as base

        global _tracer_provider
        _NESTING.active = False
        _tracer_provider = None
        unwrap(base.SyncAPIClient, "post")
        unwrap(base.AsyncAPIClient, "post")
        _remove_json_hooks()
