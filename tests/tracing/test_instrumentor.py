"""The instrumentor against a real vLLM: token ids and logprobs land on the GenAI span.

Streams, ``n > 1`` and tools run against the session's real vLLM; the failure paths (no token ids,
nested GenAI spans) against a mocked transport on a loopback URL, where capture applies.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from lightspan.tracing import emit_reward, rollout, semconv
from lightspan.tracing.instrumentor import LightspanInstrumentor, should_capture, with_capture
from tests.tracing.otel import _PROVIDER, _instrumented


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
def spans(_traceloop):
    """traceloop's OpenAI instrumentation (the one we ship with) and ours."""
    with _instrumented() as exporter:
        yield exporter


@pytest.fixture()
def lightspan_only(_traceloop):
    """Our instrumentor alone: traceloop's is switched off through its own suppression key."""
    from opentelemetry import context
    from opentelemetry.semconv_ai import SUPPRESS_LANGUAGE_MODEL_INSTRUMENTATION_KEY

    token = context.attach(context.set_value(SUPPRESS_LANGUAGE_MODEL_INSTRUMENTATION_KEY, True))
    try:
        with _instrumented() as exporter:
            yield exporter, _PROVIDER.get_tracer("test")
    finally:
        context.detach(token)


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
    # the agent still sees an ordinary response: without the ids and logprobs only lightspan
    # asked for (vLLM's null, as for a request without them), with the temperature on the span
    assert chat.choices[0].message.content is not None and comp.choices[0].text is not None
    assert chat.model_extra["prompt_token_ids"] is None and chat.choices[0].model_extra["token_ids"] is None
    assert chat.choices[0].logprobs is None and comp.choices[0].logprobs is None
    assert comp.choices[0].model_extra["prompt_token_ids"] is None and comp.choices[0].model_extra["token_ids"] is None
    assert chat_span.attributes[semconv.GEN_AI_REQUEST_TEMPERATURE] == 1.0


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


# --- streaming, n > 1, tools (real vLLM) --------------------------------------------------------

def _chunk_ids(chunks):
    """What the caller itself saw: prompt ids and completion ids per choice, from the chunks."""
    prompt, per_choice = None, {}
    for chunk in chunks:
        prompt = prompt or (chunk.model_extra or {}).get("prompt_token_ids")
        for choice in chunk.choices:
            extra = choice.model_extra or {}
            prompt = prompt or extra.get("prompt_token_ids")
            per_choice.setdefault(choice.index, []).extend(extra.get("token_ids") or [])
    return prompt, [per_choice[i] for i in sorted(per_choice)]


def _assert_recorded(span, prompt, completions):
    a = span.attributes
    assert a.get(semconv.CAPTURE_STATUS) == "ok", (span.name, span.start_time, dict(a))
    assert semconv.decode_ids(a[semconv.PROMPT_TOKEN_IDS]) == prompt
    assert [semconv.decode_ids(b) for b in a[semconv.COMPLETION_TOKEN_IDS]] == completions
    lps = [semconv.decode_floats(b) for b in a[semconv.COMPLETION_LOGPROBS]]
    assert [len(x) for x in lps] == [len(x) for x in completions]
    assert all(v <= 0 for x in lps for v in x)


def test_streams_sync_and_async_chat_and_completions(spans, vllm_server):
    """The stream the caller reads is unchanged, and the ids are on the span it exported: the
    OpenAI instrumentation ends its span when the stream is exhausted, so had our attributes come
    after that end, the exported span would not carry them. Two of the calls ask for the ids
    themselves and see them (equal to the recorded ones); the other two see vLLM's ``null``, as
    without lightspan."""
    from openai import AsyncOpenAI, OpenAI

    url = f"{vllm_server.url}/v1"
    client = OpenAI(base_url=url, api_key="x")
    messages = [{"role": "user", "content": "hi"}]
    ask = {"extra_body": {"return_token_ids": True}}
    seen = []
    stream = client.chat.completions.create(model="policy", messages=messages, max_tokens=5, n=2, stream=True, **ask)
    seen.append(("chat", True, list(stream)))
    # (traceloop turns a completions stream into a plain generator: no `with` here)
    stream = client.completions.create(model="policy", prompt="abc", max_tokens=4, stream=True)
    seen.append(("text_completion", False, [chunk for chunk in stream]))

    async def call_async():
        aclient = AsyncOpenAI(base_url=url, api_key="x")
        s1 = await aclient.chat.completions.create(model="policy", messages=messages, max_tokens=3, stream=True)
        s2 = await aclient.completions.create(model="policy", prompt="xy", max_tokens=3, n=2, stream=True, **ask)
        return [("chat", False, [c async for c in s1]), ("text_completion", True, [c async for c in s2])]

    seen += asyncio.run(call_async())
    llm = sorted(_llm_spans(spans), key=lambda s: s.start_time)
    assert [s.attributes[semconv.GEN_AI_OPERATION_NAME] for s in llm] == [op for op, _, _ in seen]
    for span, (op, asked, chunks) in zip(llm, seen):
        prompt, completions = _chunk_ids(chunks)
        if asked:
            assert prompt and all(completions)
            _assert_recorded(span, prompt, completions)
        else:
            assert prompt is None and not any(completions)  # vLLM's answer to a request without them
            recorded = [semconv.decode_ids(b) for b in span.attributes[semconv.COMPLETION_TOKEN_IDS]]
            _assert_recorded(span, semconv.decode_ids(span.attributes[semconv.PROMPT_TOKEN_IDS]), recorded)
            assert len(recorded) == len(completions) and all(recorded)
        # what the caller got is vLLM's stream: the text is there, and no usage chunk was added
        assert all(chunk.choices for chunk in chunks)


