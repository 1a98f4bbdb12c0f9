"""The instrumentor's fast path: captured calls are decoded by orjson (``json`` for what orjson
refuses) and read from the decoded dicts, and the caller still gets exactly what it would get
without lightspan, less only the logprobs lightspan alone asked for.

The client side runs against mocked transports on a loopback URL (where capture applies); one test
decodes real vLLM answers, -inf logprobs included, both ways.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import struct

import pytest
from opentelemetry import context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightspan.tracing import semconv
from lightspan.tracing.protocols.base import loads
from lightspan.tracing.protocols.chat import Capture
from lightspan.tracing.instrumentor import LightspanInstrumentor

# --- loads: what json.loads gives ----------------------------------------------------------------


def _same(a, b) -> bool:
    """Equal values of equal types all the way down (1 == 1.0 == True would hide a difference)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


def test_loads_decodes_as_json_does():
    rng = random.Random(4)
    doubles = [struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0] for _ in range(3000)]
    floats = [x for x in doubles if math.isfinite(x)]
    floats += [0.0, -0.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, -9999.0, 1e-45, 0.1, -1e22]
    floats += [-rng.expovariate(0.5) for _ in range(2000)]  # logprob-like
    texts = [
        json.dumps({"logprobs": floats}),
        json.dumps(floats, indent=1),  # whitespace
        '{"a": 1, "a": 2, "b": [], "c": {}, "d": null, "e": true, "f": false, "g": -0, "h": 1E5, "i": 2.50}',
        json.dumps({"k": "é ☃ \U0001f600 \" \\ / \b \f \n \r \t \u0001"}, ensure_ascii=False),
        json.dumps({"k": "é ☃ \U0001f600 \u2028"}),  # \u escapes, surrogate pairs
        json.dumps({"big": [2**63 - 1, -(2**63), 2**64 - 1, 1_796_000_000, 0, -1]}),
        json.dumps(list(range(-5, 300_000, 7))),
    ]
    for text in texts:
        for data in (text, text.encode()):
            assert _same(loads(data), json.loads(data)), text[:80]


@pytest.mark.parametrize("data", [
    b'{"lp": NaN, "x": -Infinity, "y": Infinity}',  # not JSON; Python's json reads them
    b'{"x": 1e400, "y": -1e400}',  # beyond a double: json gives inf
    b'{"s": "\\ud800"}',  # a lone surrogate escape
    b'\xef\xbb\xbf{"bom": 1}',  # a UTF-8 byte order mark
    '{"utf16": "é"}'.encode("utf-16"),  # json.loads detects UTF-16 and -32 in bytes
    b'{"n": 12345678901234567890}',  # within u64: both give the int
])
def test_loads_falls_back_to_json_for_what_orjson_refuses(data):
    assert _same(loads(data), json.loads(data))


@pytest.mark.parametrize("data", [b"", b"{", b'{"a": }', b"\xff\xfe\x00", "{'a': 1}", b"[1, 2] x"])
def test_loads_fails_as_json_does(data):
    with pytest.raises(ValueError) as theirs:  # JSONDecodeError, or UnicodeDecodeError for b"\xff\xfe\x00"
        json.loads(data)
    with pytest.raises(ValueError) as ours:
        loads(data)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


def test_encode_ids_matches_the_contract():
    ids = [0, 1, 259, 2**31 - 1, -(2**31), 49_999]
    assert semconv.encode_ids(ids) == b"".join(i.to_bytes(4, "little", signed=True) for i in ids)
    assert semconv.decode_ids(semconv.encode_ids(ids)) == ids
    assert semconv.decode_ids(semconv.encode_ids(iter(ids))) == ids      # any iterable
    assert semconv.encode_ids([]) == b""
    with pytest.raises(struct.error):
        semconv.encode_ids([2**31])


# --- Capture: the dict path reads what the generic path reads ------------------------------------


