"""The OpenAI Responses API (``POST /v1/responses``): what vLLM is asked for, what it returns, and
what the caller and the span get.

Shared by the instrumentor and the gateway, like :mod:`.chat`; over JSON dicts and the openai
client's parsed objects (read through :func:`~.base._get`). A request that converts (most do) goes
to vLLM as the chat completion its own Responses route would make (:mod:`.responses_convert`;
:class:`ConvertedCapture`), which gives every token's logprob, and its answer comes back as the
Response or its events (:mod:`.responses_stream`); one that does not goes to ``/v1/responses``
with the fields below (:class:`ResponsesCapture`).

What vLLM 0.32 returns (read in ``vllm/entrypoints/openai/responses/`` and measured):

- ``enable_response_messages: true`` adds ``input_messages`` and ``output_messages`` to the
  response: for the models vLLM renders with a chat template, one
  ``{"type": "raw_message_tokens", "message": text, "tokens": ids}`` each, the prompt exactly as
  tokenised and the completion exactly as sampled. Streamed, they come on the last event
  (``response.completed``, also when the response is incomplete). A harmony model (gpt-oss)
  gives messages without ``tokens``: no ids there.
- ``include: ["message.output_text.logprobs"]`` adds the sampled tokens' logprobs to each
  ``output_text`` part, and only there: a response that is only a tool call (a
  ``function_call`` item) carries none; streamed, the logprobs come with the text deltas, and
  a token whose delta has no text (the end-of-turn token, half of a UTF-8 character) loses its
  logprob. Such calls keep their ids and are marked ``capture.status=no_logprobs``.
- without either, ``input_messages``/``output_messages`` are ``null``, a part's ``logprobs`` is
  ``null`` (``[]`` in text-delta and part-added events): what the caller gets back when only
  lightspan asked (:meth:`ResponsesCapture.add` with ``hide``).
"""

from __future__ import annotations

from lightspan.tracing import semconv
from lightspan.tracing.messages import _append, _arguments, _text_of
from lightspan.tracing.protocols.base import (COMMON_FIELDS, NUMBER, OverChat, Protocol, _get, _set, as_sent, dumps,
                                              loads, no_output, openai_error, sampling_attributes, sse_data,
                                              temperature)
from lightspan.tracing.protocols.chat import CHAT, Capture
from lightspan.tracing.protocols.chat import with_capture as chat_with_capture
from lightspan.tracing.protocols.responses_convert import Unsupported, to_chat, to_response
from lightspan.tracing.protocols.responses_stream import ResponseStream

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})

NO_LOGPROBS_REASON = (
    "vLLM's /v1/responses returns logprobs only for output text: none for a reply that is only a tool "
    "call, and in a stream none for tokens whose delta has no text (the end-of-turn token); the ids "
    "are recorded, the logprobs are not. lightspan sends a Responses request as a chat completion, "
    "which has them, when it can reproduce vLLM's conversion; this one it could not: {why}.")


def with_capture(body: dict) -> dict:
    """The request body plus the fields that make vLLM return token ids and logprobs."""
    body = dict(body)
    body["enable_response_messages"] = True
    include = list(body.get("include") or ())
    if LOGPROBS_INCLUDE not in include:
        include.append(LOGPROBS_INCLUDE)
    body["include"] = include
    return body


def unsupported(body: dict) -> str | None:
    """Why a request cannot be captured (it is then sent as it is), else None."""
    if body.get("background"):
        return "a background response (vLLM returns token ids only for responses answered in the call)"
    return None


def _packed(ids: list) -> bytes | None:
    """The ids packed now, while the list just decoded is in the CPU's caches (as the chat
    capture does); None when they do not pack: :meth:`ResponsesCapture.attributes` then fails as
    it would have."""
    try:
        return semconv.encode_ids(ids)
    except Exception:
        return None


def _output_text_parts(response):
    for item in _get(response, "output") or ():
        if _get(item, "type") == "message":
            for part in _get(item, "content") or ():
                if _get(part, "type") == "output_text":
                    yield part


