"""One intercepted generation call: what to send (:func:`prepare`), where it is recorded (:class:`Call`).

:func:`prepare` runs in the client's ``post`` before the request: it looks the call's protocol up
(:func:`lightspan.tracing.protocols.of`), decides whether the call is captured (:mod:`.urls`),
makes the capture and the request of the protocol's row (the capture fields added, or the chat
completion a Responses or Anthropic call converts to), and picks the span (:func:`.spans.target`).
:class:`Call` then records the capture on the span when the answer (or its stream) ends, and
counts the outcome (:mod:`.report`). Nothing here depends on which protocol or client library a
call is but through their rows (:data:`~lightspan.tracing.protocols.PROTOCOLS`,
:data:`~lightspan.tracing.clients.CLIENTS`).
"""

from __future__ import annotations

import functools
import logging
import time

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lightspan.tracing import messages, protocols, semconv, spans, urls
from lightspan.tracing.clients import Client
from lightspan.tracing.protocols import Protocol
from lightspan.tracing.protocols.base import REASONS, converted_path
from lightspan.tracing.report import CAPTURED, GATEWAY, OTHER_URL, REPORT

log = logging.getLogger(__name__)


def model_version() -> int | None:
    return _model_version(semconv.env("LIGHTSPAN_MODEL_VERSION"))


@functools.lru_cache(maxsize=16)
def _model_version(raw: str) -> int | None:
    version = raw.strip()
    return int(version) if version.lstrip("-").isdigit() else None


def served_policy(model: str | None) -> tuple[str | None, int | None]:
    """(policy, version) that served a call to ``model``: with several policies served
    (``LIGHTSPAN_POLICY_VERSIONS``) the policy of that model name, else none and
    ``LIGHTSPAN_MODEL_VERSION``'s version."""
    return _served(model, semconv.env(semconv.POLICY_VERSIONS_ENV), semconv.env("LIGHTSPAN_MODEL_VERSION"))


@functools.lru_cache(maxsize=64)
def _served(model, versions_raw: str, version_raw: str) -> tuple[str | None, int | None]:
    """:func:`served_policy` of the variables' values (cached: an agent calls a few models)."""
    versions = _policy_versions(versions_raw)
    if model in versions:
        return model, versions[model]
    return None, _model_version(version_raw)


@functools.lru_cache(maxsize=16)
def _policy_versions(raw: str) -> dict[str, int]:
    return semconv.parse_policy_versions(raw)


def content_on() -> bool:
    """Whether spans lightspan opens record the messages (off when the GenAI instrumentations' own
    switches say so: ``TRACELOOP_TRACE_CONTENT=false``, ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=false``)."""
    return _content_on(semconv.env("TRACELOOP_TRACE_CONTENT"), semconv.env("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"))


@functools.lru_cache(maxsize=16)
def _content_on(traceloop: str, otel: str) -> bool:
    return traceloop.strip().lower() != "false" and otel.strip().lower() != "false"


# what the client library's own span of a call records itself (the anthropic SDK's)
_LIBRARY_RECORDS = frozenset({semconv.GEN_AI_OPERATION_NAME, semconv.GEN_AI_REQUEST_MODEL, semconv.GEN_AI_RESPONSE_MODEL,
                              semconv.GEN_AI_USAGE_INPUT_TOKENS, semconv.GEN_AI_USAGE_OUTPUT_TOKENS})


