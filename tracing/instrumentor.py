"""The lightspan instrumentor: token ids and logprobs on every GenAI span, with no code change.

``opentelemetry-instrument`` loads it through the ``opentelemetry_instrumentor`` entry point.
It wraps the ``post`` of the ``openai`` client (1.x, 2.x, 3.x) and of the ``anthropic`` client
(sync and async; a library is wrapped when it is imported), which runs inside whichever GenAI
span an instrumentation opened around the call, so the attributes land on it (:mod:`.spans`):

1. requests of a generation protocol (the table of :mod:`.protocols`: chat completions,
   completions, Responses, Anthropic Messages; what differs between the client libraries:
   :mod:`.clients`) bound for a capture URL (:mod:`.urls`: ``LIGHTSPAN_CAPTURE_URLS``, loopback
   when unset, every loopback spelling alike) ask vLLM for token ids and sampled-token logprobs;
   hosted APIs, which reject unknown fields, are never touched;
2. the answer's prompt ids, completion ids (one list per choice, ``n > 1`` included) and logprobs
   are recorded as little-endian bytes (docs/architecture.md, "Attributes"), with the serving
   policy version (``LIGHTSPAN_MODEL_VERSION``; with several policies, ``LIGHTSPAN_POLICY_VERSIONS``
   maps the call's model name to its policy and version: :func:`.calls.served_policy`) and
   ``lightspan.capture.status`` (``ok``, or why not, with ``lightspan.capture.reason``); the
   Responses API and Anthropic Messages by making vLLM's own conversion to a chat completion here,
   where the ids can be asked for, and converting the answer back (:mod:`.protocols.responses`,
   :mod:`.protocols.anthropic_messages`): the client gets the Response, message or events that
   ``/v1/responses`` and ``/v1/messages`` give;
3. the caller gets what it gets without lightspan: the ids and logprobs only lightspan asked for
   are set to ``null`` in the decoded JSON before the client builds its models, as vLLM answers a
   request without them. A caller that asks for them gets them: ``return_token_ids`` /
   ``logprobs`` (chat, completions; in the body or ``extra_body``), ``enable_response_messages`` /
   ``include: ["message.output_text.logprobs"]`` (Responses); and a caller whose base URL is
   Agent Lightning's proxy (``AGL_OPENAI_BASE_URL``), whose agents expect the proxy's answer with
   ids and logprobs without asking, gets both;
4. streams (``stream=True``, ``responses.stream``, ``messages.stream``, sync and async) are
   decoded by lightspan (:mod:`.streams`): the caller's stream object is the same one, and the ids
   are recorded when it ends; one abandoned early keeps ``capture.status=stream_incomplete``;
5. when no LLM span describes the call (no instrumentation of the client installed; traceloop's
   Responses wrapper, which starts its span only after the call), it records on the span the
   client opens for the call itself (the ``anthropic`` SDK's, adopted as it starts), else opens a
   GenAI span of its own; either way with the call's messages in the GenAI shape
   (:mod:`.messages`: tool calls and their results included). The other spans of the call are
   marked ``duplicate`` (:mod:`.spans`);
6. raw responses (``with_raw_response``, as LangChain's ``ChatOpenAI`` calls; ``client.post`` with
   the raw-response header, as LiteLLM calls) are parsed through their own cache, so the caller
   gets the same object; ``with_streaming_response`` streams (the OpenAI Agents SDK's) likewise;
7. a captured call's JSON is decoded by lightspan (``protocols.base.loads``: orjson) in a hook on the
   client's JSON decoding (``httpx2.Response.json``, ``httpx.Response.json``), active only inside a
   captured call: the ids are read from the decoded dict before the client builds a model per
   token for them (bench/capture_overhead.py). The hook is a plain function: every response of
   every client passes through it, and outside a captured call it costs one context-variable read;
8. never silent (:mod:`.report`): every generation call is counted by outcome, each reason is
   logged once with its fix, and ``LIGHTSPAN_CAPTURE_REPORT`` gets the counts at exit;
9. nothing lost when the process dies (:mod:`.spool`): with ``LIGHTSPAN_SPOOL`` set (``lightspan
   rollout`` sets it per rollout), every span is written to that file as it ends, and the runner
   exports them after the process is gone, however it ended.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
from collections.abc import Collection
from contextlib import nullcontext

from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.trace import Status, StatusCode
from wrapt import register_post_import_hook

from lightspan.tracing import protocols, semconv, spans, spool, straight, straight_stream, urls
from lightspan.tracing.calls import Call, prepare
from lightspan.tracing.clients import CLIENTS, Client
from lightspan.tracing.protocols.base import loads
from lightspan.tracing.protocols.chat import with_capture  # noqa: F401  (re-exported: the instrumentor's API)
from lightspan.tracing.hooks import install_json_hooks, remove_json_hooks, wrap, unwrap_all
from lightspan.tracing.report import register
from lightspan.tracing.spans import is_llm_span  # noqa: F401  (re-exported)
from lightspan.tracing.streams import tap
from lightspan.tracing.urls import is_capture_url  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

# the call whose response the client is decoding right now (set around the call): the JSON hook feeds it
FEEDING: contextvars.ContextVar = contextvars.ContextVar("lightspan_feeding", default=None)
_Straight, _StraightStream = straight.Straight, straight_stream.StraightStream


def should_capture(base_url: str, path: str, capture_urls=None, client: str = "openai") -> bool:
    """Whether a call of ``client`` to ``base_url`` + ``path`` is captured: a generation API bound for
    a capture URL. ``capture_urls``: a ``LIGHTSPAN_CAPTURE_URLS`` value or a list of its entries
    (empty: loopback); by default the variable's."""
    if capture_urls is None:
        capture_urls = os.environ.get("LIGHTSPAN_CAPTURE_URLS", "")
    raw = capture_urls if isinstance(capture_urls, str) else ",".join(capture_urls)
    return protocols.of(path, client) is not None and urls.is_capture_url(urls.join(base_url, path), raw)


