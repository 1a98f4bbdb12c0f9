"""The straight line of the common plain Anthropic call: its whole life in two steps, as the
floor of bench/capture_floor_converted.py lives it.

A non-streamed Anthropic Messages call of the common shape (:func:`.protocols.anthropic_common.common_chat`)
bound for a capture URL is prepared by :func:`prepare` (the shape checked, the chat body built, the
span picked; what depends only on the client's base URL, the path and the variables read is made
once per such key, :class:`_Line`, and per model, :class:`_Model`), and its plain answer (what
:func:`.protocols.anthropic_common._plain` accepts, with ids and logprobs of the same length and
the prompt's ids) is read by :meth:`Straight.answer`: the caller's message made, and every attribute
the general path (:class:`.call.Call`, :class:`.protocols.anthropic_common.SimpleCapture`) sets
put on the span in one ``set_attributes``, the report counted in one step. A stream of the same
shape takes its own straight line (:mod:`.straight_stream`: prepared here, ``kind``). Anything
else — another shape, an answer that is not plain, a raw response, an LLM span of another
instrumentation or a framework's, an error — goes the general way: :meth:`Straight.general` makes
the general path's :class:`~.call.Call` of the call at any point before its answer is read.
``ON`` switches it off (tests/tracing/test_straight.py holds the two paths equal). The variables
are read once per call, as it is prepared (the general path reads them again as it records).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from itertools import compress
from operator import itemgetter, not_
from struct import pack

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace

from lightspan.tracing import hooks, semconv, spans
from lightspan.tracing.call import _VARIABLES, Call, _settings, _start_attributes, _start_names
from lightspan.tracing.calls import _converted_path, _protocol_of, _route
from lightspan.tracing.clients import _anthropic_prepare, _class_decoder
from lightspan.tracing.protocols import anthropic_messages
from lightspan.tracing.protocols.anthropic_common import SimpleCapture, common_chat
from lightspan.tracing.protocols.anthropic_convert import stop_reason, usage
from lightspan.tracing.protocols.base import REASONS
from lightspan.tracing.report import CAPTURED, REPORT
from lightspan.tracing.streams import converted_event_type

ON = [True]   # False: every call goes the general way
PROTOCOL = anthropic_messages.PROTOCOL
_RAW_RESPONSE_HEADER = "X-Stainless-Raw-Response"
_LOGPROB = itemgetter("logprob")   # (each token's, in C)
_OP, _LLM_TYPE, _LLM_OPERATIONS = semconv.GEN_AI_OPERATION_NAME, semconv.LLM_REQUEST_TYPE, semconv.LLM_OPERATIONS
_SUPPRESS = spans.SUPPRESS_LLM_KEY
_PROMPT, _IDS, _LOGPROBS = semconv.PROMPT_TOKEN_IDS, semconv.COMPLETION_TOKEN_IDS, semconv.COMPLETION_LOGPROBS
_STATUS, _REASONS = semconv.CAPTURE_STATUS, semconv.GEN_AI_RESPONSE_FINISH_REASONS
_TEMPERATURE, _VERSION, _POLICY = semconv.GEN_AI_REQUEST_TEMPERATURE, semconv.MODEL_VERSION, semconv.POLICY_NAME
_INPUTS, _OUTPUTS = semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES
_ERROR = {semconv.CAPTURE_STATUS: "capture_error", semconv.CAPTURE_REASON: REASONS["capture_error"]}
_ADOPTING = spans.NESTING.adopting   # (the one Nesting's: made once)


class _Line:
    """What a call of one client's base URL and path, under one reading of the variables, shares."""
    __slots__ = ("client", "chat_path", "settings", "response", "models", "sentinel", "event", "decoder")

    def __init__(self, client, chat_path: str, settings, response: type):
        self.client, self.chat_path, self.settings, self.response = client, chat_path, settings, response
        self.models: dict = {}
        self.sentinel = _anthropic_prepare()[2]   # whether a type is one of the client's sentinels
        # a stream's: the client's event type for converted events, its own SSE decoder's type
        self.event, self.decoder = converted_event_type(client), client.types().sse_decoder

    def model(self, model: str) -> "_Model":
        found = self.models.get(model)
        if found is None:
            found = self.models[model] = _Model(self, model)
        return found


