"""The straight line of the common plain Anthropic call: its whole life in two steps, as the
floor of bench/capture_floor_converted.py lives it.

A non-streamed Anthropic Messages call of the common shape (:func:`.protocols.anthropic_common.common_chat`)
bound for a capture URL is prepared by :func:`prepare` (the shape checked, the chat body built, the
span picked; what depends only on the client's base URL, the path and the variables read is made
once per such key, :class:`_Line`, and per model, :class:`_Model`), and its plain answer (what
:func:`.protocols.anthropic_common._plain` accepts, with ids and logprobs of the same length and
the prompt's ids) is read by :meth:`Straight.answer`: the caller's message made, and every attribute
the general path (:class:`.call.Call`, :class:`.protocols.anthropic_common.SimpleCapture`) sets
put on the span in one ``set_attributes``, the report counted in one step. Anything else — another
shape, a stream, an answer that is not plain, a raw response, an LLM span of another
instrumentation or a framework's, an error — goes the general way: :meth:`Straight.general` makes
the general path's :class:`~.call.Call` of the call at any point before its answer is read.
``ON`` switches it off (tests/tracing/test_straight.py holds the two paths equal). The variables
are read once per call, as it is prepared (the general path reads them again as it records).
"""

from __future__ import annotations

import functools
import sys
import time
from itertools import compress
from operator import itemgetter, not_

from opentelemetry import context as otel_context
from opentelemetry import trace

from lightspan.tracing import hooks, messages, semconv, spans
from lightspan.tracing.call import _VARIABLES, Call, _settings, _start_attributes, _start_names
from lightspan.tracing.calls import _converted_path, _protocol_of, _route
from lightspan.tracing.clients import _anthropic_prepare
from lightspan.tracing.protocols import anthropic_messages
from lightspan.tracing.protocols.anthropic_common import SimpleCapture, common_chat
from lightspan.tracing.protocols.anthropic_convert import stop_reason, usage
from lightspan.tracing.protocols.base import REASONS
from lightspan.tracing.report import CAPTURED, REPORT

ON = [True]   # False: every call goes the general way
PROTOCOL = anthropic_messages.PROTOCOL
_RAW_RESPONSE_HEADER = "X-Stainless-Raw-Response"
_LOGPROB = itemgetter("logprob")   # (each token's, in C)
_OP, _LLM_TYPE, _LLM_OPERATIONS = semconv.GEN_AI_OPERATION_NAME, semconv.LLM_REQUEST_TYPE, semconv.LLM_OPERATIONS
_PROMPT, _IDS, _LOGPROBS = semconv.PROMPT_TOKEN_IDS, semconv.COMPLETION_TOKEN_IDS, semconv.COMPLETION_LOGPROBS
_STATUS, _REASONS = semconv.CAPTURE_STATUS, semconv.GEN_AI_RESPONSE_FINISH_REASONS
_ERROR = {semconv.CAPTURE_STATUS: "capture_error", semconv.CAPTURE_REASON: REASONS["capture_error"]}


class _Line:
    """What a call of one client's base URL and path, under one reading of the variables, shares."""
    __slots__ = ("chat_path", "settings", "response", "models", "sentinel")

    def __init__(self, chat_path: str, settings, response: type):
        self.chat_path, self.settings, self.response = chat_path, settings, response
        self.models: dict = {}
        self.sentinel = _anthropic_prepare()[2]   # whether a type is one of the client's sentinels

    def model(self, model: str) -> "_Model":
        found = self.models.get(model)
        if found is None:
            found = self.models[model] = _Model(model, self.settings)
        return found


class _Model:
    """What a call of one model shares: its span's name and the constant part of its attributes."""
    __slots__ = ("model", "name", "adopted")

    def __init__(self, model: str, settings):
        self.model, self.name = model, f"{PROTOCOL.operation} {model}".strip()
        self.adopted = _start_names(PROTOCOL.operation, model, PROTOCOL.provider, settings.opt_in, True)


@functools.lru_cache(maxsize=64)
def _line(base: str, path: str, raw: tuple, client: str) -> _Line | None:
    """The :class:`_Line` of calls to ``path`` of a client of ``base``, None when they go the
    general way (another protocol, not a capture URL, Agent Lightning's proxy, no HTTP library)."""
    if _protocol_of(path, client) is not PROTOCOL:
        return None
    now = _settings(raw)
    captured, agl = _route(base, path, now.capture_urls, now.agl_base_url)
    module = sys.modules.get("anthropic._base_client")
    http = getattr(module, "httpx2", None) or getattr(module, "httpx", None)
    if not captured or agl or http is None:
        return None
    return _Line(_converted_path(path, PROTOCOL.name), now, http.Response)


