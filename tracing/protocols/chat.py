"""Chat completions (``POST /v1/chat/completions``): what vLLM is asked for, how its answer becomes
span attributes and messages, and how the gateway relays its stream.

Shared by the instrumentor (openai's parsed objects) and the gateway (plain JSON dicts): both
shapes are read through :func:`~.base._get`, so there is one parser for responses and stream
chunks. Completions (:mod:`.completions`) are read by the same :class:`Capture`; the Responses
API and Anthropic Messages, converted to chat completions, read vLLM's answer with it too.

What vLLM 0.32 returns with ``return_token_ids: true`` and ``logprobs`` (measured):

- non-streaming chat: ``prompt_token_ids`` at the top level, ``choices[i].token_ids`` and
  ``choices[i].logprobs.content[j].logprob``;
- non-streaming completions: ``choices[i].prompt_token_ids`` (per choice), ``choices[i].token_ids``,
  ``choices[i].logprobs.token_logprobs``;
- streaming chat: a first chunk per choice with the ``role`` delta, ``prompt_token_ids`` at the top
  level and no ``token_ids``; then one chunk per token (or a few) with ``choices[0].token_ids``
  and ``choices[0].logprobs.content``; choices of ``n > 1`` interleave, told apart by ``index``;
- streaming completions: ``choices[0].prompt_token_ids`` on each choice's first chunk (``null``
  after), ``token_ids`` and ``logprobs.token_logprobs`` per chunk;
- ``stream_options.include_usage`` adds one last chunk with ``choices: []`` and the usage; we never
  add it, because an agent that reads ``chunk.choices[0]`` would fail on that chunk;
- without ``return_token_ids`` the keys are still there, with ``null``.

Speed (bench/capture_overhead.py): the instrumentor decodes a captured call's JSON with
:func:`loads` (orjson; ``json`` for what orjson refuses), reads it with :meth:`Capture.add_json`
(plain dict lookups) and packs the ids with ``semconv.encode_ids`` (``struct``).
"""

from __future__ import annotations

from lightspan.tracing import semconv
from lightspan.tracing.protocols.base import (COMMON_FIELDS, REASONS, Protocol, _clear, _get, as_sent, dumps, loads,
                                              openai_error, sampling_attributes, sse_data, temperature)
from lightspan.tracing.protocols.chat_messages import chat_input, output, outputs

CHAT = "chat"
TEXT_COMPLETION = "text_completion"


def with_capture(body: dict, operation: str) -> dict:
    """The request body plus the fields that make vLLM return token ids and logprobs."""
    body = dict(body)
    body["return_token_ids"] = True
    if operation == CHAT:
        if not body.get("logprobs"):
            body["logprobs"] = True
    elif body.get("logprobs") is None:
        body["logprobs"] = 0  # completions: the sampled token's logprob only
    return body


def asked_for_logprobs(body: dict, operation: str) -> bool:
    """Whether the caller itself asked for logprobs (before :func:`with_capture` adds them)."""
    if operation == CHAT:
        return bool(body.get("logprobs"))
    return body.get("logprobs") is not None


def asked_for_ids(body: dict) -> bool:
    """Whether the caller itself asked for token ids (before :func:`with_capture` adds them)."""
    return bool(body.get("return_token_ids"))


EMPTY_DELTA = '"delta":{}'
"""How a chunk that :func:`only_for_capture` may drop is written (vLLM's JSON has no spaces): a
cheap test before the chunk is decoded."""


def only_for_capture(chunk: dict) -> bool:
    """Whether a chat completion chunk is one vLLM sends only because the request asked for token
    ids or logprobs: each choice's delta empty (a token whose text vLLM holds back, such as half
    of a UTF-8 character), no finish reason. vLLM skips such a chunk when neither was asked for
    (``vllm/entrypoints/openai/chat_completion/serving.py``), so a caller that asked for neither
    must not get it (:attr:`Capture.drops_empty_chunks`); the capture reads it first."""
    choices = chunk.get("choices")
    if type(choices) is not list or not choices:
        return False
    for choice in choices:
        if type(choice) is not dict or choice.get("finish_reason") is not None:
            return False
        delta = choice.get("delta")
        if type(delta) is not dict or any(v is not None for v in delta.values()):
            return False
    return True