class _Obj:
    """A stand-in for a parsed object: the generic path reads attributes."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _as_obj(value):
    if isinstance(value, dict):
        return _Obj(**{k: _as_obj(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_as_obj(v) for v in value]
    return value


def _chat_chunks():
    """vLLM's chat stream for n=2 (choices interleaved) and a finish per choice."""
    chunks = [{"id": "c", "model": "policy", "prompt_token_ids": [1, 2, 3],
               "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in (0, 1)]}]
    for step in range(3):
        for i in (0, 1):
            chunks.append({"id": "c", "model": "policy", "prompt_token_ids": None, "choices": [{
                "index": i, "delta": {"content": "x"}, "token_ids": [10 * i + step],
                "logprobs": {"content": [{"token": "x", "logprob": -0.5 * (step + i), "bytes": [120],
                                          "top_logprobs": []}]},
                "finish_reason": "length" if step == 2 else None}]})
    return chunks


def _completion_chunks():
    return [{"id": "t", "model": "policy", "choices": [{
        "index": 0, "text": "ab"[step], "prompt_token_ids": [7, 8] if step == 0 else None, "token_ids": [40 + step],
        "logprobs": {"token_logprobs": [-1.25 * (step + 1)], "tokens": ["ab"[step]], "top_logprobs": None,
                     "text_offset": [step]},
        "finish_reason": "stop" if step == 1 else None}]} for step in range(2)]


@pytest.mark.parametrize("operation,payloads", [("chat", _chat_chunks), ("text_completion", _completion_chunks)])
def test_dict_and_object_paths_agree(operation, payloads):
    fast, generic = Capture(operation), Capture(operation)
    for payload in payloads():
        fast.add(payload)
        generic.add(_as_obj(payload))
    assert fast.status() == "ok"
    assert fast.attributes(3) == generic.attributes(3)
    assert fast.genai_attributes() == generic.genai_attributes()
    attrs = fast.attributes()
    logprobs = [semconv.decode_floats(b) for b in attrs[semconv.COMPLETION_LOGPROBS]]
    if operation == "chat":
        assert [semconv.decode_ids(b) for b in attrs[semconv.COMPLETION_TOKEN_IDS]] == [[0, 1, 2], [10, 11, 12]]
        assert logprobs == [[0.0, -0.5, -1.0], [-0.5, -1.0, -1.5]]
    else:
        assert semconv.decode_ids(attrs[semconv.PROMPT_TOKEN_IDS]) == [7, 8]
        assert logprobs == [[-1.25, -2.5]]


def _token_chunk(rng: random.Random) -> dict:
    """A random chat stream chunk: the usual one text token, or one of another shape."""
    choice = {"index": 0, "delta": {"content": rng.choice(["a", "bc", ""])}, "finish_reason": None,
              "token_ids": [rng.randrange(100)], "logprobs": {"content": [{"token": "a", "logprob": -rng.random()}]}}
    chunk = {"id": "c", "object": "chat.completion.chunk", "model": "policy", "choices": [choice]}
    kind = rng.randrange(16)
    if kind == 0:
        choice["delta"]["reasoning"] = rng.choice([None, "hm"])
    elif kind == 1:
        choice["delta"]["tool_calls"] = rng.choice([[], [{"index": 0, "function": {"arguments": "{"}}]])
    elif kind == 2:
        choice["finish_reason"] = rng.choice(["length", None])
    elif kind == 3:
        choice["index"] = rng.choice([0, 1])
    elif kind == 4:
        chunk["prompt_token_ids"] = rng.choice([None, [1, 2]])
    elif kind == 5:
        choice["token_ids"] = rng.choice([None, [], [1, 2]])
    elif kind == 6:
        choice["logprobs"] = rng.choice([None, {"content": []}, {"content": None}, {"content": [{"token": "a"}]},
                                         {"content": [{"logprob": -1.0}, {"logprob": -2.0}]}, {}])
    elif kind == 7:
        choice["delta"] = rng.choice([{}, {"role": "assistant"}, {"content": None}, {"content": "x", "role": None}])
    elif kind == 8:
        chunk["choices"] = rng.choice([[], [choice, {**choice, "index": 1}]])
    return chunk


def test_a_stream_token_is_read_as_add_json_reads_it():
    """``Capture.text_token`` (a converted stream's usual chunk, read in one pass) leaves the capture as
    ``add_json`` does and hands back the token's text; any other chunk it leaves unread (None)."""
    rng = random.Random(7)
    for _ in range(300):
        fast, general = Capture("chat", caller_ids=False, caller_logprobs=False), Capture(
            "chat", caller_ids=False, caller_logprobs=False)
        first = {"id": "c", "model": "policy", "prompt_token_ids": [1, 2, 3],
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        fast.add_json(first)
        general.add_json(first)
        for _ in range(6):
            chunk = _token_chunk(rng)
            text = fast.text_token(chunk)
            if text is None:
                fast.add_json(chunk)
            else:
                assert text == chunk["choices"][0]["delta"]["content"]
            general.add_json(chunk)
            assert fast.fed == general.fed
            assert {i: (c.ids, c.logprobs, c.finish_reason) for i, c in fast.choices.items()} == {
                i: (c.ids, c.logprobs, c.finish_reason) for i, c in general.choices.items()}
        assert _outcome(fast.attributes, 3) == _outcome(general.attributes, 3)   # (a None logprob raises in both)
        assert fast.genai_attributes() == general.genai_attributes()


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        return type(e)


def _responses_answers():
    """vLLM's Responses answers (``enable_response_messages``, output-text logprobs): a text reply cut
    at its length limit, and a completed reply with text and a function call."""
    text = {"type": "output_text", "text": "ab", "annotations": [],
            "logprobs": [{"token": "a", "logprob": -0.25, "bytes": [97], "top_logprobs": []},
                         {"token": "b", "logprob": -1.5, "bytes": [98], "top_logprobs": []}]}
    head = {"id": "r", "object": "response", "model": "policy", "input_messages": [
        {"type": "raw_message_tokens", "message": "<p>", "tokens": [5, 6, 7]}]}
    cut = {**head, "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
           "output": [{"type": "message", "role": "assistant", "content": [text]}],
           "output_messages": [{"type": "raw_message_tokens", "message": "ab", "tokens": [40, 41]}]}
    called = {**head, "status": "completed", "incomplete_details": None,
              "output": [{"type": "reasoning", "content": []}, {"type": "message", "role": "assistant", "content": [text]},
                         {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}],
              "output_messages": [{"type": "raw_message_tokens", "message": "ab", "tokens": [40, 41]}]}
    return [cut, called]


@pytest.mark.parametrize("caller", [(False, False), (True, True)], ids=["hidden", "asked"])
@pytest.mark.parametrize("answer", [0, 1], ids=["length", "tool_call"])
def test_responses_dict_and_object_paths_agree(caller, answer):
    """A Responses answer read from decoded JSON records what the same answer read from parsed
    objects does, and hides the same fields."""
    from lightspan.tracing.protocols.responses import ResponsesCapture

    fast, generic = (ResponsesCapture(caller_ids=caller[0], caller_logprobs=caller[1]) for _ in range(2))
    payload, obj = _responses_answers()[answer], _as_obj(_responses_answers()[answer])
    fast.add(payload, hide=True)
    generic.add(obj, hide=True)
    assert fast.status() == generic.status() == "ok"
    assert fast.attributes(2) == generic.attributes(2) and fast.genai_attributes() == generic.genai_attributes()
    assert fast.genai_attributes()[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == (("length",), ("tool_calls",))[answer]
    assert semconv.decode_floats(fast.attributes()[semconv.COMPLETION_LOGPROBS][0]) == [-0.25, -1.5]
    assert json.loads(json.dumps(obj, default=lambda o: o.__dict__)) == payload
    assert (payload["input_messages"] is None) == (payload["output"][-1 if answer == 0 else 1]["content"][0][
        "logprobs"] is None) == (not caller[0])


@pytest.mark.parametrize("caller_ids,caller_logprobs", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("as_objects", [False, True])
def test_hide_empties_only_what_the_caller_did_not_ask_for(caller_ids, caller_logprobs, as_objects):
    """``hide`` sets the ids and logprobs only lightspan asked for to None (vLLM's answer to a
    request without them), on decoded JSON and on parsed objects alike, after reading them."""
    chunks = _chat_chunks()
    expected = json.loads(json.dumps(chunks))
    for chunk in expected:
        if not caller_ids and chunk["prompt_token_ids"] is not None:
            chunk["prompt_token_ids"] = None
        for choice in chunk["choices"]:
            if not caller_ids and "token_ids" in choice:
                choice["token_ids"] = None
            if not caller_logprobs:
                choice["logprobs"] = None
    payloads = [_as_obj(c) for c in chunks] if as_objects else chunks
    cap = Capture("chat", caller_ids=caller_ids, caller_logprobs=caller_logprobs)
    for payload in payloads:
        cap.add(payload, hide=True)
    assert cap.status() == "ok"  # read before they were dropped
    assert semconv.decode_ids(cap.attributes()[semconv.PROMPT_TOKEN_IDS]) == [1, 2, 3]
    if as_objects:
        payloads = [json.loads(json.dumps(p, default=lambda o: o.__dict__)) for p in payloads]
    assert payloads == expected
    # without the flag nothing is touched
    chunks = _chat_chunks()
    for chunk in chunks:
        Capture("chat", caller_ids=False, caller_logprobs=False).add(chunk)
    assert chunks == _chat_chunks()


# --- the hooks in the client ---------------------------------------------------------------------

_EXPORTER = InMemorySpanExporter()
_PROVIDER = TracerProvider()
_PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))


@pytest.fixture()
def lightspan():
    """Lightspan's instrumentor alone on a provider of our own; an OpenAI instrumentation another
    test module installed stands aside (its own suppression key), so the ids go on our span."""
    from opentelemetry.semconv_ai import SUPPRESS_LANGUAGE_MODEL_INSTRUMENTATION_KEY

    token = context.attach(context.set_value(SUPPRESS_LANGUAGE_MODEL_INSTRUMENTATION_KEY, True))
    _EXPORTER.clear()
    LightspanInstrumentor().instrument(tracer_provider=_PROVIDER)
    try:
        yield _EXPORTER
    finally:
        LightspanInstrumentor().uninstrument()
        context.detach(token)


def _response(prompt_ids=(1, 2, 3), extra=None):
    body = {"id": "x", "object": "chat.completion", "created": 1_796_000_000, "model": "policy",
            "prompt_token_ids": list(prompt_ids),
            "choices": [{"index": 0, "finish_reason": "length", "token_ids": [5, 6],
                         "message": {"role": "assistant", "content": "hi", "refusal": None},
                         "logprobs": {"content": [{"token": t, "logprob": lp, "bytes": [104], "top_logprobs": []}
                                                  for t, lp in (("h", -0.25), ("i", -9999.0))]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    body.update(extra or {})
    return body


def _stream_body(extra_first="") -> bytes:
    chunks = [json.dumps(c) for c in _chat_chunks()]
    chunks[0] = chunks[0][:-1] + extra_first + "}"
    return ("".join(f"data: {c}\n\n" for c in chunks) + "data: [DONE]\n\n").encode()


def _clients(body: bytes, content_type: str, base_url="http://127.0.0.1:9/v1"):
    """(sync, async) openai clients whose transport answers ``body``; the request bodies in ``sent``."""
    import httpx2 as httpx
    from openai import AsyncOpenAI, OpenAI

    sent = []

    def handler(request):
        sent.append(json.loads(request.content))
        return httpx.Response(200, content=body, headers={"content-type": content_type})

    sync = OpenAI(base_url=base_url, api_key="x", max_retries=0,
                  http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    asyn = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0,
                       http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    return sync, asyn, sent


_ASK = {"model": "policy", "messages": [{"role": "user", "content": "q"}]}


def _dumps(objects):
    return [o.model_dump(mode="python") for o in objects]


def _call_all(body: bytes, content_type: str, stream: bool, **kw):
    """The sync and the async call's result (a list of chunk objects for a stream)."""
    sync, asyn, sent = _clients(body, content_type, **kw)
    if stream:
        first = list(sync.chat.completions.create(**_ASK, stream=True))

        async def run():
            return [c async for c in await asyn.chat.completions.create(**_ASK, stream=True)]
    else:
        first = [sync.chat.completions.create(**_ASK)]

        async def run():
            return [await asyn.chat.completions.create(**_ASK)]
    return [first, asyncio.run(run())], sent


def _expected(body: bytes, content_type: str, stream: bool):
    """What a client without lightspan makes of the same body, ids and logprobs emptied as lightspan
    does when the caller did not ask for them (vLLM's answer to a request without them)."""
    LightspanInstrumentor().uninstrument()
    try:
        (plain, _), _ = _call_all(body, content_type, stream)
    finally:
        LightspanInstrumentor().instrument(tracer_provider=_PROVIDER)
    out = _dumps(plain)
    for item in out:
        if item.get("prompt_token_ids") is not None:
            item["prompt_token_ids"] = None
        for choice in item["choices"]:
            choice["logprobs"] = None
            if choice.get("token_ids") is not None:
                choice["token_ids"] = None
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
def test_the_caller_gets_what_it_would_get_without_lightspan(lightspan, stream, monkeypatch):
    from lightspan.tracing import instrumentor

    body, content_type = ((_stream_body(), "text/event-stream") if stream
                          else (json.dumps(_response()).encode(), "application/json"))
    expected = _expected(body, content_type, stream)
    decoded = []
    monkeypatch.setattr(instrumentor, "loads", lambda data: decoded.append(data) or loads(data))
    results, sent = _call_all(body, content_type, stream)
    # lightspan decoded each response (each chunk) itself: the fast path, not the parsed objects
    assert len(decoded) == 2 * (len(_chat_chunks()) if stream else 1)
    assert all(s["return_token_ids"] is True and s["logprobs"] is True for s in sent)
    for got in results:
        assert _same(_dumps(got), expected)
    spans = [s for s in lightspan.get_finished_spans() if s.attributes.get(semconv.CAPTURE_STATUS)]
    assert len(spans) == 2 and all(s.attributes[semconv.CAPTURE_STATUS] == "ok" for s in spans)
    for span in spans:
        if stream:
            assert [semconv.decode_ids(b) for b in span.attributes[semconv.COMPLETION_TOKEN_IDS]] == [[0, 1, 2],
                                                                                                    [10, 11, 12]]
        else:
            assert semconv.decode_ids(span.attributes[semconv.PROMPT_TOKEN_IDS]) == [1, 2, 3]
            (lp,) = span.attributes[semconv.COMPLETION_LOGPROBS]
            assert semconv.decode_floats(lp) == [-0.25, -9999.0]


def test_a_stream_of_a_client_with_its_own_sse_decoder_is_read_as_it_passes(lightspan):
    """A client that builds its own SSE decoder (``_make_sse_decoder`` overridden) keeps it: its
    events are read into the capture, and the caller gets the chunks that decoder makes; streams
    cut into many small pieces (as a real server sends them) are captured by lightspan's own."""
    import httpx2
    from openai import AsyncOpenAI, OpenAI
    from openai._streaming import SSEDecoder

    class OwnDecoder(SSEDecoder):
        pass

    class OwnClient(OpenAI):
        def _make_sse_decoder(self):
            return OwnDecoder()

    class OwnAsyncClient(AsyncOpenAI):
        def _make_sse_decoder(self):
            return OwnDecoder()

    body = _stream_body()
    pieces = [body[i:i + 7] for i in range(0, len(body), 7)]

    def handler(request):
        return httpx2.Response(200, content=iter(pieces) if "small" in request.url.path else body,
                               headers={"content-type": "text/event-stream"})

    transport = httpx2.MockTransport(handler)
    own = OwnClient(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0,
                    http_client=httpx2.Client(transport=transport))
    chunks = list(own.chat.completions.create(**_ASK, stream=True))
    assert chunks[0].model_extra["prompt_token_ids"] == [1, 2, 3]  # its own decoding: nothing hidden
    own_async = OwnAsyncClient(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0,
                               http_client=httpx2.AsyncClient(transport=transport))

    async def read_async():
        return [c async for c in await own_async.chat.completions.create(**_ASK, stream=True)]

    assert _dumps(asyncio.run(read_async())) == _dumps(chunks)
    small = OpenAI(base_url="http://127.0.0.1:9/small/v1", api_key="x", max_retries=0,
                   http_client=httpx2.Client(transport=transport))
    assert len(list(small.chat.completions.create(**_ASK, stream=True))) == len(chunks)
    spans = [s for s in lightspan.get_finished_spans() if s.attributes.get(semconv.CAPTURE_STATUS)]
    assert [s.attributes[semconv.CAPTURE_STATUS] for s in spans] == ["ok", "ok", "ok"]
    for span in spans:
        assert [semconv.decode_ids(b) for b in span.attributes[semconv.COMPLETION_TOKEN_IDS]] == [[0, 1, 2],
                                                                                                [10, 11, 12]]


def test_logprobs_the_caller_asked_for_are_kept(lightspan):
    body = json.dumps(_response()).encode()
    sync, _, _ = _clients(body, "application/json")
    resp = sync.chat.completions.create(**_ASK, logprobs=True)
    assert [t.logprob for t in resp.choices[0].logprobs.content] == [-0.25, -9999.0]
    (span,) = [s for s in lightspan.get_finished_spans() if s.attributes.get(semconv.CAPTURE_STATUS)]
    assert semconv.decode_floats(span.attributes[semconv.COMPLETION_LOGPROBS][0]) == [-0.25, -9999.0]


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
def test_what_orjson_refuses_decodes_as_before(lightspan, stream):
    """A NaN literal (not JSON; Python's json reads it): the body goes to json.loads, the caller
    gets the NaN, and the call is still captured."""
    if stream:
        body, content_type = _stream_body(', "prompt_logprobs": NaN'), "text/event-stream"
    else:
        text = json.dumps(_response(extra={"prompt_logprobs": float("nan")}))
        assert "NaN" in text
        body, content_type = text.encode(), "application/json"
    results, _ = _call_all(body, content_type, stream)
    for got in results:
        assert math.isnan(got[0].model_extra["prompt_logprobs"])
    spans = [s for s in lightspan.get_finished_spans() if s.attributes.get(semconv.CAPTURE_STATUS)]
    assert [s.attributes[semconv.CAPTURE_STATUS] for s in spans] == ["ok", "ok"]


def test_calls_not_captured_are_decoded_by_json(lightspan):
    """A hosted API's answer never reaches orjson: an integer beyond 64 bits, which orjson would
    turn into a float, stays an int."""
    body = json.dumps(_response(extra={"seed": 2**70})).encode()
    sync, _, sent = _clients(body, "application/json", base_url="https://api.example.com/v1")
    resp = sync.chat.completions.create(**_ASK)
    assert resp.model_extra["seed"] == 2**70 and isinstance(resp.model_extra["seed"], int)
    assert "return_token_ids" not in sent[0]
    assert resp.choices[0].logprobs is not None  # untouched: nobody hid anything
    assert not [s for s in lightspan.get_finished_spans() if s.attributes.get(semconv.CAPTURE_STATUS)]


def test_a_broken_body_fails_as_it_would_without_lightspan(lightspan):
    sync, _, _ = _clients(b'{"id": "x", "choices": [', "application/json")
    with pytest.raises(json.JSONDecodeError):
        sync.chat.completions.create(**_ASK)


def test_hooks_come_off_with_uninstrument():
    """One hook, on the response's JSON decoding; streams need none (their decoder is replaced per
    captured stream), so openai's ``ServerSentEvent`` is never touched."""
    import httpx2
    from openai._streaming import ServerSentEvent

    original, event_json = httpx2.Response.__dict__["json"], ServerSentEvent.__dict__["json"]
    LightspanInstrumentor().instrument(tracer_provider=_PROVIDER)
    try:
        assert httpx2.Response.__dict__["json"] is not original
        LightspanInstrumentor().uninstrument()
        LightspanInstrumentor().instrument(tracer_provider=_PROVIDER)  # again: one layer, not two
        assert httpx2.Response.__dict__["json"].__wrapped__ is original
        assert ServerSentEvent.__dict__["json"] is event_json
    finally:
        LightspanInstrumentor().uninstrument()
    assert httpx2.Response.__dict__["json"] is original


def test_real_vllm_answers_decode_alike(vllm_server):
    """vLLM's own bodies, streamed and not, with logprobs of -inf (tokens ``allowed_token_ids``
    excludes, in the top logprobs): orjson and json decode them to the same values."""
    import requests

    request = {"model": vllm_server.model_name, "messages": [{"role": "user", "content": "hello"}],
               "max_tokens": 4, "logprobs": True, "top_logprobs": 5, "return_token_ids": True,
               "allowed_token_ids": [72, 101], "temperature": 1.0}
    url = f"{vllm_server.url}/v1/chat/completions"
    body = requests.post(url, json=request, timeout=60).content
    data = json.loads(body)
    tops = [t["logprob"] for c in data["choices"][0]["logprobs"]["content"] for t in c["top_logprobs"]]
    assert min(tops) < -1000, tops  # the excluded tokens: how vLLM writes -inf (a finite stand-in)
    assert _same(loads(body), data)
    with requests.post(url, json={**request, "stream": True}, timeout=60, stream=True) as resp:
        lines = [line[6:] for line in resp.iter_lines() if line.startswith(b"data: {")]
    assert len(lines) >= 2   # (the engine puts several tokens in one chunk when the client lags)
    for line in lines:
        assert _same(loads(line.decode()), json.loads(line))
