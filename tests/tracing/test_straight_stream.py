"""The straight line of the common streamed Anthropic call (tracing/straight_stream.py) stores what
the general path stores: over random requests of the common shape and random chat streams — the
usual one, and now and then a chunk the straight line hands over at (a reasoning or tool-call delta,
another choice, a token without its id or with several logprobs, data that is not a chunk, a
stream without its usage chunk or ``[DONE]``, a chunk after it), the bytes cut into reads anywhere,
read to the end or left early — under random settings (the semconv opt-in, the served policies and
version, content capture) and spans (the anthropic SDK's, adopted, or one of lightspan's own), both
paths send the same chat request, hand the caller the same events, leave the same attributes on the
stored span and count the same outcome; the usual stream is read to its end by the straight line
alone. The instrumentor end to end, the anthropic client on a mocked vLLM."""

from __future__ import annotations

import random
import types

import httpx2
import orjson
import pytest

from lightspan.tracing import straight, straight_stream
from lightspan.tracing.protocols import anthropic_convert
from lightspan.tracing.report import REPORT
from tests.tracing.otel import _instrumented
from tests.tracing.test_straight import MODELS, _request, _settings, _stored

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              # (a usage count that is a bool or a float, as some chunks here have, both ways alike)
              pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")]

TEXTS = ["t", "é", "two words", "{\"a\": 1}", "\n"]


def _token(rng: random.Random, i: int, odd: bool) -> dict:
    """A token chunk of choice 0: its text, id and logprob (``odd``: now and then of another shape)."""
    choice = {"index": 0, "delta": {"content": rng.choice(TEXTS)}, "logprobs": {"content": [
        {"token": "x", "logprob": -rng.random(), "bytes": [1], "top_logprobs": []}]}, "finish_reason": None,
        "stop_reason": None, "token_ids": [rng.randrange(50_000)]}
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "policy", "choices": [choice]}
    r = rng.random()
    if r < 0.1:
        chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": i, "total_tokens": 3 + i}
    elif r < 0.14:
        choice["delta"] = {}   # (a token whose text vLLM holds back)
    elif r < 0.17:
        choice["delta"]["content"] = rng.choice(["", None])
    elif r < 0.2:
        choice["delta"]["role"] = "assistant"
    elif r < 0.22:
        chunk["prompt_token_ids"] = [9]
    if not odd:
        return chunk
    r = rng.random()
    if r < 0.12:
        choice["delta"] = {"reasoning": "hm"}
    elif r < 0.24:
        choice["delta"]["tool_calls"] = [{"index": 0, "id": f"t{i}", "type": "function",
                                          "function": {"name": "f", "arguments": "{}"}}]
    elif r < 0.34:
        choice["index"] = 1
    elif r < 0.42:
        chunk["choices"] = [choice, dict(choice, index=1)]
    elif r < 0.52:
        choice["logprobs"] = rng.choice([None, {"content": []}, {"content": [{"logprob": -1}, {"logprob": -2}]},
                                         {"content": [{"token": "x"}]}, {}, {"content": [{"logprob": None}]}])
    elif r < 0.62:
        choice["token_ids"] = rng.choice([None, [], [1, 2], "x"])
    elif r < 0.7:
        choice["delta"]["reasoning"] = rng.choice([None, ""])
    elif r < 0.78:
        del chunk["choices"]
    elif r < 0.86:
        choice["delta"] = None
    else:
        chunk["choices"] = []
    return chunk