_LAST: list = [(None, None, None, None)]   # (base URL object, path, variables, its line) of the last call


def prepare(client, instance, args, kwargs):
    """(the :class:`Straight` call, the ``post`` positional and keyword arguments to call with) of a
    call that takes the straight line, else None (nothing done: the general steps take it)."""
    body = kwargs.get("body")
    options = kwargs.get("options")
    if type(body) is not dict or type(options) is not dict or not ON[0] or kwargs.get("stream") or body.get("stream"):
        return None
    if "headers" in options:
        headers = options["headers"]
        if headers and (type(headers) is not dict or headers.get(_RAW_RESPONSE_HEADER) is not None):
            return None
    path = args[0] if args else kwargs.get("path", "")
    url = getattr(instance, "base_url", "")
    raw = semconv.env_raw(_VARIABLES)
    last = _LAST[0]
    if last[0] is not url or last[1] != path or last[2] != raw:
        if type(path) is not str:
            return None
        last = _LAST[0] = (url, path, raw, _line(str(url), path, raw, client.name))
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
    if chat is None or "stream" in chat:
        return None
    current = trace.get_current_span()   # (an LLM span of another instrumentation's, or a framework's)
    attrs = getattr(current, "attributes", None)
    if (attrs and (attrs.get(_OP) or attrs.get(_LLM_TYPE)) in _LLM_OPERATIONS) or (
            spans.NESTING.active and otel_context.get_value(spans.SUPPRESS_LLM_KEY)):
        return None
    model = chat["model"]
    call = Straight(client, line, line.models.get(model) or line.model(model), given, chat)
    if args:
        call.path = line.chat_path
        args = (line.chat_path, *args[1:])
        kwargs = {**kwargs, "body": chat, "options": options}
    else:
        kwargs = {**kwargs, "body": chat, "options": options, "path": line.chat_path}
    if client.own_spans and getattr(instance, "_tracer", None) is not None:   # the SDK's span, adopted as it starts
        call.deferred = (spans.NESTING.adopting.set(call), time.time_ns())
    else:
        call.span, call.owned = spans.open_span(call.model.name, call.start()), True
    return call, args, kwargs