class ResponsesCapture:
    """Token ids and logprobs of one Responses call, from its response or its stream events.

    Same interface as the chat-completions ``Capture``: :meth:`add` each payload, then
    :meth:`attributes` and :meth:`genai_attributes`; ``done`` once the final response was read."""

    converted = False   # (the call goes to /v1/responses)

    def __init__(self, *, caller_ids: bool = True, caller_logprobs: bool = True):
        self.caller_ids, self.caller_logprobs = caller_ids, caller_logprobs
        self.fed = 0
        self.readable = True
        self.parsed = False
        self.done = False
        self.unsupported: str | None = None   # why the request was sent without asking for ids
        self.not_converted = "it was not tried"   # why it was not sent as a chat completion
        self.temperature: float | None = None
        self.model = None
        self.prompt: list[int] | None = None
        self.packed_prompt: bytes | None = None   # packed as it is read (the prompt is the largest part)
        self.completion: list[int] | None = None
        self.turns = 0                         # output_messages entries (one per model turn)
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.response = None                   # the final response (for the span's messages)

    @classmethod
    def for_request(cls, body: dict):
        """A capture for a request body as the caller wrote it (before :func:`with_capture`): a
        :class:`ConvertedCapture` when the request converts to a chat completion, else this."""
        converted = ConvertedCapture(body)
        if converted.converted:
            return converted
        cap = cls.native(body)
        cap.not_converted = converted.unsupported
        return cap

    @classmethod
    def native(cls, body: dict) -> "ResponsesCapture":
        """A capture of the request sent to ``/v1/responses`` itself."""
        include = body.get("include") or ()
        cap = cls(caller_ids=bool(body.get("enable_response_messages")),
                  caller_logprobs=LOGPROBS_INCLUDE in include)
        cap.unsupported = unsupported(body)
        cap.temperature = temperature(body)
        return cap

    def add_json(self, payload: dict, hide: bool = False) -> None:
        self.add(payload, hide=hide)

    def add(self, payload, *, hide: bool = False) -> None:
        """Fold in a response or one stream event (decoded JSON or the client's parsed object);
        ``hide``: then hand the caller ``null`` for what only lightspan asked for."""
        self.fed += 1
        kind = _get(payload, "type")
        if kind is None and _get(payload, "object") == "response":
            self._response(payload, hide)
        elif kind in _TERMINAL:
            response = _get(payload, "response")
            if response is not None:
                self._response(response, hide)
        elif hide and not self.caller_logprobs and kind is not None:
            self._hide_event_logprobs(payload, kind)

    def _hide_event_logprobs(self, event, kind: str) -> None:
        if kind in ("response.output_text.delta", "response.output_text.done"):
            if _get(event, "logprobs"):
                _set(event, "logprobs", [])
        elif kind == "response.content_part.done":
            part = _get(event, "part")
            if part is not None and _get(part, "type") == "output_text":
                _set(part, "logprobs", None)
        elif kind == "response.output_item.done":
            item = _get(event, "item")
            if item is not None and _get(item, "type") == "message":
                for part in _get(item, "content") or ():
                    if _get(part, "type") == "output_text":
                        _set(part, "logprobs", None)

    def _response(self, response, hide: bool) -> None:
        self.parsed = self.done = True
        self.response = response
        self.model = _get(response, "model") or self.model
        inputs, outputs = _get(response, "input_messages"), _get(response, "output_messages")
        if inputs:
            tokens = _get(inputs[0], "tokens")
            if isinstance(tokens, list) and self.prompt is None:
                self.prompt = tokens
                self.packed_prompt = _packed(tokens)
        if outputs:
            self.turns = len(outputs)
            tokens = _get(outputs[0], "tokens")
            if isinstance(tokens, list) and self.completion is None:
                self.completion = tokens
        status = _get(response, "status")
        details = _get(response, "incomplete_details")
        if status == "incomplete" and details is not None and _get(details, "reason") == "max_output_tokens":
            self.finish_reason = "length"
        elif status == "completed":
            calls = any(_get(i, "type") == "function_call" for i in _get(response, "output") or ())
            self.finish_reason = "tool_calls" if calls else "stop"
        elif status:
            self.finish_reason = str(status)
        logprobs = []
        for part in _output_text_parts(response):
            for entry in _get(part, "logprobs") or ():
                logprobs.append(_get(entry, "logprob"))
            if hide and not self.caller_logprobs:
                _set(part, "logprobs", None)
        self.logprobs = logprobs
        if hide and not self.caller_ids:
            _set(response, "input_messages", None)
            _set(response, "output_messages", None)

    def status(self) -> str:
        if self.unsupported:
            return "unsupported_request"
        if not self.parsed:
            return "unparsed_response"
        if not self.prompt or not self.completion:
            return "no_token_ids"
        if self.turns > 1:
            return "multiple_turns"
        if len(self.logprobs) != len(self.completion):
            return "no_logprobs"
        return "ok"

    def reason(self) -> str | None:
        """Why the call was not captured, and the fix (None when it was)."""
        status = self.status()
        if status == "unsupported_request":
            return f"not captured: {self.unsupported}"
        if status == "no_logprobs":
            return NO_LOGPROBS_REASON.format(why=self.not_converted)
        if status == "multiple_turns":
            return ("vLLM ran several model turns in one /v1/responses call (built-in tools): one span "
                    "holds one turn; let the agent run its tools")
        if status == "no_token_ids":
            return ("vLLM's /v1/responses returned no token ids (a harmony model such as gpt-oss renders "
                    "without them): call the chat completions API")
        return None

    def attributes(self, model_version: int | None = None) -> dict:
        """The ``lightspan.*`` attributes; ids when vLLM returned them, logprobs when every token has one."""
        status = self.status()
        attrs = {semconv.CAPTURE_STATUS: status}
        reason = self.reason()
        if reason:
            attrs[semconv.CAPTURE_REASON] = reason
        if status not in ("ok", "no_logprobs"):
            return attrs
        attrs[semconv.PROMPT_TOKEN_IDS] = (self.packed_prompt if self.packed_prompt is not None
                                           else semconv.encode_ids(self.prompt))
        attrs[semconv.COMPLETION_TOKEN_IDS] = (semconv.encode_ids(self.completion),)
        if status == "ok":
            attrs[semconv.COMPLETION_LOGPROBS] = (semconv.encode_floats(self.logprobs),)
        return sampling_attributes(attrs, model_version, self.temperature)

    def genai_attributes(self) -> dict:
        """The GenAI response attributes, for spans lightspan opened itself."""
        attrs = {}
        if self.model:
            attrs[semconv.GEN_AI_RESPONSE_MODEL] = str(self.model)
        if self.prompt:
            attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = len(self.prompt)
        if self.completion:
            attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = len(self.completion)
        if self.finish_reason:
            attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = (self.finish_reason,)
        return attrs


