"""Anthropic Messages (``POST /v1/messages``) captured through vLLM's chat completions (see
:mod:`.anthropic_convert`): what vLLM is asked for, and what the caller and the span get.

:class:`AnthropicCapture` holds the converted request and a chat-completions
:class:`~.chat.Capture` of vLLM's answer: it reads the answer's ids and logprobs, and turns the
answer into what the caller asked for (:meth:`~AnthropicCapture.message` for a response,
:meth:`~AnthropicCapture.events` for each stream chunk). A request the conversion cannot reproduce
goes to ``/v1/messages`` as it is (``unsupported_request``: that route gives no ids). Errors are
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``. Only the ``anthropic``
client speaks it.
"""

from __future__ import annotations

from lightspan.tracing import semconv
from lightspan.tracing.messages import _append, _arguments, _text_of
from lightspan.tracing.protocols.anthropic_convert import (MessageStream, Unsupported, message_of, stop_reason, to_chat,
                                                          to_error, to_message)
from lightspan.tracing.protocols.base import COMMON_FIELDS, OverChat, Protocol, dumps, loads, temperature
from lightspan.tracing.protocols.chat import CHAT, ChatOutput, Capture, with_capture


class AnthropicCapture(OverChat):
    def __init__(self, body: dict):
        self.body = body   # the caller's request, as JSON-ready data
        self.convert(body, to_chat, Unsupported)
        # the Anthropic answer has no field for ids or logprobs: nothing of the chat answer's is shown
        self.chat = Capture(CHAT, caller_ids=False, caller_logprobs=False)
        self.chat.temperature = temperature(body)
        self.stream = MessageStream() if body.get("stream") else None
        self.stop_reason: str | None = None
        self.done = False

    @classmethod
    def for_request(cls, body: dict) -> "AnthropicCapture":
        return cls(body)

    def request(self) -> dict:
        """The chat completions body to send, with the capture fields."""
        return with_capture(self.chat_body, CHAT)

    def unconverted(self, why: str) -> AnthropicCapture:
        """This capture, of the call sent to ``/v1/messages`` as it is (a transport that cannot
        hand the caller a converted answer: ``why``)."""
        self.unsupported, self.chat_body = why, None
        return self

    def message(self, completion: dict) -> dict:
        """The Anthropic message of vLLM's chat completion (its ids read first)."""
        self.chat.add_json(completion)
        message = to_message(completion)
        self.stop_reason, self.done = message.get("stop_reason"), True
        return message

    def events(self, chunk: dict) -> list[tuple[str, dict]]:
        """The Anthropic events of one chat completion chunk (its ids read first)."""
        if self.stream.block == "text":   # the usual chunk, one text token in an open text block
            text = self.chat.text_token(chunk)
            if text is not None:
                return self.stream.text(text)
        self.chat.add_json(chunk)
        out = self.stream.feed(chunk)
        for name, data in out:
            if name == "message_delta":
                self.stop_reason = data["delta"].get("stop_reason")
        return out

    def end(self) -> list[tuple[str, dict]]:
        """The events at the chat stream's ``[DONE]``."""
        self.done = True
        return self.stream.done()

    def status(self) -> str:
        return "unsupported_request" if self.unsupported else self.chat.status()

    def attributes(self, model_version: int | None = None) -> dict:
        if self.unsupported:
            return {semconv.CAPTURE_STATUS: "unsupported_request",
                    semconv.CAPTURE_REASON: f"not captured: the request has {self.unsupported}, which lightspan "
                                            "does not convert to a chat completion as vLLM does; it went to "
                                            "/v1/messages, which returns no token ids"}
        return self.chat.attributes(model_version)

    def genai_attributes(self) -> dict:
        attrs = self.chat.genai_attributes()
        if self.stop_reason:
            attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = (self.stop_reason,)
        return attrs


# --- the common request, in fewer steps -------------------------------------------------------------
# Most agents send text turns and nothing else. Such a request converts in a few dict operations, and
# its plain answer is read and recorded in one pass each, with what the general path gives for it
# (tests/tracing/test_anthropic_fast.py holds the two equal; bench/README.md, session 13, times it).

_COMMON = frozenset({"model", "max_tokens", "messages", "system", "stream", "stop_sequences", "temperature",
                     "top_p", "top_k"})