def test_stream_read_halfway_is_marked_incomplete(spans, vllm_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{vllm_server.url}/v1", api_key="x")
    with client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=8, stream=True) as stream:
        next(iter(stream))
    (span,) = _llm_spans(spans)
    assert span.attributes[semconv.CAPTURE_STATUS] == "stream_incomplete"
    assert semconv.COMPLETION_TOKEN_IDS not in span.attributes


def test_n_choices_and_tools(spans, vllm_server):
    """``n > 1`` gives one bytes value per choice; a request carrying tools is captured as any
    other (the tiny model calls no tool; vLLM without a tool parser takes tool_choice="none")."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{vllm_server.url}/v1", api_key="x")
    messages = [{"role": "user", "content": "add 2 and 3"}]
    ask = {"extra_body": {"return_token_ids": True}}  # the caller sees the ids it asked for
    many = client.chat.completions.create(model="policy", messages=messages, max_tokens=4, n=3, **ask)
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
    tooled = client.chat.completions.create(model="policy", messages=messages, max_tokens=4, tools=tools,
                                            tool_choice="none", **ask)
    texts = client.completions.create(model="policy", prompt="abc", max_tokens=3, n=2, **ask)
    first, second, third = _llm_spans(spans)
    prompt = many.model_extra["prompt_token_ids"]
    _assert_recorded(first, prompt, [c.model_extra["token_ids"] for c in many.choices])
    assert len(first.attributes[semconv.COMPLETION_TOKEN_IDS]) == 3
    # the tools are rendered into the prompt by the chat template, so the prompt ids differ
    _assert_recorded(second, tooled.model_extra["prompt_token_ids"], [tooled.choices[0].model_extra["token_ids"]])
    _assert_recorded(third, texts.choices[0].model_extra["prompt_token_ids"],
                     [c.model_extra["token_ids"] for c in texts.choices])


# --- failure paths and nesting (mocked transport) ---------------------------------------------

def _completion(token_ids=(5, 6), prompt_ids=(1, 2, 3)):
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "policy",
            "prompt_token_ids": None if prompt_ids is None else list(prompt_ids),
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"},
                         "token_ids": None if token_ids is None else list(token_ids),
                         "logprobs": {"content": [{"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": []}
                                                  for _ in (token_ids or ())]}}]}


def _mocked_client(payload, seen=None, *, stream_chunks=None):
    import httpx2 as httpx
    from openai import OpenAI

    def handler(request):
        if seen is not None:
            seen.append(json.loads(request.content))
        if stream_chunks is not None:
            body = "".join(f"data: {json.dumps(c)}\n\n" for c in stream_chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=payload)

    return OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x",
                  http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def test_no_token_ids_marks_the_span_unusable(spans):
    """vLLM answers without ids with some tool and reasoning parsers: the span says so, and
    carries no partial ids that a builder could mistake for a usable call."""
    sent = []
    client = _mocked_client(_completion(token_ids=None), sent)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
    chunks = [{"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "policy",
               "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": None,
                                                       "finish_reason": "stop", "token_ids": None}]}]
    stream = _mocked_client(None, sent, stream_chunks=chunks).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "q"}], stream=True)
    assert [c.choices[0].delta.content for c in stream] == ["a"]
    assert all(body["return_token_ids"] is True and body["logprobs"] is True for body in sent)
    for span in _llm_spans(spans):
        assert span.attributes[semconv.CAPTURE_STATUS] == "no_token_ids"
        assert semconv.PROMPT_TOKEN_IDS not in span.attributes
        assert semconv.COMPLETION_TOKEN_IDS not in span.attributes


def test_nested_genai_spans_record_on_the_innermost(lightspan_only):
    """Two OpenAI instrumentations (or a framework's LLM span around the client's) make nested
    GenAI spans for one call: the innermost gets the ids, each enclosing one is marked."""
    exporter, tracer = lightspan_only
    client = _mocked_client(_completion())
    chat = {semconv.GEN_AI_OPERATION_NAME: "chat"}
    completion = {"llm.request.type": "completion"}  # traceloop's older name counts too
    with tracer.start_as_current_span("outer", attributes=completion), \
            tracer.start_as_current_span("middle", attributes=chat), \
            tracer.start_as_current_span("framework step"), \
            tracer.start_as_current_span("inner", attributes=chat) as inner:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    assert set(by_name) == {"outer", "middle", "framework step", "inner"}  # no span of our own
    assert semconv.decode_ids(by_name["inner"].attributes[semconv.PROMPT_TOKEN_IDS]) == [1, 2, 3]
    inner_id = format(inner.get_span_context().span_id, "016x")
    for name in ("outer", "middle"):
        a = by_name[name].attributes
        assert a[semconv.CAPTURE_STATUS] == "duplicate" and a[semconv.CAPTURE_DUPLICATE_OF] == inner_id
        assert semconv.PROMPT_TOKEN_IDS not in a
    assert semconv.CAPTURE_STATUS not in by_name["framework step"].attributes

    # an LLM span, then a non-LLM span as the current one: our own GenAI span, and the LLM span marked
    exporter.clear()
    with tracer.start_as_current_span("framework llm", attributes=chat), tracer.start_as_current_span("step"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    own = by_name["chat policy"]
    assert own.attributes[semconv.CAPTURE_STATUS] == "ok"
    assert by_name["framework llm"].attributes[semconv.CAPTURE_DUPLICATE_OF] == format(own.context.span_id, "016x")


def test_without_openai_instrumentation_a_genai_span_of_our_own(lightspan_only):
    """Under a non-LLM span (here the rollout root) the ids go on a new GenAI child span."""
    exporter, _ = lightspan_only
    client = _mocked_client(_completion())
    with rollout("t", rollout_id="r"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
    root = next(s for s in exporter.get_finished_spans() if s.name == semconv.SPAN_ROLLOUT)
    (own,) = _llm_spans(exporter)
    assert own.name == "chat policy" and own.parent.span_id == root.context.span_id
    assert own.attributes[semconv.CAPTURE_STATUS] == "ok"
    assert own.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert own.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 3
    assert semconv.PROMPT_TOKEN_IDS not in root.attributes


def test_traceloop_span_inside_another_genai_span(spans):
    """The installed pair as it nests in practice: a GenAI span from another instrumentation around
    traceloop's ``openai.chat``: the ids go on traceloop's, the outer one is marked."""
    tracer = _PROVIDER.get_tracer("other-openai-instrumentation")
    with tracer.start_as_current_span("chat policy", attributes={semconv.GEN_AI_OPERATION_NAME: "chat"}):
        _mocked_client(_completion()).chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
    inner, outer = _llm_spans(spans)
    assert inner.name == "openai.chat" and inner.parent.span_id == outer.context.span_id
    assert inner.attributes[semconv.CAPTURE_STATUS] == "ok"
    assert outer.attributes[semconv.CAPTURE_DUPLICATE_OF] == format(inner.context.span_id, "016x")


def test_openai_sdk_example_agent_runs_unchanged(spans, vllm_server, monkeypatch):
    """examples/openai_sdk_agent.py (sync, streamed and async calls) under the instrumentation it
    gets from ``opentelemetry-instrument``: every call is captured, and its reward is emitted."""
    import runpy
    from pathlib import Path

    monkeypatch.setenv("OPENAI_BASE_URL", f"{vllm_server.url}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "x")
    monkeypatch.setenv("LIGHTSPAN_TASK", json.dumps({"id": "add-1", "prompt": "What is 2 + 3?", "answer": "5"}))
    example = Path(__file__).resolve().parents[2] / "examples" / "openai_sdk_agent.py"
    runpy.run_path(str(example), run_name="__main__")
    llm = _llm_spans(spans)
    assert len(llm) == 4
    assert all(s.attributes[semconv.CAPTURE_STATUS] == "ok" for s in llm)
    assert [s.name for s in spans.get_finished_spans()].count(semconv.SPAN_REWARD) == 1
