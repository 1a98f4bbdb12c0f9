"""The floor arms of bench/capture_floor.py for the calls lightspan sends as chat completions: an
Anthropic Messages call, plain and streamed, and a Responses call (``responses_chat``).

Responses (:func:`responses_client`): the call sent as the chat completion with the ids and
logprobs, as lightspan sends it, its answer made the Response (a dict the client builds its
``Response`` from, with fresh ``resp_``/``msg_`` ids as vLLM's); ``span`` as bench/capture_floor.py's
Responses span arm, with the ids and logprobs of the chat answer.

vLLM's ``/v1/messages`` returns no token ids, so any capture of an Anthropic call must send it as a
chat completion that asks for them and hand the caller the Anthropic message (or events) made of the
answer. The arms here do that with no code of lightspan's, for the one request shape the benchmark
sends (one user turn of text; nothing general):

- ``data``: an ``anthropic`` client built before lightspan's instrumentor whose ``messages`` resource
  posts the chat completion lightspan would send (``max_completion_tokens``, the ids, the logprobs; a
  stream with ``continuous_usage_stats``, whose first chunk's usage holds the cached prompt tokens
  that ``message_start`` reports); a plain answer decoded with orjson and turned into the Anthropic
  message (a dict the client builds its ``Message`` from); a stream's chat chunks split from the
  bytes, decoded with orjson and turned into the Anthropic events (the client's ``ServerSentEvent``,
  its ``json()`` the event built, its text made when read, as the client's stream reads it: the
  one class of lightspan's used here), the ids and logprobs gathered; nothing recorded;
- ``span``: ``data``, plus what the capture records on the call's span: the ``anthropic`` SDK opens
  one per call itself (its tracing is on in every arm), current while the answer is decoded, so the
  attributes go on it (lightspan adopts it too): the packed ids and logprobs, the status, the model
  version and temperature, the provider, the input and output messages (GenAI JSON) and the
  finish reason, the attributes lightspan sets on that span.
"""

from __future__ import annotations

import orjson

_STOP = {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}
ON_JSON: list = [None]   # a floor arm's decoder of its call's body, while the call runs (this arm or capture_floor's)


def json_hook(hooked):
    """``httpx2.Response.json`` for the floor arms (set in ``ON_JSON``), the hooked one otherwise."""
    def json_(self, **kwargs):
        on = ON_JSON[0]
        return hooked(self, **kwargs) if on is None else on(self.content)
    return json_


def _chat_body(body: dict, options: dict, stream: bool) -> dict:
    """The chat completion lightspan sends for the benchmark's Anthropic request."""
    extra = options.get("extra_json") or {}
    chat = {"model": body["model"], "messages": body["messages"], "max_tokens": body["max_tokens"],
            "max_completion_tokens": body["max_tokens"], **extra, "return_token_ids": True, "logprobs": True}
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