class Call:
    """A call being captured: its capture, its span, and what its answer's reader needs."""

    __slots__ = ("client", "protocol", "cap", "span", "owned", "output", "stream", "converted", "ended", "path",
                 "adopted", "deferred", "start", "name", "content")

    def __init__(self, client: Client, protocol: Protocol, cap, stream: bool):
        self.client, self.protocol, self.cap, self.stream = client, protocol, cap, stream
        self.converted = cap is not None and cap.converted
        self.span, self.owned, self.output, self.ended, self.path = None, False, None, False, None
        self.adopted = False
        self.deferred = None   # (adopting's reset token, start ns) while the span to adopt is awaited
        self.start = None      # the start attributes of a span of our own (a function)
        self.name = None       # a span of our own's name
        self.content = False   # whether the span records the messages

    def adopt(self, span) -> None:
        """The client library's span of this call started (spans.Nesting): record on it."""
        self.span, self.adopted = span, True

    def settle(self) -> None:
        """The client's ``post`` returned (or raised): a span awaited that never started is one of
        our own now, started when the call did."""
        if self.deferred is None:
            return
        token, start_ns = self.deferred
        self.deferred = None
        try:
            spans.NESTING.adopting.reset(token)
        except ValueError:   # (a token of another context: never break the agent's call over telemetry)
            spans.NESTING.adopting.set(None)
        if self.span is None:
            self.span, self.owned = spans.open_span(self.name, self.start(), start_time=start_ns), True

    def _live(self):
        """The span to record on: an adopted span that ended already (its library ends it before
        ``post`` returns when it reads the answer itself) gives way to one of our own."""
        if self.adopted and getattr(self.span, "end_time", None) is not None:
            self.span, self.owned, self.adopted = spans.open_span(
                self.name, self.start(), start_time=self.span.start_time), True, False
        return self.span

    @property
    def fed(self) -> int:
        return self.cap.fed

    def args(self, args: tuple) -> tuple:
        """The positional arguments of ``post``, with the path a converted call goes to."""
        return (self.path, *args[1:]) if self.path is not None and args else args

    def unreadable(self) -> None:
        log.debug("lightspan: unreadable response or stream chunk", exc_info=True)
        self.cap.readable = False

    def set_status(self, status: str, reason: bool = False) -> None:
        span = self._live()
        if span.is_recording():
            span.set_attribute(semconv.CAPTURE_STATUS, status)
            if reason:
                span.set_attribute(semconv.CAPTURE_REASON, REASONS[status])

    def returned(self) -> None:
        """The client's call returned: the instrumentation's span of a protocol whose span starts
        late (traceloop's Responses wrapper) starts next."""
        if self.protocol.late_span and self.span is not None and (self.owned or self.cap is None):
            spans.NESTING.responses_call.set(spans.span_id(self.span))

    def passed(self, resp):
        """A call this process does not capture (a gateway does) but holds a span for."""
        self.returned()
        if self.owned:
            self.span.end()
        return resp

    def finish(self, complete: bool, counted: bool = False) -> None:
        """The answer is in (``complete``) or the stream was left: record, count, end our span."""
        if self.ended:
            return
        self.ended = True
        if complete:
            self._record()
        else:
            status = "unparsed_response" if counted else "stream_incomplete"
            self.set_status(status, reason=True)
            REPORT.count(status, REASONS[status])
        if self.owned:
            self.span.end()

    def _record(self) -> None:
        cap, span = self.cap, self._live()
        try:
            if cap.readable:
                # the model name the call went to (the answer's, else the request's) names its policy
                policy, version = served_policy(cap.model or getattr(self.span, "attributes", {}).get(
                    semconv.GEN_AI_REQUEST_MODEL))
                attrs = cap.attributes(version)
                if policy is not None:
                    attrs[semconv.POLICY_NAME] = policy
            else:
                attrs = {semconv.CAPTURE_STATUS: "capture_error", semconv.CAPTURE_REASON: REASONS["capture_error"]}
            if self.adopted and cap.readable:   # the library's span: what it does not record itself
                attrs.update(self.start(adopted=True))
                for key, value in cap.genai_attributes().items():
                    if key not in _LIBRARY_RECORDS:
                        attrs[key] = value
            elif self.owned and cap.readable:
                attrs.update(cap.genai_attributes())
            if (self.owned or self.adopted) and cap.readable and self.content:
                out = self.protocol.outputs(cap, self.output)
                if out is not None:
                    attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = messages.dumps(out)
        except Exception:  # never break the agent's call over telemetry
            log.debug("lightspan: could not record token ids", exc_info=True)
            attrs = {semconv.CAPTURE_STATUS: "capture_error", semconv.CAPTURE_REASON: REASONS["capture_error"]}
        if span.is_recording():
            span.set_attributes(attrs)
        status = attrs.get(semconv.CAPTURE_STATUS)
        REPORT.count(status, attrs.get(semconv.CAPTURE_REASON) if status != CAPTURED else None)


_LAST_BASE_URL: list = [None, ""]  # the base URL object seen last, its text


def _base_url_text(instance) -> str:
    """The client's base URL as text (``str()`` of an httpx URL costs more than the rest of
    ``prepare``; a client's URL object is immutable, and most agents call one URL)."""
    url = getattr(instance, "base_url", "")
    if url is not _LAST_BASE_URL[0]:
        _LAST_BASE_URL[:] = [url, str(url)]
    return _LAST_BASE_URL[1]


@functools.lru_cache(maxsize=16)
def _agl_base(raw: str):
    return urls.canonical(raw) if raw.strip() else None