def read(call: Call, raw):
    """Decode a captured call's JSON (a body, or one stream event) and read it into ``call``; returns
    what the client gets (for a converted answer: the Response or Anthropic message made of it)."""
    data = loads(raw)
    if type(call) is _Straight:   # (the straight line: the general path's call if it cannot read it)
        message = call.answer(data)
        if message is not None:
            return message
        call = call.general()
    return _read(call, data)


def _read(call: Call, data):
    """:func:`read` of decoded JSON, by the general path's call."""
    if type(data) is dict:
        try:
            if call.output is not None:
                call.output.add(data)
            if call.converted:
                if not call.stream and "choices" in data:   # (a converted stream's chunks: ConvertedDecoder)
                    message = call.cap.message(data)
                    if call.adopted:   # the client ends its span of the call once it has read this
                        call.finish(True)
                    return message
            else:
                call.cap.add_json(data, True)
        except Exception:
            call.unreadable()
    return data


def _response_json_hook(original):
    """``Response.json`` of the client's HTTP library: a captured call's body, decoded and read
    (module docstring, 7.); any other response, untouched."""
    @functools.wraps(original)
    def json(self, **kwargs):
        call = FEEDING.get()
        if call is None or kwargs:
            return original(self, **kwargs)
        data = loads(self.content)   # (``read``, written out)
        if type(call) is _Straight:
            message = call.answer(data)
            if message is not None:
                return message
            call = call.general()
        return _read(call, data)
    return json


def _failed(call: Call, exc: BaseException) -> None:
    if call.owned:
        call.span.record_exception(exc)
        call.span.set_status(Status(StatusCode.ERROR, str(exc)))
        call.span.end()


def _parse(resp, call: Call):
    """(parse it?, parsed or None) for a raw response wrapper; ``parse()`` caches per target type, so
    parsing it here hands the caller the very same object (for a stream: the same Stream, tapped).

    ``with_raw_response`` (LangChain's ``ChatOpenAI``) and ``client.post(...)`` with the raw-response
    header (LiteLLM) give openai's ``LegacyAPIResponse``: its body is read, parsing it is free. Of
    the newer ``APIResponse`` (``with_streaming_response``: the OpenAI Agents SDK's streams;
    anthropic's ``with_raw_response``) a stream is parsed: that builds the Stream without reading
    it; so is a converted call's body, which must become the caller's protocol's answer on its way;
    any other body is left to the caller."""
    types = call.client.types()
    if types.legacy_response is not None and isinstance(resp, types.legacy_response):
        return True
    return (call.stream or call.converted) and isinstance(resp, types.responses)


def _finish(resp, call: Call, parsed=None):
    """After the call returned: hand a stream to the captured decoder, record a response."""
    call.returned()
    if parsed is not None:
        resp, raw = parsed, resp
    else:
        raw = None
    if call.stream:
        if not tap(resp, call, read):
            call.set_status("unparsed_response")
            call.finish(False, counted=True)
        else:
            call.set_status("stream_incomplete")
        return raw if raw is not None else resp
    if not call.converted and not call.fed:   # the JSON hook did not see the response: read the object
        try:
            call.cap.add(resp, hide=True)
        except Exception:
            call.unreadable()
    call.finish(True)
    return raw if raw is not None else resp


