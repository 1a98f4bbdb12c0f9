"""Chat completions and completions: what vLLM is asked for, and how its answer becomes span attributes.

Shared by the instrumentor (openai's parsed objects) and the gateway (plain JSON dicts): both
shapes are read through :func:`_get`, so there is one parser for responses and stream chunks.
The Responses API and Anthropic Messages have their own modules (:mod:`.capture_responses`,
:mod:`.capture_anthropic`) with the same interface.

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

import json
import struct

import orjson

from lightspan.tracing import semconv

CHAT = "chat"
TEXT_COMPLETION = "text_completion"

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


def operation(path: str) -> str | None:
    """``chat`` or ``text_completion`` for an OpenAI generation path, else None."""
    path = "/" + str(path).split("?", 1)[0].strip("/")
    if path.endswith("/chat/completions"):
        return CHAT
    if path.endswith("/completions"):
        return TEXT_COMPLETION
    return None


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


def _get(obj, name: str):
    """A field of a JSON dict or of an openai object (vLLM's extra fields included).

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


def _chat_logprobs(c: "_Choice", lp: dict) -> None:
    """Append a decoded chat choice's ``logprobs.content`` logprobs to ``c``."""
    content = lp.get("content")
    if content:
        if len(content) == 1:  # a stream chunk: one token
            c.logprobs.append(content[0].get("logprob"))
        else:
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
        temperature = body.get("temperature")
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
            cap.temperature = float(temperature)
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

    def add_token(self, choice: dict) -> bool:
        """:meth:`add_json` of a stream chunk whose one choice is choice 0, once it has started, with
        no prompt ids and no finish reason (nearly every chunk; nothing hidden): False, reading
        nothing, for any other."""
        c = self.choices.get(0)
        if c is None or not self._chat:
            return False
        self.fed += 1
        ids = choice.get("token_ids")
        if ids is not None:
            c.ids += ids
        lp = choice.get("logprobs")
        if lp is not None:
            _chat_logprobs(c, lp)
        return True

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
        if model_version is not None:
            attrs[semconv.MODEL_VERSION] = int(model_version)
        if self.temperature is not None:
            # the trainer tempers its logits the same way to compare its logprobs with these
            attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] = self.temperature
        return attrs

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