def _stream(rng: random.Random, odd: float) -> tuple[list, bool]:
    """(a chat stream's data strings, whether it is the usual one throughout): a first chunk with the
    prompt's ids, tokens, a finish reason, the usage chunk, ``[DONE]``; with probability ``odd`` per
    place, something else there."""
    usual = True

    def oddly() -> bool:
        nonlocal usual
        if rng.random() < odd:
            usual = False
            return True
        return False

    prompt = [rng.randrange(50_000) for _ in range(rng.randint(0, 6))]
    first = {"id": rng.choice(["chatcmpl-1", ""]), "object": "chat.completion.chunk", "created": 1,
             "model": rng.choice(MODELS), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}],
             "prompt_token_ids": prompt, "prompt_text": None}
    if rng.random() < 0.5:
        first["usage"] = {"prompt_tokens": rng.choice([len(prompt), True, 2.5, None]), "completion_tokens": 0,
                          "total_tokens": len(prompt), "prompt_tokens_details": rng.choice([None, {"cached_tokens": 1}])}
    if oddly():
        r = rng.random()
        if r < 0.25:
            first["prompt_token_ids"] = rng.choice([None, "x", [1.5]])
        elif r < 0.5:
            first["model"] = None
        elif r < 0.75:
            first["choices"][0]["token_ids"] = [1]
        else:
            first["choices"] = []
    chunks = [first]
    n = rng.randint(0, 9)
    for i in range(n):
        chunks.append(_token(rng, i, oddly()))
    finish = rng.choice(["length", "stop", "abort", "tool_calls", ""])
    stop = rng.choice([None, None, "\n", 7])
    if n and chunks[-1].get("choices") and rng.random() < 0.7:   # on the last token
        chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["choices"][0]["stop_reason"] = finish, stop
    else:
        last = _token(rng, n, False)
        last["choices"][0].update(finish_reason=finish, stop_reason=stop)
        last["choices"][0]["delta"] = rng.choice([{}, {"content": ""}, {"content": "end"}])
        chunks.append(last)
    # (an answer of no text, its finish reason before any block: the general way)
    usual = usual and any(((c.get("choices") or [{}])[0].get("delta") or {}).get("content") for c in chunks[1:])
    if oddly():
        chunks.append(_token(rng, n + 1, rng.random() < 0.5))   # a token after the finish reason
    usage = rng.choice([{"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                         "prompt_tokens_details": rng.choice([None, None, {"cached_tokens": 1}])}, {}, None,
                        {"prompt_tokens": True, "completion_tokens": None}])
    if not oddly():
        chunks.append({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "policy", "choices": [],
                       "usage": usage})
    datas = [orjson.dumps(c).decode() for c in chunks]
    if oddly():
        datas.insert(rng.randint(0, len(datas)), rng.choice(["[1, 2]", "\"text\"", " {\"a\": 1}", "null",
                                                             "{\"a\": NaN}", "{broken"]))
    if not oddly():
        datas.append("[DONE]")
    if oddly():
        datas.append(rng.choice([datas[1] if len(datas) > 1 else "[DONE]", "[DONE]"]))
    return datas, usual


def _body(rng: random.Random, datas: list) -> list:
    """The stream's bytes, cut into reads anywhere (now and then with an event name or comment line,
    or CRLF line ends)."""
    lines = []
    for data in datas:
        if rng.random() < 0.03:
            lines.append(rng.choice([": keep-alive\n", "event: x\n"]))
        lines.append(f"data: {data}\n\n")
    body = "".join(lines).encode()
    if rng.random() < 0.05:
        body = body.replace(b"\n", b"\r\n")
    cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.choice([0, 0, 1, 2, 5]))))
    return [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]


