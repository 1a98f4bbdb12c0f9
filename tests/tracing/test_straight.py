"""The straight line of the common plain Anthropic call (tracing/straight.py) stores what the general
path stores: over random requests of the common shape and plain answers, under random settings
(the semconv opt-in, the served policies and version, content capture) and spans (the anthropic
SDK's, adopted, or one of lightspan's own), both paths send the same chat request, hand the caller
the same message, leave the same attributes on the stored span and count the same outcome; every
other call goes the general way. The instrumentor end to end, the anthropic client on a mocked vLLM."""

from __future__ import annotations

import random

import httpx2
import orjson
import pytest

from lightspan.tracing import semconv, straight
from lightspan.tracing.report import REPORT
from tests.tracing.otel import _instrumented

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WORDS = ["hi", "", "é ü", "two words", "{\"a\": 1}", "x-anthropic-billing-header: 1"]
MODELS = ["policy", "m/x", "writer"]


def _request(rng: random.Random) -> dict:
    """``messages.create`` keyword arguments of the common shape."""
    kwargs = {"model": rng.choice(MODELS), "max_tokens": rng.randint(1, 64),
              "messages": [{"role": rng.choice(["user", "assistant"]), "content": rng.choice(WORDS)}
                           for _ in range(rng.randint(1, 5))]}
    if rng.random() < 0.6:
        kwargs["system"] = rng.choice(WORDS)
    extra = {}
    for key, values in (("temperature", [0.0, 0.7, 1, 2]), ("top_p", [0.9, 1]), ("top_k", [5, 40]),
                        ("stop_sequences", [["\n"], [], ["a", "b"]])):
        if rng.random() < 0.4:
            # (anthropic 2.x takes the numbers as extra fields only)
            (kwargs if key == "stop_sequences" and rng.random() < 0.5 else extra)[key] = rng.choice(values)
    if extra:
        kwargs["extra_body"] = extra
    return kwargs


def _plain_answer(rng: random.Random) -> dict:
    """A plain chat completion: one choice of text (or none), ids and logprobs of each token."""
    n, prompt = rng.randint(1, 9), rng.randint(0, 12)
    choice = {"index": 0, "message": {"role": "assistant", "content": rng.choice(["hello", "", None, "é"]),
                                      "reasoning": rng.choice([None, ""]), "tool_calls": rng.choice([[], None])},
              "finish_reason": rng.choice(["length", "stop", "abort", None, "tool_calls"]),
              "stop_reason": rng.choice([None, "\n", 7]), "token_ids": [rng.randrange(1000) for _ in range(n)],
              "logprobs": {"content": [{"token": "t", "logprob": -rng.random()} for _ in range(n)]}}
    usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    if rng.random() < 0.3:
        usage["prompt_tokens_details"] = {"cached_tokens": rng.randint(0, prompt)}
    answer = {"id": rng.choice(["chatcmpl-1", "x"]), "object": "chat.completion",
              "model": rng.choice(MODELS + [None, ""]), "choices": [choice],
              "prompt_token_ids": list(range(prompt)), "usage": rng.choice([usage, None])}
    if rng.random() < 0.2:
        answer["kv_transfer_params"] = {"k": 1}
    return answer


