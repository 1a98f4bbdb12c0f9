"""The OpenAI Responses API (``POST /v1/responses``): what vLLM is asked for, and what it returns.

Pure functions over JSON dicts (and the openai client's parsed objects, read through
``capture._get``), shared by the instrumentor and a gateway, like the chat-completions
:class:`~lightspan.tracing.capture.Capture`.

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
from lightspan.tracing.capture import _get

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})

NO_LOGPROBS_REASON = (
    "vLLM's /v1/responses returns logprobs only for output text: none for a reply that is only a tool "
    "call, and in a stream none for tokens whose delta has no text (the end-of-turn token); the ids "
    "are recorded, the logprobs are not. For logprobs on every token call the chat completions API "
    "(the OpenAI Agents SDK: OpenAIChatCompletionsModel), or the Responses API without streaming "
    "and tool calls.")


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


def _set(obj, name: str, value) -> None:
    if isinstance(obj, dict):
        obj[name] = value
    elif name in getattr(obj, "__dict__", {}):
        setattr(obj, name, value)
    elif getattr(obj, "__pydantic_extra__", None) and name in obj.__pydantic_extra__:
        obj.__pydantic_extra__[name] = value


class ResponsesCapture:
    """Token ids and logprobs of one Responses call, from its response or its stream events.

    Same interface as the chat-completions ``Capture``: :meth:`add` each payload, then
    :meth:`attributes` and :meth:`genai_attributes`; ``done`` once the final response was read."""

    api = "responses"
    operation = "chat"

    def __init__(self, *, caller_ids: bool = True, caller_logprobs: bool = True):
        self.caller_ids, self.caller_logprobs = caller_ids, caller_logprobs
        self.fed = 0
        self.readable = True
        self.parsed = False
        self.done = False
        self.unsupported: str | None = None   # why the request was sent without asking for ids
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
    def for_request(cls, body: dict) -> "ResponsesCapture":
        """A capture for a request body as the caller wrote it (before :func:`with_capture`)."""
        include = body.get("include") or ()
        cap = cls(caller_ids=bool(body.get("enable_response_messages")),
                  caller_logprobs=LOGPROBS_INCLUDE in include)
        cap.unsupported = unsupported(body)
        temperature = body.get("temperature")
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
            cap.temperature = float(temperature)
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
            return NO_LOGPROBS_REASON
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
        if model_version is not None:
            attrs[semconv.MODEL_VERSION] = int(model_version)
        if self.temperature is not None:
            attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] = self.temperature
        return attrs

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