class ConvertedCapture(OverChat):
    """A Responses call captured through vLLM's chat completions (:mod:`.responses_convert`).

    Holds the converted request and a chat-completions :class:`Capture` of vLLM's answer, which
    reads the ids and a logprob per token, and turns the answer into what the caller asked for
    (:meth:`message` for a response, :meth:`events` for each stream chunk, :meth:`end` at its
    ``[DONE]``). The interface is :class:`~.anthropic_messages.AnthropicCapture`'s."""

    def __init__(self, body: dict):
        self.body = body
        self.convert(body, to_chat, Unsupported)
        # the Response has no field for the chat answer's ids or logprobs: nothing of them is shown
        self.chat = Capture(CHAT, caller_ids=False, caller_logprobs=False)
        self.chat.temperature = temperature(body)
        self.stream = ResponseStream(body) if body.get("stream") else None
        self.response: dict | None = None   # the Response the caller got (for the span's messages)
        self.done = False

    def request(self) -> dict:
        """The chat completions body to send, with the capture fields."""
        return chat_with_capture(self.chat_body, CHAT)

    def unconverted(self, why: str) -> ResponsesCapture:
        """The capture of this call sent to ``/v1/responses`` as it is (a transport that cannot
        hand the caller a converted answer: ``why``)."""
        cap = ResponsesCapture.native(self.body)
        cap.not_converted = why
        return cap

    @property
    def finish_reason(self) -> str | None:
        choice = self.chat.choices.get(0)
        return choice.finish_reason if choice is not None else None

    def message(self, completion: dict) -> dict:
        """The Response of vLLM's chat completion (its ids read first)."""
        self.chat.add_json(completion)
        self.response, self.done = to_response(completion, self.body), True
        return self.response

    def events(self, chunk: dict) -> list[tuple[str, dict]]:
        """The Responses events (name, data) of one chat completion chunk (its ids read first)."""
        if self.stream.state == "content" and not chunk.get("usage"):   # one text token in an open message
            text = self.chat.text_token(chunk)
            if text is not None:
                return [(e["type"], e) for e in self.stream.text_delta(text)]
        self.chat.add_json(chunk)
        return [(e["type"], e) for e in self.stream.feed(chunk)]

    def end(self) -> list[tuple[str, dict]]:
        """The events at the chat stream's ``[DONE]``."""
        out = [(e["type"], e) for e in self.stream.done()]
        self.response, self.done = self.stream.response, True
        return out

    def status(self) -> str:
        return self.chat.status()

    def attributes(self, model_version: int | None = None) -> dict:
        return self.chat.attributes(model_version)

    def genai_attributes(self) -> dict:
        return self.chat.genai_attributes()