def _settings(rng: random.Random, monkeypatch) -> None:
    for name, values in ((semconv.SEMCONV_OPT_IN_ENV, [None, semconv.GENAI_LATEST, semconv.GENAI_LATEST_DUP]),
                         (semconv.POLICY_VERSIONS_ENV, [None, "policy=3,writer=5", "m/x=-2"]),
                         ("LIGHTSPAN_MODEL_VERSION", [None, "7", "x"]),
                         ("TRACELOOP_TRACE_CONTENT", [None, "false", "true"])):
        value = rng.choice(values)
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def _client(answer, sent: list, own_span: bool, stream_chunks=None):
    import anthropic

    def handler(request):
        sent.append((request.url.path, orjson.loads(request.content)))
        if stream_chunks is not None:
            body = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in stream_chunks) + b"data: [DONE]\n\n"
            return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})
        if isinstance(answer, int):
            return httpx2.Response(answer, json={"error": {"message": "no"}})
        return httpx2.Response(200, json=answer)

    if own_span == "theirs":   # the SDK's spans go to a provider of its own: the span to adopt never starts here
        from opentelemetry.sdk.trace import TracerProvider
        option = {"open_telemetry": {"tracer_provider": TracerProvider()}}
    else:
        option = {"open_telemetry": {"traces": {"enabled": False}}} if own_span else {}
    return anthropic.Anthropic(base_url="http://127.0.0.1:9", api_key="x", max_retries=0, **option,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def _stored(exporter) -> list:
    return [(s.name, {k: v for k, v in s.attributes.items() if k != "gen_ai.response.time_to_first_chunk"})
            for s in exporter.get_finished_spans() if s.attributes.get(semconv.CAPTURE_STATUS) not in (None, "duplicate")]


def _run(on: bool, kwargs: dict, answer, own_span: bool, how: str = "create") -> tuple:
    """(chat requests sent, the caller's message, stored spans, report counts added) of one call, and
    how many calls the straight line prepared and answered."""
    import anthropic

    straight.ON[0] = on
    sent, took = [], []
    prepare, answered = straight.prepare, straight.Straight.answer

    def noting_prepare(*a, **k):
        out = prepare(*a, **k)
        took.append(("prepared", out is not None))
        return out

    def noting_answer(self, data):
        out = answered(self, data)
        took.append(("answered", out is not None))
        return out

    straight.prepare, straight.Straight.answer = noting_prepare, noting_answer
    try:
        with _instrumented() as exporter:
            before = dict(REPORT.counts)
            client = _client(answer, sent, own_span,
                             answer if how == "stream" else None)
            try:
                if how == "stream":
                    message = [e.to_dict() for e in client.messages.create(**kwargs, stream=True)]
                elif how == "raw":
                    message = client.messages.with_raw_response.create(**kwargs).parse().to_dict()
                else:
                    message = client.messages.create(**kwargs).to_dict()
            except anthropic.APIError as e:
                message = ("error", type(e).__name__)
            counts = {k: v - before.get(k, 0) for k, v in REPORT.counts.items() if v != before.get(k, 0)}
            return (sent, message, _stored(exporter), counts), took
    finally:
        straight.prepare, straight.Straight.answer = prepare, answered
        straight.ON[0] = True


def test_the_straight_line_stores_what_the_general_path_stores(monkeypatch):
    rng = random.Random(34)
    straight_calls = 0
    for i in range(300):
        _settings(rng, monkeypatch)
        kwargs, answer, own_span = _request(rng), _plain_answer(rng), rng.choice([False, False, True, "theirs"])
        fast, took = _run(True, kwargs, answer, own_span)
        general, untouched = _run(False, kwargs, answer, own_span)
        assert fast == general, (i, kwargs, answer, own_span)
        assert took == [("prepared", True), ("answered", True)], (i, kwargs, answer)
        assert untouched == [("prepared", False)]
        assert fast[3] == {"ok": 1} and len(fast[2]) == 1
        straight_calls += 1
    assert straight_calls == 300


def _tool_answer(rng):
    answer = _plain_answer(rng)
    answer["choices"][0]["message"]["tool_calls"] = [{"id": "c1", "type": "function",
                                                     "function": {"name": "f", "arguments": "{}"}}]
    return answer


def _n2(rng):
    answer = _plain_answer(rng)
    answer["choices"].append({**answer["choices"][0], "index": 1})
    return answer


def _without(key):
    def make(rng):
        answer = _plain_answer(rng)
        if key == "prompt_token_ids":
            answer[key] = None
        elif key == "logprob":
            answer["choices"][0]["logprobs"]["content"].pop()
        else:
            answer["choices"][0][key] = None
        return answer
    return make


def _reasoning(rng):
    answer = _plain_answer(rng)
    answer["choices"][0]["message"]["reasoning"] = "hm"
    return answer


_CHUNKS = [{"id": "c", "model": "policy", "prompt_token_ids": [1, 2], "choices": [
    {"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": {"prompt_tokens": 2}},
    {"id": "c", "model": "policy", "choices": [{"index": 0, "delta": {"content": "yo"}, "token_ids": [7],
                                                "logprobs": {"content": [{"logprob": -0.25}]}, "finish_reason": "length"}]},
    {"id": "c", "model": "policy", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}]


@pytest.mark.parametrize("case", ["tool_calls", "n2", "no_ids", "no_logprobs", "short_logprobs", "no_prompt_ids",
                                  "reasoning", "error", "stream", "raw", "blocks", "tools", "metadata",
                                  "system_blocks"])
def test_every_other_call_goes_the_general_way(monkeypatch, case):
    import uuid

    from lightspan.tracing.protocols import anthropic_convert
    monkeypatch.setattr(anthropic_convert.uuid, "uuid4", lambda: uuid.UUID(int=1))   # (a thinking block's signature)
    rng = random.Random(hash(case) % 1000)
    for _ in range(10):
        _settings(rng, monkeypatch)
        kwargs, own_span, how = _request(rng), rng.random() < 0.3, "create"
        answer = {"tool_calls": _tool_answer, "n2": _n2, "no_ids": _without("token_ids"),
                  "no_logprobs": _without("logprobs"), "short_logprobs": _without("logprob"),
                  "no_prompt_ids": _without("prompt_token_ids"), "reasoning": _reasoning}.get(case, _plain_answer)(rng)
        if case == "error":
            answer = 500
        elif case == "stream":
            answer, how = _CHUNKS, "stream"
        elif case == "raw":
            how = "raw"
        elif case == "blocks":
            kwargs["messages"] = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
        elif case == "tools":
            kwargs["tools"] = [{"name": "f", "description": "d", "input_schema": {"type": "object"}}]
        elif case == "metadata":
            kwargs["metadata"] = {"user_id": "u"}
        elif case == "system_blocks":
            kwargs["system"] = [{"type": "text", "text": "s"}]
        fast, took = _run(True, kwargs, answer, own_span, how)
        general, _ = _run(False, kwargs, answer, own_span, how)
        assert fast == general
        assert ("answered", True) not in took   # the general path read it (or nothing did)
        if case == "stream":   # (the streamed call's straight line: tests/tracing/test_straight_stream.py)
            assert took == [("prepared", True)]
        elif case in ("raw", "blocks", "tools", "metadata", "system_blocks"):
            assert took == [("prepared", False)]


def test_an_llm_span_of_another_instrumentation_takes_the_general_way():
    from opentelemetry import trace

    from tests.tracing.otel import _PROVIDER

    rng = random.Random(3)
    kwargs, answer = _request(rng), _plain_answer(rng)
    tracer = _PROVIDER.get_tracer("other")
    with tracer.start_as_current_span("chat policy", attributes={semconv.GEN_AI_OPERATION_NAME: "chat"}):
        assert trace.get_current_span().is_recording()
        fast, took = _run(True, kwargs, answer, False)
    assert took == [("prepared", False)]
    assert fast[3] == {"ok": 1}