def _chat_logprobs(c: "_Choice", lp: dict) -> None:
    """Append a decoded chat choice's ``logprobs.content`` logprobs to ``c``."""
    content = lp.get("content")
    if content:
        if len(content) == 1:  # a stream chunk: one token
            c.logprobs.append(content[0].get("logprob"))
        else:
            try:   # (subscripts, cheaper than a ``get`` per token; an entry without one reads as None)
                c.logprobs += [t["logprob"] for t in content]
            except (KeyError, TypeError):
                c.logprobs += [t.get("logprob") for t in content]


class _Choice:
    __slots__ = ("ids", "logprobs", "finish_reason", "prompt")

    def __init__(self):
        self.prompt: bytes | None = None  # completions only: each choice names its prompt (packed)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None


class Capture:
    """Token ids and logprobs of one call, from its response or from its stream chunks in order.

    The prompt's ids are packed (``semconv.encode_ids``) as soon as they are read: a prompt is the
    largest thing captured, and packing it while the list just decoded is still in the CPU's
    caches costs a fraction of what it costs at the end of a stream (bench/README.md)."""

    converted = False   # (the call goes to vLLM as it is, the capture fields added)

    def __init__(self, operation: str, *, caller_ids: bool = True, caller_logprobs: bool = True):
        self.operation = operation
        self._chat = operation == CHAT
        # False: only lightspan asked for them, and ``add(..., hide=True)`` hands the caller vLLM's
        # ``null`` for them, as vLLM answers a request without them
        self.caller_ids = caller_ids
        self.caller_logprobs = caller_logprobs
        self.fed = 0  # payloads folded in so far
        self.readable = True  # False once a payload could not be read (the instrumentor sets it)
        self.prompt: bytes | None = None  # the prompt's ids, packed
        self.prompt_tokens = 0
        self.model = None
        self.choices: dict[int, _Choice] = {}
        self.parsed = False  # saw something shaped like a completion
        self.temperature: float | None = None  # the request's: vLLM's processed logprobs are tempered

    @classmethod
    def for_request(cls, body: dict, operation: str) -> "Capture":
        """A capture for a request body as the caller wrote it (before :func:`with_capture`)."""
        cap = cls(operation, caller_ids=asked_for_ids(body), caller_logprobs=asked_for_logprobs(body, operation))
        cap.temperature = temperature(body)
        return cap

    @property
    def drops_empty_chunks(self) -> bool:
        """Whether the caller's stream loses the chunks vLLM sent only for lightspan
        (:func:`only_for_capture`): a chat call whose caller asked for neither ids nor logprobs."""
        return self._chat and not self.caller_ids and not self.caller_logprobs

    def _prompt(self, ids) -> bytes:
        packed = semconv.encode_ids(ids)
        if self.prompt is None:
            self.prompt, self.prompt_tokens = packed, len(ids)
        return packed

    def add(self, payload, *, hide: bool = False) -> None:
        """Fold in one non-streaming response or one stream chunk.

        ``hide``: once read, set what only lightspan asked for (token ids, logprobs) to None, as
        vLLM answers a request without them: frameworks act on these fields (LangChain copies
        logprobs into ``response_metadata``), and the client, the OpenAI instrumentation and the
        gateway's caller would carry them for nothing. On a decoded dict this runs before the
        client builds a model per token from them."""
        if type(payload) is dict:
            self.add_json(payload, hide)
            return
        self.fed += 1
        choices = _get(payload, "choices")
        if choices is None:
            return
        self.parsed = True
        hide_ids, hide_logprobs = hide and not self.caller_ids, hide and not self.caller_logprobs
        prompt_ids = _get(payload, "prompt_token_ids")
        if prompt_ids is not None:
            if self.prompt is None:
                self._prompt(prompt_ids)
            if hide_ids:
                _clear(payload, "prompt_token_ids")
        if self.model is None:
            self.model = _get(payload, "model")
        for choice in choices:
            index = _get(choice, "index") or 0
            c = self.choices.get(index)
            if c is None:
                c = self.choices[index] = _Choice()
            if self.operation != CHAT:  # completions name their prompt per choice (chat: at the top level)
                prompt_ids = _get(choice, "prompt_token_ids")
                if prompt_ids is not None:
                    c.prompt = self._prompt(prompt_ids)
                    if hide_ids:
                        _clear(choice, "prompt_token_ids")
            ids = _get(choice, "token_ids")
            if ids is not None:
                c.ids.extend(ids)
                if hide_ids:
                    _clear(choice, "token_ids")
            lp = _get(choice, "logprobs")
            if lp is not None:
                if self.operation == CHAT:
                    c.logprobs.extend(_get(t, "logprob") for t in (_get(lp, "content") or ()))
                else:
                    c.logprobs.extend(_get(lp, "token_logprobs") or ())
                if hide_logprobs:
                    _clear(choice, "logprobs")
            reason = _get(choice, "finish_reason")
            if reason:
                c.finish_reason = reason

    def add_json(self, payload: dict, hide: bool = False) -> None:
        """:meth:`add` for decoded JSON: the same reads, with plain dict lookups (per stream chunk,
        the generic path's function calls were most of the cost)."""
        self.fed += 1
        choices = payload.get("choices")
        if choices is None:
            return
        self.parsed = True
        hide_ids, hide_logprobs = hide and not self.caller_ids, hide and not self.caller_logprobs
        prompt_ids = payload.get("prompt_token_ids")
        if prompt_ids is not None:
            if self.prompt is None:
                self._prompt(prompt_ids)
            if hide_ids:
                payload["prompt_token_ids"] = None
        if self.model is None:
            self.model = payload.get("model")
        chat = self._chat
        for choice in choices:
            index = choice.get("index") or 0
            c = self.choices.get(index)
            if c is None:
                c = self.choices[index] = _Choice()
            if not chat:  # completions name their prompt per choice (chat: at the top level)
                prompt_ids = choice.get("prompt_token_ids")
                if prompt_ids is not None:
                    c.prompt = self._prompt(prompt_ids)
                    if hide_ids:
                        choice["prompt_token_ids"] = None
            ids = choice.get("token_ids")
            if ids is not None:
                c.ids += ids
                if hide_ids:
                    choice["token_ids"] = None
            lp = choice.get("logprobs")
            if lp is not None:
                if chat:
                    _chat_logprobs(c, lp)
                else:
                    c.logprobs += lp.get("token_logprobs") or ()
                if hide_logprobs:
                    choice["logprobs"] = None
            reason = choice.get("finish_reason")
            if reason:
                c.finish_reason = reason

    def text_token(self, chunk: dict) -> str | None:
        """:meth:`add_json` of the usual chunk of a converted stream, one text token of choice 0 once
        it has started (no reasoning, tool calls, finish reason or prompt ids; nothing hidden), read
        in one pass (it runs per token): its text; None, reading nothing, for any other (the caller
        then takes its general path)."""
        try:   # (subscripts: of JSON data, only a list of one dict whose delta is a dict gets past them)
            (choice,) = chunk["choices"]
            delta = choice["delta"]
            text = delta["content"]
        except (KeyError, TypeError, ValueError):
            return None
        # (a delta of one field is the text alone; most chunks carry no prompt ids field)
        if (type(text) is not str or not text or choice.get("finish_reason") is not None or choice.get("index")
                or (len(delta) != 1 and (delta.get("reasoning") is not None or delta.get("tool_calls")))
                or ("prompt_token_ids" in chunk and chunk["prompt_token_ids"] is not None)):
            return None
        c = self.choices.get(0)
        if c is None or not self._chat:
            return None
        self.fed += 1
        ids = choice.get("token_ids")
        if ids is not None:
            c.ids += ids
        lp = choice.get("logprobs")
        if lp is not None:
            try:   # (_chat_logprobs of one token, inlined; any other shape goes there)
                (entry,) = lp["content"]
                c.logprobs.append(entry["logprob"])
            except (KeyError, TypeError, ValueError):
                _chat_logprobs(c, lp)
        return text

    def status(self) -> str:
        if not self.parsed:
            return "unparsed_response"
        choices = self.choices.values()
        if not choices or self.prompt is None:
            return "no_token_ids"
        for c in choices:  # (loops, not any(): this runs once per call, on the agent's thread)
            if not c.ids:
                return "no_token_ids"
        for c in choices:
            if c.prompt is not None and c.prompt != self.prompt:
                return "multiple_prompts"  # a batched completions request: one prompt per span only
        for c in choices:
            if len(c.ids) != len(c.logprobs):
                return "logprobs_mismatch"
        return "ok"

    def attributes(self, model_version: int | None = None) -> dict:
        """The ``lightspan.*`` attributes: ids and logprobs only when every choice has them."""
        status = self.status()
        if status != "ok":
            return {semconv.CAPTURE_STATUS: status, semconv.CAPTURE_REASON: REASONS[status]}
        ordered = [self.choices[i] for i in sorted(self.choices)]
        attrs = {
            semconv.PROMPT_TOKEN_IDS: self.prompt,
            semconv.COMPLETION_TOKEN_IDS: tuple(semconv.encode_ids(c.ids) for c in ordered),
            semconv.COMPLETION_LOGPROBS: tuple(semconv.encode_floats(c.logprobs) for c in ordered),
            semconv.CAPTURE_STATUS: "ok",
        }
        return sampling_attributes(attrs, model_version, self.temperature)

    def genai_attributes(self) -> dict:
        """The GenAI response attributes, for spans lightspan opened itself (no OpenAI instrumentation)."""
        ordered = [self.choices[i] for i in sorted(self.choices)]
        attrs = {}
        if self.model:
            attrs[semconv.GEN_AI_RESPONSE_MODEL] = str(self.model)
        if self.prompt is not None:
            attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = self.prompt_tokens
        if ordered and all(c.ids for c in ordered):
            attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = sum(len(c.ids) for c in ordered)
        reasons = tuple(c.finish_reason for c in ordered if c.finish_reason)
        if reasons:
            attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = reasons
        return attrs


