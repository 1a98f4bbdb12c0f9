"""The common Anthropic request, in fewer steps: most agents send text turns and nothing else.

Such a request converts in a few dict operations (:func:`common_chat`), and its plain answer is read
and recorded in one pass each (:class:`SimpleCapture`), with what the general path
(:class:`~.anthropic_capture.AnthropicCapture`) gives for it; any other request, and any other
answer, goes the general way. The instrumentor's fewer steps for such a call
(:func:`lightspan.tracing.calls.prepare`'s ``common`` step) start from :func:`common_capture`; one
of the sync client takes the straight line of :mod:`lightspan.tracing.straight` (a stream:
:mod:`lightspan.tracing.straight_stream`), which builds its chat body with :func:`common_chat` too.
tests/tracing/test_anthropic_fast.py, test_straight.py and test_straight_stream.py hold the paths
equal; bench/README.md (sessions 13 to 17) times them. Pure.
"""

from __future__ import annotations

from lightspan.tracing import semconv
from lightspan.tracing.protocols.anthropic_capture import AnthropicCapture
from lightspan.tracing.protocols.anthropic_convert import MessageStream, message_of, stop_reason
from lightspan.tracing.protocols.base import temperature
from lightspan.tracing.protocols.chat import CHAT, Capture, _chat_logprobs, _Choice
from lightspan.tracing.protocols.chat_messages import ChatOutput


_COMMON = frozenset({"model", "max_tokens", "messages", "system", "stream", "stop_sequences", "temperature",
                     "top_p", "top_k"})
_NUMBERS = ("temperature", "top_p", "top_k")   # the sampling fields that are numbers, the same name in both
_STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


_NUMBER = (int, float)


def common_chat(body: dict, capture: bool = False) -> dict | None:
    """:func:`~.anthropic_convert.to_chat` of a request of the common shape: a model, a positive
    ``max_tokens``, turns of ``user`` and ``assistant`` whose ``content`` is a string, a system prompt
    that is a string (or none), the sampling fields as numbers (``stop_sequences`` a list of
    strings) and ``stream`` a boolean, no other field; None for any other request (the general
    conversion takes it). Every value of such a request is JSON data, exact types, as it is.
    ``capture``: with the capture fields (``with_capture``'s), as it is sent."""
    if not _COMMON.issuperset(body):
        return None
    try:   # (subscripts: a request without one of these goes the general way)
        model, max_tokens, turns = body["model"], body["max_tokens"], body["messages"]
    except KeyError:
        return None
    if (type(model) is not str or not model or type(max_tokens) is not int or max_tokens <= 0 or type(turns) is not list
            or not turns):
        return None
    messages = []
    if "system" in body:   # (membership tests, not a ``get`` per field: most requests have few of them)
        system = body["system"]
        if system is not None:
            if type(system) is not str:
                return None
            if system:
                messages.append({"role": "system", "content": system})   # (as it is: only blocks lose a billing header)
    for turn in turns:
        if type(turn) is not dict or len(turn) != 2:
            return None
        role, content = turn.get("role"), turn.get("content")
        if (role != "user" and role != "assistant") or type(content) is not str:
            return None
        messages.append({"role": role, "content": content})
    chat = {"model": model, "messages": messages, "max_tokens": max_tokens, "max_completion_tokens": max_tokens}
    if len(body) > 3 + ("system" in body):   # a sampling field or ``stream``
        # (each field's test written out, in ``_NUMBERS``' order: most requests have one or two)
        if "stop_sequences" in body:
            value = body["stop_sequences"]
            if value is not None:
                if type(value) is not list or any(type(v) is not str for v in value):
                    return None
                chat["stop"] = value
        if "temperature" in body:
            value = body["temperature"]
            if value is not None:
                if type(value) not in _NUMBER:
                    return None
                chat["temperature"] = value
        if "top_p" in body:
            value = body["top_p"]
            if value is not None:
                if type(value) not in _NUMBER:
                    return None
                chat["top_p"] = value
        if "top_k" in body:
            value = body["top_k"]
            if value is not None:
                if type(value) not in _NUMBER:
                    return None
                chat["top_k"] = value
        if "stream" in body:
            stream = body["stream"]
            if stream:
                if stream is not True:
                    return None
                chat["stream"] = True
                chat["stream_options"] = dict(_STREAM_OPTIONS)
            elif stream is not None and stream is not False:
                return None
    if capture:
        chat["return_token_ids"] = chat["logprobs"] = True
    return chat


def common_capture(body: dict) -> "SimpleCapture | None":
    """The capture of a request of the common shape (:func:`common_chat`), its ``chat_body`` the
    body to send (the capture fields in it); None for any other request. The instrumentor's
    straight line: a client's body with its sentinels dropped (``Client.given``) is JSON data when
    it has this shape, so it needs no other preparation."""
    chat = common_chat(body, capture=True)
    return None if chat is None else SimpleCapture(body, chat)


class SimpleCapture(AnthropicCapture):
    """:class:`AnthropicCapture` of a request of the common shape (:func:`common_chat`): the same
    interface and results, in fewer steps for the usual answer (one choice of text, no tool calls,
    no reasoning); any other answer is read the general way. Its non-streamed answer's output
    messages are made from the answer it read (:func:`.anthropic_messages.output` gives it no ``ChatOutput``)."""

    def __init__(self, body: dict, chat_body: dict):
        self.body, self.chat_body = body, chat_body
        self.chat = Capture(CHAT, caller_ids=False, caller_logprobs=False)
        self.chat.temperature = temperature(body)
        self.stream = MessageStream() if body.get("stream") else None
        self.stop_reason: str | None = None
        self.done = False
        self.answer: dict | None = None   # the chat completion message() read the general way
        self.out: list | None = None      # its output messages, made as it was read (a plain answer)

    def message(self, completion: dict) -> dict:
        """:meth:`AnthropicCapture.message`; a plain answer (:func:`_plain`) is made the message and
        its output messages in one pass."""
        plain = _plain(completion)
        if plain is None:
            self.answer = completion
            return super().message(completion)
        choice, text = plain
        # ``Capture.add_json`` of one choice at index 0 (what it reads of such an answer, nothing hidden)
        chat = self.chat
        chat.fed += 1
        chat.parsed = True
        prompt = completion.get("prompt_token_ids")
        if prompt is not None:
            chat._prompt(prompt)
        chat.model = completion.get("model")
        c = chat.choices[0] = _Choice()
        ids = choice.get("token_ids")
        if ids is not None:
            c.ids += ids
        lp = choice.get("logprobs")
        if lp is not None:
            _chat_logprobs(c, lp)
        finish = choice.get("finish_reason")
        if finish:
            c.finish_reason = finish
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
    try:   # (subscripts: of JSON data, only a list of one dict whose message is a dict gets past them)
        (choice,) = answer["choices"]
        part = choice["message"]
    except (KeyError, TypeError, ValueError):
        return None
    if type(part) is not dict or not part or choice.get("index") or part.get("reasoning") or part.get("tool_calls"):
        return None
    text = part.get("content")
    return (choice, text) if text is None or type(text) is str else None


def capture(body: dict) -> AnthropicCapture:
    """The capture of ``body``: :class:`SimpleCapture` for the common shape, else the general one."""
    chat = common_chat(body)
    return AnthropicCapture(body) if chat is None else SimpleCapture(body, chat)
