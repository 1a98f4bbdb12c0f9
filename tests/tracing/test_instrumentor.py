"""The instrumentor against a real vLLM: token ids and logprobs land on the GenAI span."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightspan.tracing import emit_reward, rollout, semconv
from lightspan.tracing.instrumentor import LightspanInstrumentor, should_capture, with_capture


def test_capture_only_for_rl_endpoints():
    assert should_capture("http://127.0.0.1:8000/v1/", "/chat/completions", [])
    assert should_capture("http://localhost:9/v1", "/completions", [])
    assert not should_capture("https://api.openai.com/v1", "/chat/completions", [])
    assert not should_capture("http://127.0.0.1:8000/v1", "/embeddings", [])
    assert should_capture("http://vllm.internal:8000/v1", "/chat/completions", ["http://vllm.internal:8000/v1"])
    assert not should_capture("http://127.0.0.1:8000/v1", "/chat/completions", ["http://vllm.internal:8000/v1"])


def test_with_capture_keeps_the_callers_fields():
    body = {"model": "m", "logprobs": True, "top_logprobs": 3}
    out = with_capture(body, "chat")
    assert out == {**body, "return_token_ids": True}
    assert body == {"model": "m", "logprobs": True, "top_logprobs": 3}  # not mutated
    assert with_capture({"model": "m"}, "text_completion")["logprobs"] == 0
    assert with_capture({"model": "m", "logprobs": 2}, "text_completion")["logprobs"] == 2


def test_encoding_round_trip():
    ids = [0, 1, 259, 2**31 - 1, -5]
    assert semconv.decode_ids(semconv.encode_ids(ids)) == ids
    assert len(semconv.encode_ids(ids)) == 4 * len(ids)
    lp = semconv.decode_floats(semconv.encode_floats([-0.5, -12.25]))
    assert lp == [-0.5, -12.25]


@pytest.fixture()
def spans():
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # instrumentors take the provider explicitly; the global one cannot be reset between tests
    OpenAIInstrumentor().instrument(tracer_provider=provider)
    LightspanInstrumentor().instrument(tracer_provider=provider)
    previous = trace._TRACER_PROVIDER
    trace._TRACER_PROVIDER = provider
    try:
        yield exporter
    finally:
        trace._TRACER_PROVIDER = previous
        LightspanInstrumentor().uninstrument()
        OpenAIInstrumentor().uninstrument()


def _llm_spans(exporter):
    return [s for s in exporter.get_finished_spans() if s.attributes.get(semconv.GEN_AI_OPERATION_NAME)]


def test_chat_sync_async_and_completions_record_ids(spans, vllm_server, monkeypatch):
    from openai import AsyncOpenAI, OpenAI
    from transformers import AutoTokenizer

    monkeypatch.setenv("LIGHTSPAN_MODEL_VERSION", "7")
    tok = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    client = OpenAI(base_url=f"{vllm_server.url}/v1", api_key="x")
    messages = [{"role": "user", "content": "hello"}]
    with rollout("task-1", rollout_id="r-1", split="train"):
        chat = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=1.0)
        comp = client.completions.create(model="policy", prompt="abc", max_tokens=5, temperature=1.0)
        emit_reward(0.25)

    async def call_async():
        async_client = AsyncOpenAI(base_url=f"{vllm_server.url}/v1", api_key="x")
        return await async_client.chat.completions.create(model="policy", messages=messages, max_tokens=4)

    asyncio.run(call_async())
    llm = _llm_spans(spans)
    assert len(llm) == 3, [s.name for s in spans.get_finished_spans()]
    by_op = {}
    for span in llm:
        a = span.attributes
        assert a[semconv.CAPTURE_STATUS] == "ok"
        assert a[semconv.MODEL_VERSION] == 7
        (ids_bytes,) = a[semconv.COMPLETION_TOKEN_IDS]
        (lp_bytes,) = a[semconv.COMPLETION_LOGPROBS]
        ids, lps = semconv.decode_ids(ids_bytes), semconv.decode_floats(lp_bytes)
        assert 1 <= len(ids) == len(lps)
        assert all(lp <= 0 for lp in lps)
        by_op.setdefault(a[semconv.GEN_AI_OPERATION_NAME], []).append((span, ids))
    # the prompt ids are exactly the chat template's tokens, as the server tokenised them
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    chat_span = next(s for s, _ in by_op["chat"] if s.parent is not None)
    assert semconv.decode_ids(chat_span.attributes[semconv.PROMPT_TOKEN_IDS]) == list(expected)
    # the reward span and the LLM spans share the rollout root
    root = next(s for s in spans.get_finished_spans() if s.name == semconv.SPAN_ROLLOUT)
    reward = next(s for s in spans.get_finished_spans() if s.name == semconv.SPAN_REWARD)
    assert reward.attributes[semconv.REWARD] == 0.25
    assert reward.parent.span_id == root.context.span_id
    assert chat_span.parent.span_id == root.context.span_id
    # the agent still sees an ordinary response
    assert chat.choices[0].message.content is not None and comp.choices[0].text is not None


def test_hosted_endpoints_are_left_alone(spans, monkeypatch):
    """A request to a non-RL endpoint is sent exactly as the caller built it."""
    import httpx2 as httpx  # the HTTP client openai 3.x is built on
    from openai import OpenAI

    seen = {}

    def handler(request: httpx.Request):
        seen["body"] = request.content
        return httpx.Response(200, json={"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                         "choices": [{"index": 0, "finish_reason": "stop",
                                                      "message": {"role": "assistant", "content": "hi"}}]})

    client = OpenAI(base_url="https://api.example.com/v1", api_key="x",
                    http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    assert b"return_token_ids" not in seen["body"] and b"logprobs" not in seen["body"]
    (span,) = _llm_spans(spans)
    assert semconv.PROMPT_TOKEN_IDS not in span.attributes


def test_reward_must_be_finite():
    with pytest.raises(ValueError):
        emit_reward(float("nan"))