def request(cap: Capture, body: dict) -> dict:
    return with_capture(body, cap.operation)


# --- the gateway's relay of the stream ----------------------------------------------------------------

def frames(exchange, line: bytes) -> list[bytes]:
    """vLLM's chunks as they came, the fields only the gateway asked for set back to ``null``; its
    ``[DONE]`` held back for :func:`end`; a chunk vLLM sent only for the ids left out."""
    data = sse_data(line)
    if data is None:
        return [line + b"\n"] if line else []   # event:, id:, comments: as they came
    if data == b"[DONE]":
        exchange.finished = True
        return []                                # sent by end(), once the span has ended
    if data.startswith(b"{"):
        chunk = loads(data)
        exchange.read(chunk)
        if exchange.strip:
            if exchange.cap.drops_empty_chunks and type(chunk) is dict and only_for_capture(chunk):
                return []                        # sent only because the gateway asked for ids
            data = dumps(chunk).encode()
    return [b"data: " + data + b"\n\n"]


def end(exchange) -> list[bytes]:
    return [b"data: [DONE]\n\n"] if exchange.finished else []


FIELDS = {**COMMON_FIELDS, "logprobs": (bool, "a boolean"), "return_token_ids": (bool, "a boolean")}

PROTOCOL = Protocol(
    name=CHAT, client="openai", path="/chat/completions", operation="chat", provider="openai",
    capture=lambda body: Capture.for_request(body, CHAT), request=request, inputs=chat_input,
    output=output, outputs=outputs, frames=frames, end=end, error=openai_error, upstream_error=as_sent,
    fields=FIELDS)
