"""What every protocol module shares: the :class:`Protocol` row, reading vLLM's JSON, the statuses.

A protocol module (:mod:`.chat`, :mod:`.completions`, :mod:`.responses`, :mod:`.anthropic_messages`)
ends with its row, a :class:`Protocol` whose fields are the module's functions; the table of rows
is :data:`lightspan.tracing.protocols.PROTOCOLS`. Both transports call through a row: the
instrumentor (:mod:`lightspan.tracing.calls`, inside the agent's process, on the client's decoded
JSON) and the gateway (:mod:`lightspan.rollout.exchanges`, on the HTTP bytes). Pure: no I/O here
or in a protocol module.

A capture (what ``Protocol.capture`` makes) has one interface whatever the protocol:
``add(payload, hide=)`` / ``add_json(payload, hide)`` fold in a response or one stream payload of
the protocol's own (``hide``: hand the caller ``null`` for what only lightspan asked for), ``fed``
and ``readable``, ``status()``, ``attributes(model_version)`` (the ``lightspan.*`` ones),
``genai_attributes()`` and ``model``; ``converted`` says whether the call goes to vLLM as a chat
completion, and then ``message(completion)`` is the caller's answer to vLLM's chat completion,
``events(chunk)`` the caller's events of one chat chunk and ``end()`` those at its ``[DONE]``
(the capture reads the ids first), ``unconverted(why)`` the capture of the call sent as it is when
the transport cannot convert it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from lightspan.tracing import semconv

REASONS = {
    "unparsed_response": "the answer was not a completion lightspan could read (a raw or streaming response "
                         "the caller read itself): read it with the client's parsed objects",
    "no_token_ids": "the server returned no token ids: is it vLLM (0.10.2 or later)? Hosted APIs return none; "
                    "point the agent at the vLLM server, or at a lightspan gateway in front of it",
    "multiple_prompts": "a completions request with several prompts: a span holds one prompt; send one per request",
    "logprobs_mismatch": "the server did not return one logprob per completion token",
    "stream_incomplete": "the stream was not read to its end (the agent stopped reading, or the connection broke)",
    "capture_error": "lightspan could not read the answer (a bug: please report it with the agent's log)",
    "gateway": "captured by a lightspan gateway (LIGHTSPAN_CAPTURE_URLS=none): the gateway's span of this call, this "
               "span's child through traceparent, carries the ids, and this span counts only when that one never "
               "reached the store: is the gateway exporting to this collector?",
}
"""Why a call was not captured, and the fix, by ``lightspan.capture.status`` (``lightspan.capture.reason``)."""

CHAT_PATH = "/chat/completions"
"""Where a converted call goes, in place of its protocol's path: vLLM's chat completions, whose
answer has the token ids and a logprob per token."""


@dataclass(frozen=True)
class Protocol:
    """One protocol: what lightspan asks vLLM for, and how the answer reaches the caller and the span.

    ``exchange`` below is the gateway's call in flight (:class:`lightspan.rollout.exchanges.Exchange`):
    its ``cap``, ``strip`` (hide what only the gateway asked for), ``finished`` (the stream's end
    marker was read) and ``read(payload)`` (fold a decoded payload into the capture, never raising)."""

    name: str
    """The table's key; ``lightspan.capture`` counts and the gateway's endpoints name it."""
    client: str
    """The Python client library that speaks it (:mod:`lightspan.tracing.clients`)."""
    path: str
    """How its request path ends (``/chat/completions``); the gateway serves ``/v1`` + it."""
    operation: str
    """``gen_ai.operation.name`` of its calls."""
    provider: str
    """``gen_ai.provider.name`` of its calls (``gen_ai.system`` in the conventions before v0.1.0:
    ``semconv.genai`` writes the names asked for)."""
    capture: Callable
    """(the caller's body, as JSON) -> the call's capture."""
    request: Callable
    """(capture, the caller's body) -> the body sent: the capture fields added, or the chat completion
    it converts to (sent to :data:`CHAT_PATH`)."""
    inputs: Callable
    """(the caller's body) -> ``gen_ai.input.messages``."""
    output: Callable
    """(capture, stream) -> a ``ChatOutput`` to feed with the chat payloads as they pass, or None
    when the capture holds what :attr:`outputs` needs."""
    outputs: Callable
    """(capture, that output or None) -> ``gen_ai.output.messages`` (None: none)."""
    frames: Callable
    """(exchange, line) -> the frames the gateway relays for one line of the protocol's own event
    stream (a call that is not converted; a converted call's are its capture's ``events``)."""
    end: Callable
    """(exchange) -> the frames of that stream's end, sent once the span has ended."""
    error: Callable
    """(status, message, param) -> the gateway's own error answer (bytes) in the protocol's shape."""
    upstream_error: Callable
    """(capture, content type, body) -> vLLM's error answer as the caller gets it."""
    fields: dict
    """The request fields the gateway reads itself, with the JSON types it reads them as:
    {name: (Python types, "a boolean")}; one of the wrong type is a 400 naming it."""
    common: Callable | None = None
    """(the caller's body, its client's sentinels dropped) -> the capture of a request of the
    protocol's common shape, made in one pass, whose ``chat_body`` is sent as it is and which holds
    what its output messages are made of (``output`` gives None for it); None for any other
    request. The instrumentor takes such a call in a straight line (:func:`lightspan.tracing.calls.prepare`),
    any other the general way. None: no such shape (every request goes the general way)."""
    late_span: bool = False
    """Whether the GenAI instrumentation's span of a call starts only after the call returns
    (traceloop's Responses wrapper): the instrumentor then opens a span of its own for it."""


def converted_path(path: str, protocol: Protocol) -> str:
    """The path a converted call goes to: ``path`` (``…/v1/responses?q``) with the protocol's
    ``path`` made :data:`CHAT_PATH`, the query kept."""
    head, mark, query = path.partition("?")
    return head[:head.rindex(protocol.path)] + CHAT_PATH + mark + query


def loads(data: bytes | str):
    """Decoded JSON, as ``json.loads(data)`` gives it, in a third to a half of its time.

    orjson refuses what ``json`` accepts beyond the JSON standard — ``NaN``/``Infinity`` literals,
    numbers that overflow a double, lone surrogate escapes, encodings other than UTF-8 — and those
    bodies go to ``json.loads``, so they decode (or fail) exactly as they would without lightspan.
    One difference is left: an integer beyond 64 bits comes back from orjson as a float; vLLM's
    responses hold none (ids, counts and timestamps), and only calls lightspan captures, bound for
    the configured RL endpoints, are decoded here.
    """
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""JSON text as the gateway writes it (compact, as vLLM does; non-ASCII as it is)."""


def _get(obj, name: str):
    """A field of a JSON dict or of a client's parsed object (vLLM's extra fields included).

    An openai object is a pydantic model: its fields are in ``__dict__`` and vLLM's extra fields in
    ``__pydantic_extra__``. Reading those directly skips pydantic's ``__getattr__``, which costs
    microseconds per absent name (an exception each): per stream chunk, that was most of our cost.
    """
    if isinstance(obj, dict):
        return obj.get(name)
    try:
        extra = obj.__pydantic_extra__
        fields = obj.__dict__
    except AttributeError:
        return getattr(obj, name, None)
    if name in fields:
        return fields[name]
    return extra.get(name) if extra else None


def _clear(obj, name: str) -> None:
    """Set a field of a JSON dict or of an openai object (an extra field included) to None."""
    if isinstance(obj, dict):
        obj[name] = None
    elif name in obj.__dict__:
        setattr(obj, name, None)
    elif getattr(obj, "__pydantic_extra__", None):
        obj.__pydantic_extra__[name] = None


def _set(obj, name: str, value) -> None:
    """Set a field of a JSON dict or of a parsed object that has it (an extra field included)."""
    if isinstance(obj, dict):
        obj[name] = value
    elif name in getattr(obj, "__dict__", {}):
        setattr(obj, name, value)
    elif getattr(obj, "__pydantic_extra__", None) and name in obj.__pydantic_extra__:
        obj.__pydantic_extra__[name] = value


def temperature(body: dict) -> float | None:
    """The request's sampling temperature, when it is a number (vLLM's processed logprobs are
    tempered: the trainer tempers its logits the same way)."""
    value = body.get("temperature")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


class OverChat:
    """A capture of a call sent to vLLM as a chat completion (:class:`~.responses.ConvertedCapture`,
    :class:`~.anthropic_messages.AnthropicCapture`): ``chat_body`` is the converted request (None
    when the request does not convert: ``unsupported`` says why), ``chat`` the chat-completions
    capture of vLLM's answer, whose state the transports read through this one."""

    chat_body: dict | None = None
    unsupported: str | None = None

    def convert(self, body: dict, to_chat: Callable, unsupported: type) -> None:
        """Set ``chat_body`` to ``to_chat(body)``, else ``unsupported`` to why not (``unsupported``:
        the conversion's exception for what it does not reproduce; a malformed body is one too:
        vLLM refuses it, not lightspan)."""
        try:
            self.chat_body = to_chat(body)
        except unsupported as e:
            self.unsupported = str(e)
        except (TypeError, AttributeError, KeyError, IndexError) as e:
            self.unsupported = f"a malformed body ({type(e).__name__}: {e})"

    @property
    def converted(self) -> bool:
        """Whether the call goes to chat completions (else to its protocol's own path, as it is)."""
        return self.chat_body is not None

    @property
    def fed(self) -> int:
        return self.chat.fed

    @property
    def readable(self) -> bool:
        return self.chat.readable

    @readable.setter
    def readable(self, value: bool) -> None:
        self.chat.readable = value

    @property
    def temperature(self):
        return self.chat.temperature

    @property
    def model(self):
        """The model vLLM's chat answer names (the request's model: with several policies, its name)."""
        return self.chat.model

    def add(self, payload, *, hide: bool = False) -> None:
        """(Nothing but chat completions reaches a converted capture: its ``message`` and ``events``
        read them; an answer of the protocol's own path holds nothing to read.)"""

    def add_json(self, payload: dict, hide: bool = False) -> None:
        """(As :meth:`add`.)"""


def sampling_attributes(attrs: dict, model_version: int | None, temperature: float | None) -> dict:
    """``attrs`` with the serving policy's version and the request's temperature (the trainer tempers
    its logits the same way to compare its logprobs with the recorded ones), those that are set."""
    if model_version is not None:
        attrs[semconv.MODEL_VERSION] = int(model_version)
    if temperature is not None:
        attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] = temperature
    return attrs


# --- the gateway's framing ----------------------------------------------------------------------

def sse_data(line: bytes) -> bytes | None:
    """The payload of an SSE ``data:`` line, else None."""
    return line[5:].strip() if line.startswith(b"data:") else None


def sse_event(name: str, data: dict) -> bytes:
    """One named server-sent event."""
    return b"event: " + name.encode() + b"\ndata: " + dumps(data).encode() + b"\n\n"


_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def openai_error(status: int, message: str, param: str | None = None) -> bytes:
    """OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}`` (``code`` the
    status, as vLLM sends it): the gateway's own errors on every OpenAI protocol and path."""
    kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


def as_sent(cap, content_type: str, body: bytes) -> tuple[str, bytes]:
    """vLLM's error answer, as it came (it is in the caller's protocol's shape already)."""
    return content_type, body


def no_output(cap, stream: bool) -> None:
    """(The capture holds the answer the span's output messages are made of.)"""
    return None


NUMBER = (int, float)
COMMON_FIELDS = {"model": (str, "a string"), "stream": (bool, "a boolean"), "temperature": (NUMBER, "a number")}
"""The request fields every protocol's gateway path reads (``null`` is always allowed: it is what an
unset field is)."""