def _client(reads, sent: list, own_span, status: int = 200, decoder: bool = False):
    import anthropic

    def handler(request):
        sent.append((request.url.path, orjson.loads(request.content)))
        if status != 200:
            return httpx2.Response(status, json={"error": {"message": "no"}})
        return httpx2.Response(200, content=iter(reads), headers={"content-type": "text/event-stream"})

    if own_span == "theirs":   # the SDK's spans go to a provider of its own: the span to adopt never starts here
        from opentelemetry.sdk.trace import TracerProvider
        option = {"open_telemetry": {"tracer_provider": TracerProvider()}}
    else:
        option = {"open_telemetry": {"traces": {"enabled": False}}} if own_span else {}
    client = anthropic.Anthropic(base_url="http://127.0.0.1:9", api_key="x", max_retries=0, **option,
                                 http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    if decoder:   # an SSE decoder of its own (the client's own class, set on it)
        from anthropic._streaming import SSEDecoder
        client._make_sse_decoder = lambda options=None: SSEDecoder()
    return client


def _run(on: bool, kwargs: dict, reads: list, own_span, leave: int | None = None, status: int = 200,
         how: str = "create", decoder: bool = False) -> tuple:
    """(chat requests sent, the caller's events, stored spans, report counts added) of one streamed
    call read to its end (or left after ``leave`` events), and what the straight line did."""
    straight.ON[0] = on
    sent, took = [], []
    tap, handed = straight_stream.StraightStream.tap, straight_stream.StraightStream._decoder

    def noting_tap(self, resp):
        out = tap(self, resp)
        took.append(("tapped", out))
        return out

    def noting_decoder(self):
        if self.decoder is None:
            took.append(("handed over", self.phase))
        return handed(self)

    straight_stream.StraightStream.tap, straight_stream.StraightStream._decoder = noting_tap, noting_decoder
    try:
        with _instrumented() as exporter:
            before = dict(REPORT.counts)
            client = _client(reads, sent, own_span, status, decoder)
            events = []
            try:
                if how == "raw":
                    stream = client.messages.with_raw_response.create(**kwargs, stream=True).parse()
                elif how == "streaming":
                    with client.messages.with_streaming_response.create(**kwargs, stream=True) as response:
                        stream = response.parse()
                        events = [e.to_dict() for e in stream]
                else:
                    stream = client.messages.create(**kwargs, stream=True)
                if how != "streaming":
                    for event in stream:
                        events.append(event.to_dict())
                        if leave is not None and len(events) >= leave:
                            stream.close()
                            break
            except Exception as e:   # (an API error, or a stream the general path cannot read: both ways alike)
                events.append(("error", type(e).__name__))
            counts = {k: v - before.get(k, 0) for k, v in REPORT.counts.items() if v != before.get(k, 0)}
            return (sent, events, _stored(exporter), counts), took
    finally:
        straight_stream.StraightStream.tap, straight_stream.StraightStream._decoder = tap, handed
        straight.ON[0] = True


@pytest.fixture
def fixed_clock(monkeypatch):
    """The message id made of the clock when a chunk has none, and a thinking block's signature, fixed."""
    import uuid

    clock = types.SimpleNamespace(time=lambda: 1_700_000_000.0)
    monkeypatch.setattr(straight_stream, "time", clock)
    monkeypatch.setattr(anthropic_convert, "time", clock)
    monkeypatch.setattr(anthropic_convert.uuid, "uuid4", lambda: uuid.UUID(int=1))


def test_the_straight_stream_stores_what_the_general_path_stores(monkeypatch, fixed_clock):
    rng = random.Random(17)
    usual = handed = 0
    for i in range(300):
        _settings(rng, monkeypatch)
        kwargs, own_span = _request(rng), rng.choice([False, False, True, "theirs"])
        datas, plain = _stream(rng, rng.choice([0.0, 0.0, 0.1, 0.3]))
        reads = _body(rng, datas)
        leave = rng.randint(1, 12) if rng.random() < 0.1 else None
        fast, took = _run(True, kwargs, reads, own_span, leave)
        general, untouched = _run(False, kwargs, reads, own_span, leave)
        assert fast == general, (i, kwargs, datas, own_span, leave, took)
        assert took[0] == ("tapped", True), (i, took)
        assert untouched == []
        if plain and leave is None and fast[3] == {"ok": 1}:   # the usual stream: read straight to its end
            assert took == [("tapped", True)], (i, datas)
            usual += 1
        handed += len(took) > 1
    assert usual > 100 and handed > 50, (usual, handed)


@pytest.mark.parametrize("case", ["error", "raw", "streaming", "decoder", "blocks", "tools"])
def test_every_other_streamed_call_goes_the_general_way(monkeypatch, fixed_clock, case):
    rng = random.Random(hash(case) % 1000)
    for _ in range(6):
        _settings(rng, monkeypatch)
        kwargs, own_span, how, status = _request(rng), rng.random() < 0.3, "create", 200
        reads = _body(rng, _stream(rng, 0.0)[0])
        if case == "error":
            status = 500
        elif case in ("raw", "streaming"):
            how = case
        elif case == "blocks":
            kwargs["messages"] = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
        elif case == "tools":
            kwargs["tools"] = [{"name": "f", "description": "d", "input_schema": {"type": "object"}}]
        decoder = case == "decoder"
        fast, took = _run(True, kwargs, reads, own_span, status=status, how=how, decoder=decoder)
        general, _ = _run(False, kwargs, reads, own_span, status=status, how=how, decoder=decoder)
        assert fast == general
        assert ("tapped", True) not in took
        assert case != "error" or fast[1] == [("error", "InternalServerError")]


def test_an_llm_span_of_another_instrumentation_takes_the_general_way(fixed_clock):
    from opentelemetry import trace

    from lightspan.tracing import semconv
    from tests.tracing.otel import _PROVIDER

    rng = random.Random(5)
    kwargs, reads = _request(rng), _body(rng, _stream(rng, 0.0)[0])
    with _PROVIDER.get_tracer("other").start_as_current_span("chat policy",
                                                             attributes={semconv.GEN_AI_OPERATION_NAME: "chat"}):
        assert trace.get_current_span().is_recording()
        fast, took = _run(True, kwargs, reads, False)
    assert took == []
    assert fast[3] in ({"ok": 1}, {"no_token_ids": 1})