@functools.lru_cache(maxsize=256)
def _route(base: str, path: str, raw: str, agl_raw: str) -> tuple[bool, bool]:
    """(whether the URL called is a capture URL under ``LIGHTSPAN_CAPTURE_URLS=raw``, whether it
    is Agent Lightning's proxy URL ``AGL_OPENAI_BASE_URL=agl_raw``, whose agents read ids and
    logprobs without asking) of a call to ``path`` of a client of ``base`` (cached: a client calls
    a few URLs many times)."""
    url = urls.join(base, path)
    agl = _agl_base(agl_raw)
    target = urls.canonical(url) if agl is not None else None
    return urls.is_capture_url(url, raw), target is not None and urls.covers(agl, target)


def _other_url_reason(base: str, raw: str) -> str:
    configured = f"LIGHTSPAN_CAPTURE_URLS={raw}" if raw.strip() else "LIGHTSPAN_CAPTURE_URLS is unset: loopback servers"
    return (f"{base} is not a capture URL ({configured}). To train on these calls, point the agent's base URL "
            "at the vLLM server lightspan captures (lightspan rollout --openai-base-url), or add the URL to "
            "LIGHTSPAN_CAPTURE_URLS; a hosted API's calls cannot be trained on")


def _capture(client: Client, protocol: Protocol, body: dict, plain: dict, stream: bool, instance):
    """(call, request body to send) for a call bound for a capture URL (``plain``: what the caller
    asked for, as JSON data)."""
    cap = protocol.capture(plain)
    if cap.converted:   # as a chat completion, which has every token's logprob
        why = client.cannot_convert(instance, stream)
        if why:
            cap = cap.unconverted(why)
    return Call(client, protocol, cap, stream), protocol.request(cap, body)


def _adopts(call: "Call", instance, options) -> bool:
    """Whether the client starts the call's LLM span itself, during the call, and keeps it open
    until lightspan has read the answer: a client that opens spans of its own (the ``anthropic``
    client 2.x) with its tracing on (a client's ``_tracer`` is None when it is off), but for
    ``with_streaming_response`` of a call that does not stream (the SDK ends its span as the body is
    read, before ``parse()`` decodes it)."""
    if not call.client.own_spans or getattr(instance, "_tracer", None) is None:
        return False
    headers = options.get("headers") if isinstance(options, dict) else None
    raw = headers.get(_RAW_RESPONSE_HEADER) if isinstance(headers, dict) else None
    return call.stream or raw != "stream"


_RAW_RESPONSE_HEADER = "X-Stainless-Raw-Response"   # the SDKs' marker of with_raw/streaming_response


def _start_attributes(protocol: Protocol, model: str, body: dict, content: list, on: bool, adopted: bool = False) -> dict:
    """A span of our own's start attributes, with the messages when ``on`` (:func:`content_on`, read
    as the call began); ``content`` gets True when they hold them. ``adopted``: less what the
    client library's span records itself."""
    attrs = dict(_start_names(protocol.operation, model, protocol.provider, semconv.env(semconv.SEMCONV_OPT_IN_ENV),
                              adopted))
    if on:
        content.append(True)
        try:
            attrs[semconv.GEN_AI_INPUT_MESSAGES] = messages.dumps(protocol.inputs(body))
        except Exception:
            log.debug("lightspan: could not read the request's messages", exc_info=True)
    return attrs


@functools.lru_cache(maxsize=64)
def _start_names(operation: str, model: str, provider: str, opt_in: str, adopted: bool = False) -> dict:
    """The GenAI start attributes of a call (``semconv.genai``'s names for ``OTEL_SEMCONV_STABILITY_OPT_IN=opt_in``;
    ``adopted``: less what the client library's span records itself; cached: an agent calls a few
    models; the caller copies them)."""
    names = semconv.genai({semconv.GEN_AI_OPERATION_NAME: operation, semconv.GEN_AI_REQUEST_MODEL: model,
                           semconv.GEN_AI_PROVIDER_NAME: provider}, {semconv.SEMCONV_OPT_IN_ENV: opt_in})
    return {k: v for k, v in names.items() if k not in _LIBRARY_RECORDS} if adopted else names


def _open(call: Call, body: dict, instance=None, options=None) -> bool:
    """Pick the call's span (or await the client's: :meth:`Call.settle`); True when the span
    records the messages lightspan reads."""
    content: list = []
    on = content_on()
    model = str(body.get("model") or "")
    # (a partial, not a closure over the call: the call must not be part of a reference cycle, or its
    # answer's data would wait for the garbage collector)
    call.start = functools.partial(_start_attributes, call.protocol, model, body, content, on)
    call.name = f"{call.protocol.operation} {model}".strip()
    call.span, call.owned = spans.target(call.name, call.start, _adopts(call, instance, options))
    if call.span is None:
        call.deferred = (spans.NESTING.adopting.set(call), time.time_ns())
        return on
    return bool(content)