_SAMPLING = (("stop", "stop_sequences"), ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"))
_STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


def common_chat(body: dict) -> dict | None:
    """:func:`~.anthropic_convert.to_chat` of a request of the common shape: a model, a positive
    ``max_tokens``, turns of ``user`` and ``assistant`` whose ``content`` is a string, a system prompt
    that is a string (or none), the sampling fields and ``stream``, no other field; None for any
    other request (the general conversion takes it)."""
    if not _COMMON.issuperset(body):
        return None
    model, max_tokens, turns = body.get("model"), body.get("max_tokens"), body.get("messages")
    if (type(model) is not str or not model or type(max_tokens) is not int or max_tokens <= 0 or type(turns) is not list
            or not turns):
        return None
    messages = []
    system = body.get("system")
    if system:
        if type(system) is not str:
            return None
        messages.append({"role": "system", "content": system})   # (as it is: only blocks lose a billing header)
    for turn in turns:
        if type(turn) is not dict or len(turn) != 2:
            return None
        role, content = turn.get("role"), turn.get("content")
        if (role != "user" and role != "assistant") or type(content) is not str:
            return None
        messages.append({"role": role, "content": content})
    chat = {"model": model, "messages": messages, "max_tokens": max_tokens, "max_completion_tokens": max_tokens}
    for ours, theirs in _SAMPLING:
        value = body.get(theirs)
        if value is not None:
            chat[ours] = value
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = dict(_STREAM_OPTIONS)
    return chat


class SimpleCapture(AnthropicCapture):
    """:class:`AnthropicCapture` of a request of the common shape (:func:`common_chat`): the same
    interface and results, in fewer steps for the usual answer (one choice of text, no tool calls,
    no reasoning); any other answer is read the general way. Its non-streamed answer's output
    messages are made from the answer it read (:func:`output` gives it no ``ChatOutput``)."""

    def __init__(self, body: dict, chat_body: dict):
        self.body, self.chat_body = body, chat_body
        self.chat = Capture(CHAT, caller_ids=False, caller_logprobs=False)
        self.chat.temperature = temperature(body)
        self.stream = MessageStream() if body.get("stream") else None
        self.stop_reason: str | None = None
        self.done = False
        self.answer: dict | None = None   # the chat completion read by message()
        self.out: list | None = None      # its output messages, made as it was read (a plain answer)

    def message(self, completion: dict) -> dict:
        """:meth:`AnthropicCapture.message`; a plain answer (:func:`_plain`) is made the message and
        its output messages in one pass."""
        self.answer = completion
        plain = _plain(completion)
        if plain is None:
            return super().message(completion)
        choice, text = plain
        self.chat.add_json(completion)
        finish = choice.get("finish_reason")
        reason, sequence = stop_reason(finish, choice.get("stop_reason"), False, False)
        self.stop_reason, self.done = reason, True
        self.out = [{"role": "assistant", "parts": [{"type": "text", "content": text}] if text else [],
                     "finish_reason": reason or finish or None}]
        return message_of(completion, [{"type": "text", "text": text}] if text else [], reason, sequence)

    def attributes(self, model_version: int | None = None) -> dict:
        chat = self.chat
        c = chat.choices.get(0) if len(chat.choices) == 1 else None
        if (c is None or not chat.parsed or chat.prompt is None or not c.ids or len(c.ids) != len(c.logprobs)
                or self.unsupported):
            return super().attributes(model_version)
        attrs = {semconv.PROMPT_TOKEN_IDS: chat.prompt, semconv.COMPLETION_TOKEN_IDS: (semconv.encode_ids(c.ids),),
                 semconv.COMPLETION_LOGPROBS: (semconv.encode_floats(c.logprobs),), semconv.CAPTURE_STATUS: "ok"}
        if model_version is not None:
            attrs[semconv.MODEL_VERSION] = int(model_version)
        if chat.temperature is not None:
            attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] = chat.temperature
        return attrs

    def genai_attributes(self) -> dict:
        chat = self.chat
        c = chat.choices.get(0) if len(chat.choices) == 1 else None
        if c is None:
            return super().genai_attributes()
        attrs = {}
        if chat.model:
            attrs[semconv.GEN_AI_RESPONSE_MODEL] = str(chat.model)
        if chat.prompt is not None:
            attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = chat.prompt_tokens
        if c.ids:
            attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = len(c.ids)
        reason = self.stop_reason or c.finish_reason
        if reason:
            attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = (reason,)
        return attrs

    def output_messages(self) -> list | None:
        """The answer's assistant turn, as ``ChatOutput`` gives it for that answer (a plain one's:
        made by :meth:`message`)."""
        if self.out is not None:
            return self.out
        out = ChatOutput()
        if self.answer is not None:
            out.add(self.answer)
        return out.messages(self.stop_reason)


def _plain(answer: dict) -> tuple[dict, str | None] | None:
    """(choice, text) of a plain chat completion (one choice, index 0, its message text or None,
    no reasoning, no tool calls), else None."""
    choices = answer.get("choices")
    choice = choices[0] if type(choices) is list and len(choices) == 1 else None
    part = choice.get("message") if type(choice) is dict else None
    if not part or type(part) is not dict or choice.get("index") or part.get("reasoning") or part.get("tool_calls"):
        return None
    text = part.get("content")
    return (choice, text) if text is None or type(text) is str else None


def capture(body: dict) -> AnthropicCapture:
    """The capture of ``body``: :class:`SimpleCapture` for the common shape, else the general one."""
    chat = common_chat(body)
    return AnthropicCapture(body) if chat is None else SimpleCapture(body, chat)


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
    frames=frames, end=end, error=error, upstream_error=upstream_error, fields=COMMON_FIELDS)