class _Model:
    """What a call of one model on one :class:`_Line` shares: its span's name, the constant part of
    its attributes, what the variables say (read off the line's settings once)."""
    __slots__ = ("line", "model", "name", "adopted", "content", "versions", "version")

    def __init__(self, line: _Line, model: str):
        now = line.settings
        self.line, self.model, self.name = line, model, f"{PROTOCOL.operation} {model}".strip()
        self.adopted = _start_names(PROTOCOL.operation, model, PROTOCOL.provider, now.opt_in, True)
        self.content, self.versions = now.content, now.policy_versions
        self.version = None if now.model_version is None else int(now.model_version)


@functools.lru_cache(maxsize=64)
def _line(base: str, path: str, raw: tuple, client) -> _Line | None:
    """The :class:`_Line` of calls to ``path`` of a ``client`` of ``base``, None when they go the
    general way (another protocol, not a capture URL, Agent Lightning's proxy, no HTTP library)."""
    if _protocol_of(path, client.name) is not PROTOCOL:
        return None
    now = _settings(raw)
    captured, agl = _route(base, path, now.capture_urls, now.agl_base_url)
    module = sys.modules.get("anthropic._base_client")
    http = getattr(module, "httpx2", None) or getattr(module, "httpx", None)
    if not captured or agl or http is None:
        return None
    return _Line(client, _converted_path(path, PROTOCOL.name), now, http.Response)


_LAST: list = [(None, None, None, None)]   # (base URL object, path, variables, its line) of the last call
_ENV: list = [None, None, None]   # (os.environ, what reads a variable's raw value from it, the variables' keys)