_protocol_of = functools.lru_cache(maxsize=256)(protocols.of)          # (a client calls a few paths)


@functools.lru_cache(maxsize=256)
def _converted_path(path: str, protocol: str) -> str:
    return converted_path(path, protocols.PROTOCOLS[protocol])


def prepare(client: Client, instance, args, kwargs):
    """(call or None, the ``post`` keyword arguments to call with)."""
    path = args[0] if args else kwargs.get("path", "")
    body = kwargs.get("body")
    if not isinstance(body, dict) or not isinstance(path, str):
        return None, kwargs
    protocol = _protocol_of(path, client.name)
    if protocol is None:
        return None, kwargs
    raw = semconv.env("LIGHTSPAN_CAPTURE_URLS")
    base = _base_url_text(instance)
    captured, agl = _route(base, path, raw, semconv.env("AGL_OPENAI_BASE_URL"))
    options = kwargs.get("options")
    if not captured:
        return _not_captured(client, protocol, base, raw, body, options, kwargs)
    stream = bool(kwargs.get("stream") or body.get("stream"))
    extra = options.get("extra_json") if isinstance(options, dict) else None
    # what the caller asked for: the client merges ``extra_body`` (``options["extra_json"]``) over the body
    asked = {**body, **extra} if isinstance(extra, dict) and extra else body
    plain = client.plain(asked)
    call, sent = _capture(client, protocol, body, plain, stream, instance)
    kwargs = {**kwargs, "body": sent}
    if call.converted:
        # the converted body holds the caller's extra_body already (it was converted from ``asked``)
        kwargs["options"] = {k: v for k, v in options.items() if k != "extra_json"} if isinstance(options, dict) else options
        chat_path = _converted_path(path, protocol.name)
        if args:
            call.path = chat_path
        else:
            kwargs["path"] = chat_path
    if agl:   # (a converted capture shows the caller nothing of the chat answer's either way)
        call.cap.caller_ids = call.cap.caller_logprobs = True
    content = call.content = _open(call, plain, instance, options)
    if content:   # the assistant turn, read as the answer passes, for the span's output messages
        call.output = protocol.output(call.cap, stream)
    return call, kwargs


def _not_captured(client: Client, protocol: Protocol, base: str, raw: str, body: dict, options, kwargs):
    if not urls.gateway_mode(raw):
        reason = _other_url_reason(base, raw)
        REPORT.count(OTHER_URL, reason, url=base)
        current = trace.get_current_span()   # the instrumentation's span of the call says so too
        if spans.is_llm_span(current) and semconv.CAPTURE_STATUS not in current.attributes:
            current.set_attributes({semconv.CAPTURE_STATUS: OTHER_URL, semconv.CAPTURE_REASON: reason})
        return None, kwargs
    REPORT.count(GATEWAY)
    # The gateway's span of the call joins this trace through traceparent, as the child of the span
    # that describes the call here (an instrumentation's, a framework's; for a Responses call without
    # one, traceloop's starting only after the call, a span of our own): store/views.py keeps the
    # gateway's, which has the ids, and the call is one row. Nothing else sends the trace context.
    call = None
    current = trace.get_current_span()
    span = current if spans.is_llm_span(current) else _pending_llm_span()
    if protocol.late_span:   # the instrumentation's span starts only after the call: one of our own now
        call = Call(client, protocol, None, False)
        if span is None:
            _open(call, body)
            span = call.span if call.owned else None
        else:
            call.span = span   # (traceloop's span of it, starting after the call, is marked its duplicate)
    if span is None:
        return call, kwargs
    if span.is_recording() and semconv.CAPTURE_STATUS not in span.attributes:
        span.set_attributes({semconv.CAPTURE_STATUS: GATEWAY, semconv.CAPTURE_REASON: REASONS[GATEWAY]})
    headers = dict((options or {}).get("headers") or {}) if isinstance(options, dict) else {}
    TraceContextTextMapPropagator().inject(headers, context=trace.set_span_in_context(span))
    kwargs = {**kwargs, "options": {**(options if isinstance(options, dict) else {}), "headers": headers}}
    return call, kwargs


def _pending_llm_span():
    """The LLM span a framework opened for the call without making it current (:mod:`.spans`, 2.)."""
    return spans.NESTING.pending_llm_span() if spans.NESTING.active else None