def _straight_post(client: Client, wrapped, instance, args, kwargs):
    """``_sync_post`` of a client with a straight line for its common call (:mod:`.straight`, and
    :mod:`.straight_stream` for a stream)."""
    line = straight.prepare(client, instance, args, kwargs, _StraightStream if kwargs.get("stream") else _Straight)
    if line is None:
        return _sync_post(client, wrapped, instance, args, kwargs)
    call, args = line
    try:
        token = FEEDING.set(call)
        try:
            if call.owned:
                with trace.use_span(call.span, end_on_exit=False):
                    resp = wrapped(*args, **kwargs)
            else:
                resp = wrapped(*args, **kwargs)
        finally:
            FEEDING.reset(token)
            call.settle()
    except BaseException as exc:
        _failed(call.general(), exc)
        raise
    if call.call is None:
        if call.done:   # the straight line read the answer
            if call.values is not None:   # (read, not recorded yet: a span of our own)
                call.record(*call.values)
            if call.owned:
                call.span.end()
            return resp
        if call.stream and call.tap(resp):   # its decoder reads the stream
            return resp
    return _answered(resp, call.general())   # the general path reads or has read it


def _sync_post(client: Client, wrapped, instance, args, kwargs):
    call, kwargs = prepare(client, instance, args, kwargs)
    if call is None:
        return wrapped(*args, **kwargs)
    if call.path is not None and args:
        args = call.args(args)
    try:
        # the response is decoded inside: the JSON hook feeds the call (one that captures)
        token = FEEDING.set(call if call.cap is not None else None)
        try:
            if call.owned:
                with trace.use_span(call.span, end_on_exit=False):
                    resp = wrapped(*args, **kwargs)
            else:   # (the span is the current one, or the client's, adopted as it starts)
                resp = wrapped(*args, **kwargs)
        finally:
            FEEDING.reset(token)
            call.settle()
    except BaseException as exc:
        _failed(call, exc)
        raise
    if call.cap is None:
        return call.passed(resp)
    return _answered(resp, call)


def _answered(resp, call: Call):
    """After a captured call's ``post`` returned: parse a raw response, record (``_finish``)."""
    parsed = None
    if _parse(resp, call):
        token = FEEDING.set(call)
        try:
            parsed = resp.parse()
        except Exception:  # the caller's own parse() raises the same error; telemetry stays quiet
            log.debug("lightspan: could not parse a raw response", exc_info=True)
            return resp
        finally:
            FEEDING.reset(token)
    return _finish(resp, call, parsed)


async def _async_post(client: Client, wrapped, instance, args, kwargs):
    call, kwargs = prepare(client, instance, args, kwargs)
    if call is None:
        return await wrapped(*args, **kwargs)
    args = call.args(args)
    try:
        with trace.use_span(call.span, end_on_exit=False) if call.owned else nullcontext():
            token = FEEDING.set(call if call.cap is not None else None)
            try:
                resp = await wrapped(*args, **kwargs)
            finally:
                FEEDING.reset(token)
                call.settle()
    except BaseException as exc:
        _failed(call, exc)
        raise
    if call.cap is None:
        return call.passed(resp)
    parsed = None
    if _parse(resp, call):
        token = FEEDING.set(call)
        try:
            parsed = resp.parse()
            if hasattr(parsed, "__await__"):
                parsed = await parsed
        except Exception:
            log.debug("lightspan: could not parse a raw response", exc_info=True)
            return resp
        finally:
            FEEDING.reset(token)
    return _finish(resp, call, parsed)


_ACTIVE = {"on": False}


def _wrap_library(client: Client):
    def hook(module) -> None:
        if not _ACTIVE["on"]:
            return
        post = _straight_post if client.straight else _sync_post
        wrap(f"{client.name}._base_client", "SyncAPIClient.post", functools.partial(post, client))
        wrap(f"{client.name}._base_client", "AsyncAPIClient.post", functools.partial(_async_post, client))
        install_json_hooks(_response_json_hook)
    return hook


def attach(provider=None) -> None:
    """Register lightspan's span processors on ``provider`` (default: the instrumentor's, else the
    global one) when it is an SDK provider that lacks them: spans.NESTING, and with
    ``LIGHTSPAN_SPOOL`` set (read now), the spool that keeps every ended span should the process die
    (:mod:`.spool`). ``instrument()`` calls it; so does a process that sets its SDK provider only
    after instrumenting, as a rollout worker's child does (rollout/zygote.py)."""
    provider = provider or spans.tracer_provider() or trace.get_tracer_provider()
    spans.add_processor(provider)
    spool.attach(provider)


class LightspanInstrumentor(BaseInstrumentor):
    """Adds token-id and logprob capture to the ``openai`` and ``anthropic`` clients (see the module
    docstring)."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()   # openai, anthropic or both: each is wrapped when it is imported

    def _instrument(self, **kwargs):
        spans.set_tracer_provider(kwargs.get("tracer_provider"))
        attach()
        _ACTIVE["on"] = True
        register()
        for client in CLIENTS.values():
            register_post_import_hook(_wrap_library(client), f"{client.name}._base_client")

    def _uninstrument(self, **kwargs):
        _ACTIVE["on"] = False
        spans.NESTING.active = False
        spans.set_tracer_provider(None)
        unwrap_all()
        remove_json_hooks()


__all__ = ["LightspanInstrumentor", "semconv", "should_capture", "with_capture", "is_llm_span"]