def _environ() -> list:
    """:data:`_ENV` for ``os.environ`` now: :func:`.semconv.env_raw`'s reading of the variables,
    its look-ups made once (``os.environ`` keeps its dict of encoded values for its life)."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if type(data) is dict:
        _ENV[:] = [environ, data.get, tuple(map(environ.encodekey, _VARIABLES))]
    else:   # (a test's plain dict)
        _ENV[:] = [environ, environ.get, _VARIABLES]
    return _ENV


def prepare(client, instance, args, kwargs, kind: type):
    """(the call, the ``post`` positional arguments to call with) of a call that takes the straight
    line, its keyword arguments made the ones to call with (``body``, ``options``, ``path``), else
    None (nothing done, nothing changed: the general steps take it). ``kind``: :class:`Straight`
    for a plain call, :class:`.straight_stream.StraightStream` for a stream (``post``'s ``stream``)."""
    body = kwargs.get("body")
    options = kwargs.get("options")
    if type(body) is not dict or type(options) is not dict or not ON[0]:
        return None
    headers = options.get("headers")
    if headers and (type(headers) is not dict or headers.get(_RAW_RESPONSE_HEADER) is not None):
        return None
    path = args[0] if args else kwargs.get("path", "")
    url = getattr(instance, "base_url", "")
    env = _ENV if os.environ is _ENV[0] else _environ()
    raw = tuple(map(env[1], env[2]))   # (``semconv.env_raw(_VARIABLES)``)
    last = _LAST[0]
    if last[0] is not url or last[1] != path or last[2] != raw:
        if type(path) is not str:
            return None
        last = _LAST[0] = (url, path, raw, _line(str(url), path, raw, client))
    line = last[3]
    if line is None or not hooks.hooked(line.response):
        return None
    if "extra_json" in options:   # (sent in the body: the options go on without it)
        extra = options["extra_json"]
        asked = {**body, **extra} if type(extra) is dict and extra else body
        options = dict(options)
        del options["extra_json"]
    else:
        asked = body
    given = dict(compress(asked.items(), map(not_, map(line.sentinel, map(type, asked.values())))))
    chat = common_chat(given, capture=True)
    if chat is None or ("stream" in chat) is not kind.stream:   # (a stream in the body and in ``post``'s or neither)
        return None
    # (a stream's events must come from lightspan's decoder: a client with a decoder of its own goes the
    # general way, ``clients._own_decoder`` says so there)
    if kind.stream and not (_class_decoder(type(instance)) and "_make_sse_decoder" not in instance.__dict__):
        return None
    now = otel_context.get_current()   # (an LLM span of another instrumentation's, or a framework's)
    attrs = getattr(trace.get_current_span(now), "attributes", None)
    if (attrs and (attrs.get(_OP) or attrs.get(_LLM_TYPE)) in _LLM_OPERATIONS) or (
            spans.NESTING.active and now.get(_SUPPRESS)):
        return None
    model = chat["model"]
    call = kind(line.models.get(model) or line.model(model), given, chat)
    kwargs["body"], kwargs["options"] = chat, options   # (wrapt's: the wrapper's own dict)
    if args:
        args = (line.chat_path, *args[1:])
    else:
        kwargs["path"] = line.chat_path
    if client.own_spans and getattr(instance, "_tracer", None) is not None:   # the SDK's span, adopted as it starts
        call.deferred = (_ADOPTING.set(call), time.time_ns())
    else:
        call.span, call.owned = spans.open_span(call.model.name, call.start()), True
    return call, args


class Straight:
    """A call on the straight line (module docstring): its request, span, and answer's values."""
    span = deferred = call = values = None   # (class defaults: each call sets few of them)
    owned = adopted = done = False
    stream = False   # (:class:`.straight_stream.StraightStream`: True)

    def __init__(self, model: _Model, given: dict, chat: dict):
        self.model, self.given, self.chat = model, given, chat

    def start(self, adopted: bool = False) -> dict:
        """The start attributes of the call's span (``_start_attributes``'s)."""
        now = self.model.line.settings
        return _start_attributes(PROTOCOL, self.model.model, self.given, [], now.content, adopted, now.opt_in)

    def adopt(self, span) -> None:
        """The client library's span of this call started (spans.Nesting): record on it."""
        if self.call is not None:
            self.call.adopt(span)
        self.span, self.adopted = span, True

    def general(self) -> Call:
        """The general path's :class:`~.call.Call` of this call, from now on (before its answer is read)."""
        if self.call is None:
            line, model = self.model.line, self.model.model
            call = self.call = Call(line.client, PROTOCOL, SimpleCapture(self.given, self.chat), self.stream)
            call.content, call.name = line.settings.content, self.model.name
            call.start = functools.partial(_start_attributes, PROTOCOL, model, self.given, [], line.settings.content)
            call.span, call.owned, call.adopted, call.deferred = self.span, self.owned, self.adopted, self.deferred
            self.deferred = None
        return self.call

    def settle(self) -> None:
        """``Call.settle``: the client's ``post`` returned or raised (``spans.NESTING.stop_adopting``
        written out: the SDK's span, if any, has started by now)."""
        deferred = self.deferred
        if deferred is None:
            if self.call is not None:
                self.call.settle()
            return
        self.deferred = None
        try:
            _ADOPTING.reset(deferred[0])
        except ValueError:   # (a token of another context: never break the agent's call over telemetry)
            _ADOPTING.set(None)
        if self.span is None:
            self.span, self.owned = spans.open_span(self.model.name, self.start(), start_time=deferred[1]), True

    def answer(self, data) -> dict | None:
        """The caller's message of a plain answer (recorded at once on an adopted span, as the
        general path does), else None: the general path reads it."""
        if self.call is not None:
            return None
        try:   # (subscripts: of JSON data, only what the general path reads the same way gets past them)
            (choice,) = data["choices"]
            part, ids, content, prompt = choice["message"], choice["token_ids"], choice["logprobs"]["content"], \
                data["prompt_token_ids"]
            if (type(part) is not dict or not part or choice.get("index") or part.get("reasoning")
                    or part.get("tool_calls") or type(ids) is not list or not ids or type(prompt) is not list
                    or type(content) is not list or len(content) != len(ids)):
                return None
            text = part.get("content")
            if text is not None and type(text) is not str:
                return None
            # ``semconv.encode_ids`` and ``encode_floats`` of lists, written out (struct's ``<f`` is
            # ``array("f")``'s float32, little-endian; it refuses a finite double beyond float32's range)
            n, count = len(prompt), len(ids)
            packed = (pack(f"<{n}i", *prompt), pack(f"<{count}i", *ids), pack(f"<{count}f", *map(_LOGPROB, content)))
            finish = choice.get("finish_reason")
            reason, sequence = stop_reason(finish, choice.get("stop_reason"), False, False)
            # ``anthropic_convert.message_of`` of a plain answer (its ``usage`` without cached prompt tokens written out)
            message = {"id": data.get("id") or f"msg_{int(time.time() * 1000)}", "type": "message",
                       "role": "assistant", "content": [{"type": "text", "text": text or ""}], "model": data.get("model")}
            if reason is not None:
                message["stop_reason"] = reason
            if sequence is not None:
                message["stop_sequence"] = sequence
            u = data.get("usage")
            if u and not u.get("prompt_tokens_details"):
                message["usage"] = {"input_tokens": max(0, u.get("prompt_tokens") or 0),
                                    "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                                    "output_tokens": u.get("completion_tokens") or 0}
            else:
                message["usage"] = usage(u)
            if "kv_transfer_params" in data and data["kv_transfer_params"] is not None:
                message["kv_transfer_params"] = data["kv_transfer_params"]
            if "ec_transfer_params" in data and data["ec_transfer_params"] is not None:
                message["ec_transfer_params"] = data["ec_transfer_params"]
            # the attributes that do not depend on the span (``record`` adds the rest)
            attrs = {_PROMPT: packed[0], _IDS: (packed[1],), _LOGPROBS: (packed[2],), _STATUS: CAPTURED}
            temperature = self.chat.get("temperature")
            if temperature is not None:
                attrs[_TEMPERATURE] = float(temperature)
            if reason or finish:
                attrs[_REASONS] = (reason or finish,)
            if self.model.content:   # (``messages.dumps``: text only, no ``default`` needed)
                attrs[_OUTPUTS] = orjson.dumps([{
                    "role": "assistant", "parts": [{"type": "text", "content": text}] if text else [],
                    "finish_reason": reason or finish or None}]).decode()
        except Exception:
            return None
        self.done = True
        if self.adopted:   # the client ends its span of the call once it has read this
            self.record(attrs, data.get("model"), n, count)
        else:
            self.values = (attrs, data.get("model"), n, count)
        return message

    def record(self, attrs: dict, model, prompt_tokens: int, output_tokens: int) -> None:
        """Every attribute the general path sets for the answer read (``attrs``: those that do not
        depend on the span, from :meth:`answer`), in one ``set_attributes``; counted."""
        span, m = self.span, self.model
        live = self.adopted and span.is_recording()   # (an SDK span records until it ends)
        try:
            if self.adopted and not live:   # (``Call._live``: the library ended its span already)
                span = self.span = spans.open_span(m.name, self.start(), start_time=span.start_time)
                self.owned, self.adopted = True, False
            versions = m.versions
            if versions:   # (``served_policy``)
                served = model or getattr(span, "attributes", {}).get(semconv.GEN_AI_REQUEST_MODEL)
                if served in versions:
                    attrs[_VERSION] = int(versions[served])
                    attrs[_POLICY] = served
                elif m.version is not None:
                    attrs[_VERSION] = m.version
            elif m.version is not None:
                attrs[_VERSION] = m.version
            if live:
                attrs.update(m.adopted)
                if m.content:   # (``anthropic_input`` of the common request, from its chat messages)
                    inputs, last = [], None
                    for turn in self.chat["messages"]:
                        role = turn["role"]
                        if role == last:
                            inputs[-1]["parts"].append({"type": "text", "content": turn["content"]})
                        else:
                            inputs.append({"role": role, "parts": [{"type": "text", "content": turn["content"]}]})
                            last = role
                    attrs[_INPUTS] = orjson.dumps(inputs).decode()
            else:
                if model:
                    attrs[semconv.GEN_AI_RESPONSE_MODEL] = str(model)
                attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = prompt_tokens
                attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = output_tokens
        except Exception:   # never break the agent's call over telemetry
            attrs = _ERROR
        if live or span.is_recording():
            span.set_attributes(attrs)
        report = REPORT
        if attrs is _ERROR:
            report.count(attrs[_STATUS], attrs[semconv.CAPTURE_REASON])
        else:   # (``Report.captured``)
            with report.lock:
                report.counts[CAPTURED] += 1