class Straight:
    """A call on the straight line (module docstring): its request, span, and answer's values."""
    path = span = deferred = call = values = None   # (class defaults: each call sets few of them)
    owned = adopted = done = False

    def __init__(self, client, line: _Line, model: _Model, given: dict, chat: dict):
        self.client, self.line, self.model, self.given, self.chat = client, line, model, given, chat

    def start(self, adopted: bool = False) -> dict:
        """The start attributes of the call's span (``_start_attributes``'s)."""
        now = self.line.settings
        return _start_attributes(PROTOCOL, self.model.model, self.given, [], now.content, adopted, now.opt_in)

    def adopt(self, span) -> None:
        """The client library's span of this call started (spans.Nesting): record on it."""
        if self.call is not None:
            self.call.adopt(span)
        self.span, self.adopted = span, True

    def general(self) -> Call:
        """The general path's :class:`~.call.Call` of this call, from now on (before its answer is read)."""
        if self.call is None:
            now, model = self.line.settings, self.model.model
            call = self.call = Call(self.client, PROTOCOL, SimpleCapture(self.given, self.chat), False)
            call.path, call.content, call.name = self.path, now.content, self.model.name
            call.start = functools.partial(_start_attributes, PROTOCOL, model, self.given, [], now.content)
            call.span, call.owned, call.adopted, call.deferred = self.span, self.owned, self.adopted, self.deferred
            self.deferred = None
        return self.call

    def settle(self) -> None:
        """``Call.settle``: the client's ``post`` returned or raised."""
        if self.call is not None:
            self.call.settle()
            return
        if self.deferred is None:
            return
        token, start_ns = self.deferred
        self.deferred = None
        spans.NESTING.stop_adopting(token)
        if self.span is None:
            self.span, self.owned = spans.open_span(self.model.name, self.start(), start_time=start_ns), True

    def answer(self, data) -> dict | None:
        """The caller's message of a plain answer (recorded at once on an adopted span, as the
        general path does), else None: the general path reads it."""
        if self.call is not None or type(data) is not dict:
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
            packed = (semconv.encode_ids(prompt), semconv.encode_ids(ids),
                      semconv.encode_floats(list(map(_LOGPROB, content))))
            finish = choice.get("finish_reason")
            reason, sequence = stop_reason(finish, choice.get("stop_reason"), False, False)
            message = _message(data, text, reason, sequence)
        except Exception:
            return None
        self.values, self.done = (data.get("model"), packed, len(prompt), len(ids), reason or finish, text, finish,
                                  reason), True
        if self.adopted:   # the client ends its span of the call once it has read this
            self.record()
        return message

    def record(self) -> None:
        """Every attribute the general path sets for the answer read, in one ``set_attributes``; counted."""
        values, self.values = self.values, None
        span = self.span
        try:
            model, (prompt, ids, logprobs), prompt_tokens, output_tokens, finish, text, raw_finish, reason = values
            if self.adopted and getattr(span, "end_time", None) is not None:   # (``Call._live``)
                span = self.span = spans.open_span(self.model.name, self.start(), start_time=span.start_time)
                self.owned, self.adopted = True, False
            now = self.line.settings
            versions = now.policy_versions
            if versions:
                served = model or getattr(span, "attributes", {}).get(semconv.GEN_AI_REQUEST_MODEL)
                policy, version = (served, versions[served]) if served in versions else (None, now.model_version)
            else:
                policy, version = None, now.model_version
            attrs = {_PROMPT: prompt, _IDS: (ids,), _LOGPROBS: (logprobs,), _STATUS: CAPTURED}
            if version is not None:
                attrs[semconv.MODEL_VERSION] = int(version)
            temperature = self.chat.get("temperature")
            if temperature is not None:
                attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] = float(temperature)
            if policy is not None:
                attrs[semconv.POLICY_NAME] = policy
            if self.adopted:
                attrs.update(self.model.adopted)
                if now.content:
                    attrs[semconv.GEN_AI_INPUT_MESSAGES] = messages.dumps(_inputs(self.given))
            else:
                if model:
                    attrs[semconv.GEN_AI_RESPONSE_MODEL] = str(model)
                attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = prompt_tokens
                attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = output_tokens
            if finish:
                attrs[_REASONS] = (finish,)
            if now.content:
                attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = messages.dumps([{
                    "role": "assistant", "parts": [{"type": "text", "content": text}] if text else [],
                    "finish_reason": reason or raw_finish or None}])
        except Exception:   # never break the agent's call over telemetry
            attrs = _ERROR
        if span.is_recording():
            span.set_attributes(attrs)
        if attrs is _ERROR:
            REPORT.count(attrs[_STATUS], attrs[semconv.CAPTURE_REASON])
        else:
            REPORT.captured()


def _message(chat: dict, text: str | None, reason: str | None, sequence: str | None) -> dict:
    """``message_of`` of a plain answer (its ``usage`` without cached prompt tokens written out)."""
    out = {"id": chat.get("id") or f"msg_{int(time.time() * 1000)}", "type": "message", "role": "assistant",
           "content": [{"type": "text", "text": text or ""}], "model": chat.get("model")}
    if reason is not None:
        out["stop_reason"] = reason
    if sequence is not None:
        out["stop_sequence"] = sequence
    u = chat.get("usage")
    if u and not u.get("prompt_tokens_details"):
        out["usage"] = {"input_tokens": max(0, u.get("prompt_tokens") or 0), "cache_creation_input_tokens": 0,
                        "cache_read_input_tokens": 0, "output_tokens": u.get("completion_tokens") or 0}
    else:
        out["usage"] = usage(u)
    if "kv_transfer_params" in chat and chat["kv_transfer_params"] is not None:
        out["kv_transfer_params"] = chat["kv_transfer_params"]
    if "ec_transfer_params" in chat and chat["ec_transfer_params"] is not None:
        out["ec_transfer_params"] = chat["ec_transfer_params"]
    return out


def _inputs(body: dict) -> list:
    """``anthropic_input`` of a request of the common shape: text turns, a string system prompt."""
    system = body.get("system")
    out = [{"role": "system", "parts": [{"type": "text", "content": system}]}] if system else []
    last = None
    for turn in body["messages"]:
        role, part = turn["role"], {"type": "text", "content": turn["content"]}
        if role == last:
            out[-1]["parts"].append(part)
        else:
            out.append({"role": role, "parts": [part]})
            last = role
    return out