def _usage(u: dict) -> dict:
    return {"input_tokens": u["prompt_tokens"], "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            "output_tokens": u.get("completion_tokens") or 0}


def _record(span, prompt_ids, ids, logprobs, stop, text: str, inputs: str, temperature) -> None:
    """The attributes lightspan sets on the SDK's span of a captured call."""
    from lightspan.tracing import semconv

    span.set_attributes({
        semconv.CAPTURE_STATUS: "ok", semconv.PROMPT_TOKEN_IDS: semconv.encode_ids(prompt_ids),
        semconv.COMPLETION_TOKEN_IDS: (semconv.encode_ids(ids),),
        semconv.COMPLETION_LOGPROBS: (semconv.encode_floats(logprobs),), semconv.MODEL_VERSION: 1,
        semconv.GEN_AI_REQUEST_TEMPERATURE: temperature, semconv.GEN_AI_SYSTEM: "anthropic",
        semconv.GEN_AI_INPUT_MESSAGES: inputs, semconv.GEN_AI_RESPONSE_FINISH_REASONS: (stop,),
        semconv.GEN_AI_OUTPUT_MESSAGES: orjson.dumps([{"role": "assistant", "parts": [
            {"type": "text", "content": text}], "finish_reason": stop}]).decode()})


def _inputs(body: dict) -> str:
    return orjson.dumps([{"role": m["role"], "parts": [{"type": "text", "content": m["content"]}]}
                         for m in body["messages"]]).decode()


def _message(record: bool, inputs: str, temperature):
    """The decoder of a plain answer: the chat completion in, the Anthropic message out."""
    def on(content: bytes) -> dict:
        data = orjson.loads(content)
        choice = data["choices"][0]
        ids, text = choice["token_ids"], choice["message"]["content"]
        logprobs = [e["logprob"] for e in choice["logprobs"]["content"]]
        stop = _STOP.get(choice["finish_reason"], "end_turn")
        if record:
            from opentelemetry import trace

            _record(trace.get_current_span(), data["prompt_token_ids"], ids, logprobs, stop, text, inputs,
                    temperature)
        return {"id": data["id"], "type": "message", "role": "assistant", "content": [{"type": "text", "text": text}],
                "model": data["model"], "stop_reason": stop, "stop_sequence": None, "usage": _usage(data["usage"])}
    return on


def _event_type():
    """The client's ``ServerSentEvent`` whose ``json()`` is the event built and whose text is made when
    read (the client's stream reads it): lightspan's class for it, the floor's one piece of
    lightspan's code, as it is no more than what any converted stream must build."""
    from lightspan.tracing.clients import CLIENTS
    from lightspan.tracing.streams import converted_event_type

    return converted_event_type(CLIENTS["anthropic"])


class _Decoder:
    """A stream's decoder: the chat chunks' bytes in, the Anthropic events out (ids gathered)."""

    def __init__(self, event, record: bool, inputs: str, temperature):
        from opentelemetry import trace

        self.event, self.inputs, self.temperature = event, inputs, temperature
        self.span = trace.get_current_span() if record else None   # the SDK's, current as it builds the stream
        self.prompt, self.ids, self.logprobs, self.text, self.stop, self.usage = None, [], [], [], None, None

    def iter_bytes(self, iterator):
        rest = b""
        for chunk in iterator:
            *lines, rest = (rest + chunk).split(b"\n\n")
            for line in lines:
                if line.startswith(b"data: {"):
                    yield from self._feed(orjson.loads(line[6:]))
                elif line.startswith(b"data: [DONE]"):
                    yield from self._done()

    def _feed(self, chunk: dict):
        ev = self.event
        if self.prompt is None:
            self.prompt = chunk["prompt_token_ids"]
            usage = {**_usage(chunk["usage"]), "output_tokens": 0}
            yield ev("message_start", {"type": "message_start", "message": {
                "id": chunk["id"], "type": "message", "role": "assistant", "content": [], "model": chunk["model"],
                "stop_reason": None, "stop_sequence": None, "usage": usage}})
            yield ev("content_block_start", {"type": "content_block_start",
                                             "content_block": {"type": "text", "text": ""}, "index": 0})
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if not chunk["choices"]:
            return
        choice = chunk["choices"][0]
        self.ids += choice["token_ids"]
        self.logprobs += [e["logprob"] for e in choice["logprobs"]["content"]]
        if choice["finish_reason"]:
            self.stop = _STOP.get(choice["finish_reason"], "end_turn")
        text = choice["delta"].get("content")
        if text:
            self.text.append(text)
            yield ev("content_block_delta", {"type": "content_block_delta",
                                             "delta": {"type": "text_delta", "text": text}, "index": 0})

    def _done(self):
        ev = self.event
        if self.span is not None:
            _record(self.span, self.prompt, self.ids, self.logprobs, self.stop, "".join(self.text), self.inputs,
                    self.temperature)
        yield ev("content_block_stop", {"type": "content_block_stop", "index": 0})
        yield ev("message_delta", {"type": "message_delta", "delta": {"stop_reason": self.stop, "stop_sequence": None},
                                   "usage": _usage(self.usage)})
        yield ev("message_stop", {"type": "message_stop"})


def floor_client(url: str, record: bool):
    """An ``anthropic`` client (built before lightspan's instrumentor) whose Messages calls go as the
    chat completion with the ids, and come back as the Anthropic message or events (``record``: with
    the span's attributes)."""
    import anthropic

    client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="bench", max_retries=0)
    post, event = client.messages._post, _event_type()

    def messages_post(path, *, body, options, cast_to, stream=False, stream_cls=None):
        inputs = _inputs(body) if record else None
        chat = _chat_body(body, options, stream)
        options = {k: v for k, v in options.items() if k != "extra_json"}
        if stream:
            client._make_sse_decoder = lambda _options: _Decoder(event, record, inputs, chat.get("temperature"))
            return post("/v1/chat/completions", body=chat, options=options, cast_to=cast_to, stream=True,
                        stream_cls=stream_cls)
        ON_JSON[0] = _message(record, inputs, chat.get("temperature"))
        try:
            return post("/v1/chat/completions", body=chat, options=options, cast_to=cast_to)
        finally:
            ON_JSON[0] = None

    client.messages._post = messages_post
    return client


def _response(out: list, body: dict):
    """The decoder of a Responses call's chat answer: the Response out; (prompt ids, ids, logprobs,
    text) kept in ``out``."""
    import uuid

    def on(content: bytes) -> dict:
        data = orjson.loads(content)
        choice = data["choices"][0]
        ids, text, u = choice["token_ids"], choice["message"]["content"], data["usage"]
        out[:] = [data["prompt_token_ids"], ids, [e["logprob"] for e in choice["logprobs"]["content"]], text]
        cut = choice["finish_reason"] == "length"
        return {"id": f"resp_{uuid.uuid4().hex[:16]}", "created_at": data["created"],
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "instructions": None,
                "metadata": None, "model": data["model"], "object": "response",
                "output": [{"id": f"msg_{uuid.uuid4().hex[:16]}", "content": [
                    {"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
                    "role": "assistant", "status": "completed", "type": "message"}],
                "parallel_tool_calls": True, "temperature": body.get("temperature"), "tool_choice": "none",
                "tools": [], "top_p": 1.0, "max_output_tokens": body.get("max_output_tokens"),
                "status": "incomplete" if cut else "completed",
                "usage": {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": u["total_tokens"]}}
    return on


def responses_client(url: str):
    """An ``openai`` client (built before lightspan's instrumentor) whose Responses calls go as the
    chat completion with the ids and come back as the Response; its ``responses._floor`` holds the
    last call's (prompt ids, ids, logprobs, text)."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="bench", max_retries=0)
    post, out = client.responses._post, []

    def responses_post(path, *, body, options, cast_to, **kwargs):
        chat = {"model": body["model"], "messages": [{"role": "user", "content": body["input"]}],
                "max_tokens": body["max_output_tokens"], "temperature": body["temperature"],
                "return_token_ids": True, "logprobs": True}
        ON_JSON[0] = _response(out, body)
        try:
            return post("/chat/completions", body=chat, options=options, cast_to=cast_to, **kwargs)
        finally:
            ON_JSON[0] = None

    client.responses._post = responses_post
    client.responses._floor = out
    return client