# --- the call's messages (docs: lightspan.tracing.messages) -----------------------------------------

def _responses_item(item, messages: list) -> None:
    kind = _get(item, "type") or ("message" if _get(item, "role") else None)
    if kind == "message":
        content = _get(item, "content")
        text = content if isinstance(content, str) else "\n".join(
            _get(p, "text") for p in content or () if isinstance(_get(p, "text"), str))
        _append(messages, _get(item, "role") or "user", [{"type": "text", "content": text}] if text else [])
    elif kind == "function_call":
        _append(messages, "assistant", [{"type": "tool_call", "id": _get(item, "call_id"), "name": _get(item, "name"),
                                         "arguments": _arguments(_get(item, "arguments"))}])
    elif kind == "function_call_output":
        output = _get(item, "output")
        messages.append({"role": "tool", "parts": [{"type": "tool_call_response", "id": _get(item, "call_id"),
                                                     "response": output if isinstance(output, str) else _text_of(output)}]})
    elif kind == "reasoning":
        texts = [_get(p, "text") for key in ("summary", "content") for p in _get(item, key) or ()]
        _append(messages, "assistant", [{"type": "reasoning", "content": "\n".join(t for t in texts if t)}])
    else:
        plain = item if isinstance(item, dict) else getattr(item, "model_dump", lambda: str(item))()
        _append(messages, "assistant" if kind and kind.endswith("_call") else "user",
                [{"type": str(kind), "content": plain}])


def responses_input(body: dict) -> list:
    messages: list = []
    if body.get("instructions"):
        messages.append({"role": "system", "parts": [{"type": "text", "content": body["instructions"]}]})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "parts": [{"type": "text", "content": given}]})
    else:
        for item in given or ():
            _responses_item(item, messages)
    return messages


def responses_output(response, finish_reason: str | None) -> list:
    messages: list = []
    for item in _get(response, "output") or ():
        _responses_item(item, messages)
    if not messages:
        messages.append({"role": "assistant", "parts": []})
    messages[-1]["finish_reason"] = finish_reason
    return messages


def outputs(cap, out) -> list | None:
    return responses_output(cap.response, cap.finish_reason) if cap.response is not None else None


def request(cap, body: dict) -> dict:
    if cap.converted:
        return cap.request()
    return body if cap.unsupported else with_capture(body)


# --- the gateway's relay of /v1/responses' own stream -----------------------------------------------

def frames(exchange, line: bytes) -> list[bytes]:
    """vLLM's events as they came, what only the gateway asked for set back to ``null``; the stream
    ends with its terminal event, which holds the response."""
    data = sse_data(line)
    if data is None:
        return [line + b"\n"] if line else []   # the event: line before its data
    if data.startswith(b"{"):
        event = loads(data)
        exchange.read(event)
        exchange.finished = exchange.finished or exchange.cap.done
        if exchange.strip:
            data = dumps(event).encode()
    return [b"data: " + data + b"\n\n"]


def end(exchange) -> list[bytes]:
    return []


# the Response envelope the gateway writes for a converted call echoes the sampling settings as numbers
FIELDS = {**COMMON_FIELDS, "include": (list, "an array of strings"), "background": (bool, "a boolean"),
          "enable_response_messages": (bool, "a boolean"), "top_p": (NUMBER, "a number"),
          "presence_penalty": (NUMBER, "a number"), "frequency_penalty": (NUMBER, "a number")}

PROTOCOL = Protocol(
    name="responses", client="openai", path="/responses", operation="chat", provider="openai",
    capture=ResponsesCapture.for_request, request=request, inputs=responses_input,
    output=no_output, outputs=outputs, frames=frames, end=end, error=openai_error, upstream_error=as_sent,
    fields=FIELDS, late_span=True)
