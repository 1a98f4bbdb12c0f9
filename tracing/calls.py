"""One intercepted generation call: what to send (:func:`prepare`), where it is recorded (:class:`.call.Call`).

:func:`prepare` runs in the client's ``post`` before the request: it looks the call's protocol up
(:func:`lightspan.tracing.protocols.of`), decides whether the call is captured (:mod:`.urls`),
makes the capture and the request of the protocol's row (the capture fields added, or the chat
completion a Responses or Anthropic call converts to), and picks the span (:func:`.spans.target`).
A request of its protocol's common shape (``Protocol.common``: the common Anthropic request) takes
a straight line to the same call (:func:`_prepare_common`). :class:`.call.Call` then records the
capture on the span when the answer (or its stream) ends, and counts the outcome (:mod:`.report`).
Nothing here depends on which protocol or client library a call is but through their rows
(:data:`~lightspan.tracing.protocols.PROTOCOLS`, :data:`~lightspan.tracing.clients.CLIENTS`).
"""

from __future__ import annotations

import functools
import logging
import time

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lightspan.tracing import protocols, semconv, spans, urls
from lightspan.tracing.call import (Call, _start_attributes, content_on, model_version,  # noqa: F401
                                    served_policy, settings)
from lightspan.tracing.clients import Client
from lightspan.tracing.protocols import Protocol
from lightspan.tracing.protocols.base import REASONS, converted_path
from lightspan.tracing.report import GATEWAY, OTHER_URL, REPORT

log = logging.getLogger(__name__)


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


def _open(call: Call, body: dict, instance=None, options=None, on: bool | None = None) -> bool:
    """Pick the call's span (or await the client's: :meth:`Call.settle`); True when the span
    records the messages lightspan reads (``on``: :func:`content_on`, read already)."""
    content: list = []
    on = content_on() if on is None else on
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
    now = settings()
    raw = now.capture_urls
    base = _base_url_text(instance)
    captured, agl = _route(base, path, raw, now.agl_base_url)
    options = kwargs.get("options")
    if not captured:
        return _not_captured(client, protocol, base, raw, body, options, kwargs)
    if protocol.common is not None and not agl:
        common = _prepare_common(client, protocol, instance, args, kwargs, path, body, options, now.content)
        if common is not None:
            return common
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
    content = call.content = _open(call, plain, instance, options, now.content)
    if content:   # the assistant turn, read as the answer passes, for the span's output messages
        call.output = protocol.output(call.cap, stream)
    return call, kwargs


def _prepare_common(client: Client, protocol: Protocol, instance, args, kwargs, path: str, body: dict, options,
                    on: bool):
    """:func:`prepare`'s straight line for a request of its protocol's common shape
    (``Protocol.common``: the common Anthropic request): the same call, request and span, in fewer
    steps; None for any other request, or a client that cannot take its converted answer (the
    general steps take it, and say why)."""
    extra = options.get("extra_json") if isinstance(options, dict) else None
    plain = client.given({**body, **extra} if isinstance(extra, dict) and extra else body)
    cap = protocol.common(plain)
    if cap is None:
        return None
    stream = bool(kwargs.get("stream") or body.get("stream"))
    if client.cannot_convert(instance, stream):
        return None
    call = Call(client, protocol, cap, stream)
    kwargs = {**kwargs, "body": cap.chat_body}
    if isinstance(options, dict):
        kwargs["options"] = sent = dict(options)
        sent.pop("extra_json", None)
    if args:
        call.path = _converted_path(path, protocol.name)
    else:
        kwargs["path"] = _converted_path(path, protocol.name)
    call.content = _open(call, plain, instance, options, on)   # (its capture holds its output messages)
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
