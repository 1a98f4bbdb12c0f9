"""Anthropic Messages (``POST /v1/messages``) captured through vLLM's chat completions (see
:mod:`.anthropic_convert`): what vLLM is asked for, and what the caller and the span get.

:class:`~.anthropic_capture.AnthropicCapture` holds the converted request and a chat-completions
:class:`~.chat.Capture` of vLLM's answer: it reads the answer's ids and logprobs, and turns the
answer into what the caller asked for (:meth:`~.anthropic_capture.AnthropicCapture.message` for a response,
:meth:`~.anthropic_capture.AnthropicCapture.events` for each stream chunk); the common request (text turns) takes
fewer steps (:mod:`.anthropic_common`). A request the conversion cannot reproduce
goes to ``/v1/messages`` as it is (``unsupported_request``: that route gives no ids). Errors are
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``. Only the ``anthropic``
client speaks it.
"""

from __future__ import annotations

from lightspan.tracing.messages import _append, _arguments, _text_of
from lightspan.tracing.protocols.anthropic_capture import AnthropicCapture
from lightspan.tracing.protocols.anthropic_common import (SimpleCapture, _plain, capture, common_capture,  # noqa: F401
                                                         common_chat)
from lightspan.tracing.protocols.anthropic_convert import to_error
from lightspan.tracing.protocols.base import COMMON_FIELDS, Protocol, dumps, loads
from lightspan.tracing.protocols.chat_messages import ChatOutput


# --- the call's messages (docs: lightspan.tracing.messages) -----------------------------------------

def anthropic_input(body: dict) -> list:
    messages: list = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "parts": [{"type": "text", "content": _text_of(system)}]})
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        role, content = m.get("role") or "user", m.get("content")
        if isinstance(content, str):
            _append(messages, role, [{"type": "text", "content": content}])
            continue
        for block in content or ():
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "text":
                _append(messages, role, [{"type": "text", "content": block.get("text") or ""}])
            elif kind == "tool_use":
                _append(messages, role, [{"type": "tool_call", "id": block.get("id"), "name": block.get("name"),
                                          "arguments": block.get("input")}])
            elif kind == "tool_result":
                messages.append({"role": "tool", "parts": [{"type": "tool_call_response", "id": block.get("tool_use_id"),
                                                             "response": _text_of(block.get("content"))}]})
            elif kind == "thinking":
                _append(messages, role, [{"type": "reasoning", "content": block.get("thinking") or ""}])
            else:
                _append(messages, role, [{"type": str(kind), "content": {k: v for k, v in block.items()
                                                                          if k != "source"}}])
    return messages


def anthropic_stream_output(blocks: list, stop_reason: str | None) -> list:
    """The assistant turn of a converted Anthropic stream (``MessageStream.content()``), as
    :class:`ChatOutput` gives it for the chat chunks it was converted from."""
    parts = []
    for kind, block, text in blocks:
        if kind == "thinking" and text:
            parts.append({"type": "reasoning", "content": text})
        elif kind == "text" and text:
            parts.append({"type": "text", "content": text})
        elif kind == "tool_use":
            parts.append({"type": "tool_call", "id": block.get("id"), "name": block.get("name"),
                          "arguments": _arguments(text)})
    return [{"role": "assistant", "parts": parts, "finish_reason": stop_reason}]


def output(cap: AnthropicCapture, stream: bool) -> ChatOutput | None:
    """A converted response's messages are read from the chat completion (a converted stream's from
    its Anthropic blocks, a simple capture's from the answer it read: :func:`outputs`)."""
    return ChatOutput() if cap.converted and not stream and type(cap) is not SimpleCapture else None


def outputs(cap: AnthropicCapture, out: ChatOutput | None) -> list | None:
    if out is not None:
        return out.messages(cap.stop_reason)
    if type(cap) is SimpleCapture and cap.converted and cap.stream is None:
        return cap.output_messages()
    if cap.converted and cap.stream is not None:
        return anthropic_stream_output(cap.stream.content(), cap.stop_reason)
    return None


def request(cap: AnthropicCapture, body: dict) -> dict:
    return cap.request() if cap.converted else body


# --- errors and the gateway's relay of /v1/messages' own stream -------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def error(status: int, message: str, param: str | None = None) -> bytes:
    """The gateway's own error answer in Anthropic's shape (Anthropic's has no ``param``)."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


def upstream_error(cap: AnthropicCapture, content_type: str, body: bytes) -> tuple[str, bytes]:
    """vLLM's error answer in Anthropic's shape: its ``/v1/messages`` errors are already; a
    converted call's chat completions error is made Anthropic's (:func:`~.anthropic_convert.to_error`)."""
    if not cap.converted:
        return content_type, body
    try:
        doc = loads(body)
    except ValueError:
        doc = None
    return "application/json", dumps(to_error(doc)).encode()


def frames(exchange, line: bytes) -> list[bytes]:
    """vLLM's own Anthropic stream (a request the conversion cannot reproduce), as it came."""
    return [line + b"\n"]


def end(exchange) -> list[bytes]:
    exchange.finished = True
    return []


PROTOCOL = Protocol(
    name="messages", client="anthropic", path="/messages", operation="chat", provider="anthropic",
    capture=capture, request=request, inputs=anthropic_input, output=output, outputs=outputs,
    frames=frames, end=end, error=error, upstream_error=upstream_error, fields=COMMON_FIELDS, common=common_capture)
