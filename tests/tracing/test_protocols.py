"""Every protocol an agent speaks, captured token-faithfully, against the session's real vLLM.

The clients call a recording pass-through proxy in front of vLLM (tests/tracing/test_frameworks.py):
what vLLM put on the wire is read there, by code written apart from lightspan's parsers, and the
spans must hold exactly that. Per protocol (chat completions, the Responses API, Anthropic
Messages) and per shape (a response, a stream; sync and async):

- the stored prompt ids, completion ids and logprobs are vLLM's (a Responses call goes as a chat
  completion, which has a logprob for every token; one that does not convert goes to
  ``/v1/responses``, whose streams drop the logprobs of tokens without text: ``no_logprobs``);
- the caller gets what it gets without lightspan (the Anthropic and Responses clients: what vLLM's
  own ``/v1/messages`` and ``/v1/responses`` answer, compared greedily);
- tool turns (Responses ``function_call`` / ``function_call_output`` items, chat tool calls,
  Anthropic ``tool_use`` / ``tool_result`` blocks) are on the span's messages, and two turns
  around a tool call merge into one per-rollout sequence (lightningrl/sequences.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from lightspan.tracing import semconv
from tests.tracing.otel import _instrumented
from tests.tracing.test_frameworks import _f32, vllm_returned

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOOL_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL_TEXT = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'
# vLLM's structured outputs make the random tiny model write exactly that tool call, in the form the
# chat template renders an assistant's tool call back: the next turn's prompt extends this one's
FORCED = {"structured_outputs": {"regex": re.escape(CALL_TEXT)}}


@pytest.fixture()
def captured(_traceloop, recorder):
    """(exporter, recorder) with traceloop's OpenAI instrumentation and lightspan's on one provider."""
    recorder.clear()
    with _instrumented() as exporter:
        yield exporter, recorder


def _exchanges(recorder, n: int) -> list:
    """The recorder's exchanges once it holds ``n`` (it keeps one after relaying the answer: the
    client can have it a moment before)."""
    deadline = time.monotonic() + 30
    while True:
        with recorder.lock:
            if len(recorder.exchanges) >= n or time.monotonic() > deadline:
                return list(recorder.exchanges)
        time.sleep(0.01)


def _calls(exporter) -> list:
    """The LLM spans that carry a call (not the ones marked as another's duplicate), in start order."""
    spans = [s for s in exporter.get_finished_spans()
             if s.attributes.get(semconv.CAPTURE_STATUS) not in (None, "duplicate")]
    return sorted(spans, key=lambda s: s.start_time)


def _stored(span) -> tuple:
    a = span.attributes
    logprobs = a.get(semconv.COMPLETION_LOGPROBS)
    return (tuple(semconv.decode_ids(a[semconv.PROMPT_TOKEN_IDS])),
            tuple(semconv.decode_ids(a[semconv.COMPLETION_TOKEN_IDS][0])),
            tuple(semconv.decode_floats(logprobs[0])) if logprobs else None)


def responses_returned(exchange) -> tuple:
    """(prompt ids, completion ids, logprobs of the output text) of one recorded Responses answer,
    from its JSON body or its last SSE event (written apart from lightspan's parser)."""
    _, _, ctype, body = exchange
    if ctype.startswith("text/event-stream"):
        events = [json.loads(line[len(b"data: "):]) for line in body.splitlines() if line.startswith(b"data: ")]
        response = [e["response"] for e in events if e["type"] == "response.completed"][-1]
    else:
        response = json.loads(body)
    prompt = response["input_messages"][0]["tokens"]
    (completion,) = [m["tokens"] for m in response["output_messages"]]
    logprobs = [lp["logprob"] for item in response["output"] if item["type"] == "message"
                for part in item["content"] for lp in part.get("logprobs") or ()]
    return tuple(prompt), tuple(completion), tuple(_f32(logprobs))


def _openai(recorder, asynchronous=False):
    from openai import AsyncOpenAI, OpenAI

    return (AsyncOpenAI if asynchronous else OpenAI)(base_url=f"{recorder.url}/v1", api_key="x")


def _anthropic(recorder, asynchronous=False):
    import anthropic

    return (anthropic.AsyncAnthropic if asynchronous else anthropic.Anthropic)(base_url=recorder.url, api_key="x")


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
def test_chat_completions(captured, stream):
    exporter, recorder = captured
    out = _openai(recorder).chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=6, stream=stream)
    if stream:
        assert all(c.choices[0].logprobs is None for c in out if c.choices)
    else:
        assert out.choices[0].logprobs is None and out.choices[0].model_extra.get("token_ids") is None
    (span,) = _calls(exporter)
    (exchange,) = _exchanges(recorder, 1)
    path, sent = exchange[0], exchange[1]
    assert path == "/v1/chat/completions" and sent["return_token_ids"] is True
    assert span.attributes[semconv.CAPTURE_STATUS] == "ok" and _stored(span) == vllm_returned(exchange)


@pytest.mark.parametrize("how", ["response", "stream", "stream_manager", "async_stream", "streaming_response"])
def test_responses_api(captured, how):
    """A Responses call goes to vLLM as the chat completion vLLM's own route would make of it
    (tracing/protocols/responses_convert.py): the span holds vLLM's ids and a logprob per token, streamed
    too; the caller gets a Response, or its events, with none of what lightspan asked for."""
    exporter, recorder = captured
    kwargs = dict(model="policy", input="Say hi.", max_output_tokens=6)
    if how == "response":
        out = _openai(recorder).responses.create(**kwargs)
        # the caller asked for neither: vLLM's answer to such a request has them null
        assert out.model_extra["input_messages"] is None and out.model_extra["output_messages"] is None
        assert out.output[0].content[0].logprobs is None
    elif how == "stream":
        events = list(_openai(recorder).responses.create(**kwargs, stream=True))
        assert events[-1].type == "response.completed" and events[-1].response.model_extra["input_messages"] is None
        assert all(not getattr(e, "logprobs", None) for e in events)
    elif how == "stream_manager":
        with _openai(recorder).responses.stream(**kwargs) as stream:
            list(stream)
            assert stream.get_final_response().model_extra["output_messages"] is None
    elif how == "async_stream":
        async def run():
            return [e async for e in await _openai(recorder, True).responses.create(**kwargs, stream=True)]
        assert asyncio.run(run())[-1].type == "response.completed"
    else:   # the OpenAI Agents SDK's streams: with_streaming_response, then parse()
        async def run():
            client = _openai(recorder, True)
            async with client.responses.with_streaming_response.create(**kwargs, stream=True) as response:
                return [e async for e in await response.parse()]
        assert asyncio.run(run())[-1].type == "response.completed"
    (span,) = _calls(exporter)
    (exchange,) = _exchanges(recorder, 1)
    path, sent = exchange[0], exchange[1]
    assert path == "/v1/chat/completions" and sent["return_token_ids"] is True and sent["logprobs"] is True
    assert sent["messages"] == [{"role": "user", "content": "Say hi."}] and sent["max_tokens"] == 6
    assert "input" not in sent and "include" not in sent
    assert span.attributes[semconv.CAPTURE_STATUS] == "ok" and _stored(span) == vllm_returned(exchange)
    assert span.attributes[semconv.GEN_AI_OPERATION_NAME] == "chat"
    assert span.instrumentation_scope.name == "lightspan.instrumentor"


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
def test_a_responses_request_that_does_not_convert_goes_to_vllms_responses_route(captured, stream):
    """A request the conversion cannot reproduce (here: the caller asks for the output text's
    logprobs, which only vLLM's Responses route writes) goes to ``/v1/responses`` with the capture
    fields; vLLM gives logprobs only for tokens with text, and the span says so where they fall short."""
    exporter, recorder = captured
    kwargs = dict(model="policy", input="Say hi.", max_output_tokens=6, include=["message.output_text.logprobs"])
    if stream:
        events = list(_openai(recorder).responses.create(**kwargs, stream=True))
        assert events[-1].type == "response.completed" and events[-1].response.model_extra["input_messages"] is None
    else:
        out = _openai(recorder).responses.create(**kwargs)
        # the caller asked for the logprobs (it gets them) but not for the ids (null, as vLLM answers it)
        assert out.model_extra["input_messages"] is None and out.output[0].content[0].logprobs is not None
    (span,) = _calls(exporter)
    (exchange,) = _exchanges(recorder, 1)
    path, sent = exchange[0], exchange[1]
    assert path == "/v1/responses" and sent["enable_response_messages"] is True
    assert sent["include"] == ["message.output_text.logprobs"]
    prompt, completion, logprobs = responses_returned(exchange)
    stored = _stored(span)
    assert stored[:2] == (prompt, completion) and len(prompt) > 0 and len(completion) > 0
    # the logprobs when vLLM gave one per token; it gives none for tokens without text (a stream's
    # end-of-turn token, a reply whose text is empty), and the span says so
    status = span.attributes[semconv.CAPTURE_STATUS]
    assert status == ("ok" if len(logprobs) == len(completion) else "no_logprobs")
    if status == "ok":
        assert stored[2] == logprobs
    else:
        assert stored[2] is None and "include" in span.attributes[semconv.CAPTURE_REASON]


@pytest.mark.parametrize("how", ["response", "stream", "stream_manager", "async_response", "raw_response",
                                 "streaming_response", "async_raw_response"])
def test_anthropic_messages(captured, how):
    exporter, recorder = captured
    # greedy (extra_body: this SDK's create() takes no temperature): a sampled reply of the tiny model
    # could end within its 6 tokens (stop_reason end_turn; the fresh-clone CI run met it once)
    kwargs = dict(model="policy", max_tokens=6, system="Be brief.", messages=[{"role": "user", "content": "hi"}],
                  extra_body={"temperature": 0.0})
    if how == "response":
        message = _anthropic(recorder).messages.create(**kwargs)
    elif how == "raw_response":   # the body is parsed by the caller, after the call returned
        message = _anthropic(recorder).messages.with_raw_response.create(**kwargs).parse()
    elif how == "streaming_response":
        with _anthropic(recorder).messages.with_streaming_response.create(**kwargs) as response:
            message = response.parse()
    elif how == "async_raw_response":
        async def call():
            return await (await _anthropic(recorder, True).messages.with_raw_response.create(**kwargs)).parse()
        message = asyncio.run(call())
    elif how == "stream":
        events = list(_anthropic(recorder).messages.create(**kwargs, stream=True))
        assert [e.type for e in events][:1] == ["message_start"] and events[-1].type == "message_stop"
    elif how == "stream_manager":
        with _anthropic(recorder).messages.stream(**kwargs) as stream:
            "".join(stream.text_stream)
            message = stream.get_final_message()
    else:
        message = asyncio.run(_anthropic(recorder, True).messages.create(**kwargs))
    if how != "stream":
        assert message.type == "message" and message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    (span,) = _calls(exporter)
    (exchange,) = _exchanges(recorder, 1)
    path, sent = exchange[0], exchange[1]
    # the converted request, with the capture fields; the system prompt leads it, as in vLLM's conversion
    assert path == "/v1/chat/completions" and sent["return_token_ids"] is True
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert span.attributes[semconv.CAPTURE_STATUS] == "ok" and _stored(span) == vllm_returned(exchange)
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("max_tokens",)
    llm = [s for s in exporter.get_finished_spans() if s.attributes.get(semconv.GEN_AI_OPERATION_NAME)]
    if how == "streaming_response":
        # (the SDK ends its span as the body is read, before parse() decodes it: a span of lightspan's
        # holds the call, the SDK's inside it is marked as its duplicate)
        (sdk,) = [s for s in llm if s is not span]
        assert sdk.attributes[semconv.CAPTURE_DUPLICATE_OF] == format(span.context.span_id, "016x")
        assert span.instrumentation_scope.name == "lightspan.instrumentor"
        return
    # the call's one LLM span is the anthropic SDK's own, which lightspan records on: no second span
    assert span.name == "anthropic.messages.create" and span.instrumentation_scope.name == "com.anthropic.sdk.python"
    # (the model and the usage as the SDK records them, of the message lightspan converted)
    prompt, completion, _ = _stored(span)
    assert (span.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS], span.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS],
            span.attributes[semconv.GEN_AI_RESPONSE_MODEL]) == (len(prompt), len(completion), "policy")
    assert [s.name for s in llm] == [span.name]
    assert json.loads(span.attributes[semconv.GEN_AI_INPUT_MESSAGES]) == [
        {"role": "system", "parts": [{"type": "text", "content": "Be brief."}]},
        {"role": "user", "parts": [{"type": "text", "content": "hi"}]}]
    (output,) = json.loads(span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])
    assert output["role"] == "assistant" and output["finish_reason"] == "max_tokens"


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
@pytest.mark.parametrize("how", ["tracing_off", "own_provider"])
def test_anthropic_without_a_span_to_adopt(captured, stream, how):
    """An anthropic client whose own tracing is off, or whose spans go to a provider of its own
    (lightspan never sees them start), gets a span of lightspan's, as with older anthropic releases."""
    import anthropic
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter, recorder = captured
    theirs = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(theirs))
    option = {"traces": {"enabled": False}} if how == "tracing_off" else {"tracer_provider": provider}
    client = anthropic.Anthropic(base_url=recorder.url, api_key="x", open_telemetry=option)
    t0 = time.time_ns()
    out = client.messages.create(model="policy", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                 stream=stream)
    if stream:
        assert [e.type for e in out][-1] == "message_stop"
    (span,) = _calls(exporter)
    assert span.name == "chat policy" and span.instrumentation_scope.name == "lightspan.instrumentor"
    assert span.attributes[semconv.CAPTURE_STATUS] == "ok" and span.start_time >= t0
    assert span.attributes[semconv.GEN_AI_INPUT_MESSAGES]
    assert [s.name for s in theirs.get_finished_spans()] == ([] if how == "tracing_off" else ["anthropic.messages.create"])


WEATHER = [{"name": "get_weather", "description": "Get the weather.", "input_schema": TOOL_PARAMS}]
ANTHROPIC_TOOL_TURN = [
    {"role": "user", "content": "Weather in Tokyo?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Tokyo"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                                 {"type": "text", "text": "So?"}]}]


def with_cache_counts(message: dict) -> dict:
    """vLLM's own /v1/messages answer (or message_delta event) with the cache counts Anthropic's API
    sends (0 when unused)."""
    fill = {k: 0 for k in ("cache_creation_input_tokens", "cache_read_input_tokens") if message["usage"][k] is None}
    return {**message, "usage": {**message["usage"], **fill}}


@pytest.mark.parametrize("body", [
    dict(messages=[{"role": "user", "content": "hi"}]),
    dict(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}], tools=WEATHER,
         messages=ANTHROPIC_TOOL_TURN),
    dict(stop_sequences=["a"], tools=WEATHER, tool_choice={"type": "auto"}, messages=[{"role": "user", "content": "x"}]),
], ids=["plain", "tool_turn", "tool_choice"])
def test_anthropic_answers_as_vllms_own_messages_route(captured, vllm_server, body):
    """Greedy, the caller gets through lightspan what vLLM's /v1/messages answers (ids aside)."""
    import anthropic
    from pydantic import TypeAdapter

    exporter, recorder = captured
    body = {"model": "policy", "max_tokens": 8, **body}
    greedy = {"temperature": 0}   # (the anthropic client takes it as an extra field)
    direct = httpx.post(f"{vllm_server.url}/v1/messages", json={**body, **greedy}, timeout=120).json()
    expected = anthropic.types.Message.model_validate(direct).model_dump(exclude={"id"})
    answer = _anthropic(recorder).messages.create(**body, extra_body=greedy)
    # the one difference: the cache counts Anthropic's API always sends (0 here), which vLLM leaves out
    assert answer.usage.cache_read_input_tokens + answer.usage.cache_creation_input_tokens == 0
    assert answer.model_dump(exclude={"id"}) == with_cache_counts(expected)
    with httpx.stream("POST", f"{vllm_server.url}/v1/messages", json={**body, **greedy, "stream": True}, timeout=120) as r:
        direct_events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)

    def dumped(events):
        """The events, a block's consecutive deltas joined: how many tokens one delta holds depends on
        the engine's timing (vLLM's own route differs from run to run too), not on the conversion."""
        out = []
        for e in (e.model_dump() for e in events):
            last = out[-1] if out else None
            if (last and e["type"] == last["type"] == "content_block_delta" and e["index"] == last["index"]
                    and e["delta"]["type"] == last["delta"]["type"]):
                key = {"text_delta": "text", "input_json_delta": "partial_json", "thinking_delta": "thinking"}[
                    e["delta"]["type"]]
                last["delta"][key] += e["delta"][key]
            else:
                out.append(e)
        out[0]["message"].pop("id")
        return out

    ours = list(_anthropic(recorder).messages.create(**body, extra_body=greedy, stream=True))
    assert ours[0].message.usage.cache_read_input_tokens == 0
    theirs = dumped([adapter.validate_python(e) for e in direct_events])
    theirs[0]["message"] = with_cache_counts(theirs[0]["message"])
    theirs = [with_cache_counts(e) if e["type"] == "message_delta" else e for e in theirs]
    assert dumped(ours) == theirs
    calls = _calls(exporter)
    assert [s.attributes[semconv.CAPTURE_STATUS] for s in calls] == ["ok", "ok"]
    if body["messages"] is ANTHROPIC_TOOL_TURN:   # the tool turn is on the span's messages
        messages = json.loads(calls[0].attributes[semconv.GEN_AI_INPUT_MESSAGES])
        assert messages[-3:] == [
            {"role": "assistant", "parts": [{"type": "text", "content": "Checking."}, {
                "type": "tool_call", "id": "toolu_1", "name": "get_weather", "arguments": {"city": "Tokyo"}}]},
            {"role": "tool", "parts": [{"type": "tool_call_response", "id": "toolu_1", "response": "Sunny"}]},
            {"role": "user", "parts": [{"type": "text", "content": "So?"}]}]


RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the weather.",
                    "parameters": TOOL_PARAMS}]
RESPONSES_TOOL_TURN = [
    {"role": "user", "content": "Weather in Tokyo?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Tokyo"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
    {"role": "user", "content": [{"type": "input_text", "text": "So?"}]}]


def _aside(obj):
    """A Response or event as the SDK dumps it, without what differs from call to call by design:
    ids (the response's, items', tool calls'), ``created_at``, ``sequence_number``, and the prompt
    cache counts (vLLM's Responses route counts the prompt tokens it read from and wrote to its
    prefix cache, its chat route neither: responses_convert.py's docstring)."""
    if isinstance(obj, dict):
        return {k: 0 if k in ("cached_tokens", "cache_write_tokens") else _aside(v) for k, v in obj.items()
                if k not in ("id", "item_id", "call_id", "created_at", "sequence_number")}
    if isinstance(obj, list):
        return [_aside(v) for v in obj]
    return obj


def _joined(events: list) -> list:
    """Dumped stream events with an item's consecutive deltas joined: how many tokens one delta
    holds depends on the engine's timing (vLLM's own route differs from run to run too)."""
    out = []
    for e in events:
        last = out[-1] if out else None
        if (last and e["type"] == last["type"] and e["type"].endswith(".delta")
                and e["output_index"] == last["output_index"]):
            last["delta"] += e["delta"]
        else:
            out.append(e)
    return out


@pytest.mark.parametrize("body", [
    dict(instructions="Be brief.", input="hi", max_output_tokens=8),
    dict(input="Weather in Tokyo?", tools=RESPONSES_TOOLS, max_output_tokens=120, extra_body=FORCED),
    dict(input=RESPONSES_TOOL_TURN, tools=RESPONSES_TOOLS, max_output_tokens=8),
], ids=["plain", "forced_tool_call", "tool_output_turn"])
def test_responses_answers_as_vllms_own_responses_route(captured, vllm_server, body):
    """Greedy, the caller gets through lightspan what vLLM's /v1/responses answers, parsed and
    streamed (ids, timestamps and the cache count aside), while vLLM is called as a chat completion
    and the span holds a logprob for every token."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    exporter, recorder = captured
    extra = body.pop("extra_body", {})
    body = {"model": "policy", "temperature": 0, **body}
    direct = httpx.post(f"{vllm_server.url}/v1/responses", json={**body, **extra}, timeout=120).json()
    answer = _openai(recorder).responses.create(**body, extra_body=extra or None)
    assert _aside(answer.model_dump()) == _aside(Response.model_validate(direct).model_dump())
    if extra:   # the forced call is the answer: a tool-call-only reply
        assert [item.type for item in answer.output] == ["function_call"]
    with httpx.stream("POST", f"{vllm_server.url}/v1/responses", json={**body, **extra, "stream": True},
                      timeout=120) as r:
        direct_events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    adapter = TypeAdapter(ResponseStreamEvent)
    theirs = [adapter.validate_python(e).model_dump() for e in direct_events]
    ours = [e.model_dump() for e in _openai(recorder).responses.create(**body, extra_body=extra or None, stream=True)]
    assert [e["sequence_number"] for e in ours] == list(range(len(ours)))
    assert _aside(_joined(ours)) == _aside(_joined(theirs))
    exchanges = _exchanges(recorder, 2)
    assert [e[0] for e in exchanges] == ["/v1/chat/completions"] * 2
    calls = _calls(exporter)
    assert [s.attributes[semconv.CAPTURE_STATUS] for s in calls] == ["ok", "ok"]
    assert [_stored(s) for s in calls] == [vllm_returned(e) for e in exchanges]


def test_an_anthropic_request_vllm_would_convert_otherwise_goes_as_it_is(captured):
    exporter, recorder = captured
    message = _anthropic(recorder).messages.create(
        model="policy", max_tokens=4, messages=[{"role": "system", "content": "inline"},
                                                {"role": "user", "content": "hi"}])
    assert message.type == "message"
    ((path, sent, _, _),) = _exchanges(recorder, 1)
    assert path == "/v1/messages" and "return_token_ids" not in sent
    (span,) = _calls(exporter)
    assert span.attributes[semconv.CAPTURE_STATUS] == "unsupported_request"
    assert "role 'system'" in span.attributes[semconv.CAPTURE_REASON]


def _sequences(tmp_path, calls) -> list:
    """The per-rollout transitions the builder makes of one rollout with these captured calls."""
    from tests.lightningrl.helpers import build, call, reward, runner, write

    rows = []
    for rollout, value in (("r", 1.0), ("r2", 0.0)):   # a group of two: GRPO needs a sibling
        rows += [call(rollout, 20 * i, 20 * i + 10, prompt=p, completion=c, logprobs=lp, tokens=lp is not None)
                 for i, (p, c, lp) in enumerate(calls)]
        rows += [reward(rollout, 100, value), runner(rollout, 110)]
    write(tmp_path, rows)
    table, _ = build(tmp_path, output="per_rollout")
    return [t for t in table.to_pylist() if t["rollout_id"] == "r"]


def test_chat_turns_around_a_tool_call_are_one_sequence(captured, tmp_path):
    exporter, recorder = captured
    client = _openai(recorder)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather.",
                                               "parameters": TOOL_PARAMS}}]
    history = [{"role": "user", "content": "Weather in Tokyo?"}]
    first = client.chat.completions.create(model="policy", messages=history, tools=tools, max_tokens=120,
                                           extra_body=FORCED)
    (tool_call,) = first.choices[0].message.tool_calls
    assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == ("get_weather", {"city": "Tokyo"})
    history += [first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": tool_call.id, "content": "Sunny"}]
    client.chat.completions.create(model="policy", messages=history, tools=tools, max_tokens=6)
    one, two = _calls(exporter)
    (p1, c1, l1), (p2, c2, l2) = _stored(one), _stored(two)
    assert p2[:len(p1) + len(c1)] == p1 + c1          # the template renders the tool call as sampled
    messages = json.loads(two.attributes[semconv.GEN_AI_INPUT_MESSAGES])
    assert messages[-2]["parts"][0]["type"] == "tool_call" and messages[-1] == {
        "role": "tool", "parts": [{"type": "tool_call_response", "id": tool_call.id, "response": "Sunny"}]}
    (sequence,) = _sequences(tmp_path, [(p1, c1, l1), (p2, c2, l2)])
    between = len(p2) - len(p1) - len(c1)             # the tool's answer and the turn markers
    assert sequence["num_calls"] == 2 and sequence["prompt_token_ids"] == list(p1)
    assert sequence["completion_token_ids"] == list(c1) + list(p2[len(p1) + len(c1):]) + list(c2)
    assert sequence["completion_mask"] == [1] * len(c1) + [0] * between + [1] * len(c2)


def test_responses_turns_around_a_tool_call(captured, tmp_path):
    """The function_call / function_call_output items render so the next prompt extends the last
    turn, and both turns, the tool-call-only one too, carry a logprob per token (vLLM's Responses
    route gives none for a tool call): one per-rollout sequence, both turns trained."""
    exporter, recorder = captured
    client = _openai(recorder)
    tools = [{"type": "function", "name": "get_weather", "description": "Get the weather.", "parameters": TOOL_PARAMS}]
    first = client.responses.create(model="policy", input="Weather in Tokyo?", tools=tools, max_output_tokens=120,
                                    extra_body=FORCED)
    (call,) = [item for item in first.output if item.type == "function_call"]
    history = [{"role": "user", "content": "Weather in Tokyo?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    second = client.responses.create(model="policy", input=history, tools=tools, max_output_tokens=6)
    one, two = _calls(exporter)
    # traceloop starts its span of a completed call (the first; the second too when the model ended it
    # within its 6 tokens, else it stops at its length limit and traceloop opens none) after the call,
    # beside ours: marked as ours
    theirs = [s for s in exporter.get_finished_spans() if s.name == "openai.response"]
    expected = [one] + ([two] if second.status == "completed" else [])
    assert [s.attributes.get(semconv.CAPTURE_DUPLICATE_OF) for s in theirs] == [
        format(s.context.span_id, "016x") for s in expected]
    assert [one.attributes[semconv.CAPTURE_STATUS], two.attributes[semconv.CAPTURE_STATUS]] == ["ok", "ok"]
    exchanges = _exchanges(recorder, 2)
    assert [e[0] for e in exchanges] == ["/v1/chat/completions"] * 2
    assert [_stored(one), _stored(two)] == [vllm_returned(e) for e in exchanges]
    (p1, c1, l1), (p2, c2, l2) = _stored(one), _stored(two)
    assert p2[:len(p1) + len(c1)] == p1 + c1
    assert json.loads(one.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["parts"] == [
        {"type": "tool_call", "id": call.call_id, "name": "get_weather", "arguments": {"city": "Tokyo"}}]
    messages = json.loads(two.attributes[semconv.GEN_AI_INPUT_MESSAGES])
    assert messages[1:] == [
        {"role": "assistant", "parts": [{"type": "tool_call", "id": call.call_id, "name": "get_weather",
                                         "arguments": {"city": "Tokyo"}}]},
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": call.call_id, "response": "Sunny"}]}]
    (sequence,) = _sequences(tmp_path, [(p1, c1, l1), (p2, c2, l2)])
    between = len(p2) - len(p1) - len(c1)             # the tool's answer and the turn markers
    assert sequence["num_calls"] == 2 and sequence["prompt_token_ids"] == list(p1)
    assert sequence["completion_mask"] == [1] * len(c1) + [0] * between + [1] * len(c2)


def test_agent_lightnings_agents_get_the_ids_they_read(captured, monkeypatch):
    """Agent Lightning's agents read ``choice.token_ids`` without asking (its proxy always adds
    them): a call to AGL_OPENAI_BASE_URL gets them; the same call elsewhere does not."""
    exporter, recorder = captured
    client = _openai(recorder)
    prompt = [256, 84, 82, 68]
    plain = client.completions.create(model="policy", prompt=prompt, max_tokens=4)
    monkeypatch.setenv("AGL_OPENAI_BASE_URL", f"http://localhost:{recorder.server_address[1]}/v1/")
    agl = client.completions.create(model="policy", prompt=prompt, max_tokens=4)
    chat = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert plain.choices[0].model_extra.get("token_ids") is None
    # (as many ids as tokens generated: the served weights, which other tests change, may end early)
    assert len(agl.choices[0].model_extra["token_ids"]) == agl.usage.completion_tokens >= 1
    assert agl.choices[0].logprobs is not None
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens >= 1
    assert chat.model_extra["prompt_token_ids"]
    assert [s.attributes[semconv.CAPTURE_STATUS] for s in _calls(exporter)] == ["ok", "ok", "ok"]


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_behind_a_gateway_a_call_sends_its_span(monkeypatch, api):
    """LIGHTSPAN_CAPTURE_URLS=none: the gateway captures. The span that describes the call here sends
    its trace context (traceloop's chat span, current during the call; for a Responses call, whose
    traceloop span starts only after the call, lightspan's own), so the gateway's span is its child
    and store/views.py keeps one row for the call; this span says ``gateway``, not "not captured"."""
    import httpx2
    from openai import OpenAI

    sent = []

    def handler(request):
        sent.append((dict(request.headers), json.loads(request.content)))
        if api == "chat":
            return httpx2.Response(200, json={"id": "c", "object": "chat.completion", "created": 0, "model": "policy",
                                              "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                                  "role": "assistant", "content": "hi"}}]})
        return httpx2.Response(200, json={"id": "r", "object": "response", "created_at": 0, "model": "policy",
                                          "status": "completed", "output": [], "parallel_tool_calls": True,
                                          "tool_choice": "auto", "tools": []})

    monkeypatch.setenv("LIGHTSPAN_CAPTURE_URLS", "none")
    with _instrumented() as exporter:
        client = OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x",
                        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
        if api == "chat":
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        else:
            client.responses.create(model="policy", input="hi")
    ((headers, body),) = sent
    # the request goes as the caller wrote it, to the path it called: the gateway converts and captures
    assert not {"enable_response_messages", "include", "return_token_ids", "logprobs"} & set(body)
    assert ("messages" in body) == (api == "chat")
    (span,) = [s for s in exporter.get_finished_spans() if s.attributes.get(semconv.CAPTURE_STATUS) != "duplicate"]
    assert span.name == ("openai.chat" if api == "chat" else "chat policy")
    assert headers["traceparent"].split("-")[2] == format(span.context.span_id, "016x")
    assert span.attributes[semconv.CAPTURE_STATUS] == "gateway"
    assert "gateway" in span.attributes[semconv.CAPTURE_REASON]


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
def test_every_protocol_records_the_policy_that_served_the_call(captured, monkeypatch, stream):
    """Several policies served (LIGHTSPAN_POLICY_VERSIONS, as the runner sets it): a call records the
    policy its model name is and that policy's version, whichever protocol made it; a call to another
    model (the base) records neither."""
    exporter, recorder = captured
    monkeypatch.setenv(semconv.POLICY_VERSIONS_ENV, "policy=3,checker=1")
    monkeypatch.setenv("LIGHTSPAN_MODEL_VERSION", "9")    # a single policy's version: not this call's
    chat = dict(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=stream)
    out = _openai(recorder).chat.completions.create(**chat)
    if stream:
        list(out)
    responses = dict(model="policy", input="Say hi.", max_output_tokens=4)
    if stream:
        list(_openai(recorder).responses.create(**responses, stream=True))
        list(_anthropic(recorder).messages.create(model="policy", max_tokens=4, stream=True,
                                                  messages=[{"role": "user", "content": "hi"}]))
    else:
        _openai(recorder).responses.create(**responses)
        _anthropic(recorder).messages.create(model="policy", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    spans = _calls(exporter)
    # (traceloop's span of the chat call, lightspan's of the Responses call, the anthropic SDK's own)
    assert [s.instrumentation_scope.name for s in spans][1:] == ["lightspan.instrumentor", "com.anthropic.sdk.python"]
    for span in spans:
        assert span.attributes[semconv.CAPTURE_STATUS] == "ok", span.attributes   # (Responses streams too)
        assert (span.attributes[semconv.POLICY_NAME], span.attributes[semconv.MODEL_VERSION]) == ("policy", 3)
    assert len(spans) == 3
    exporter.clear()
    monkeypatch.setenv(semconv.POLICY_VERSIONS_ENV, "writer=3,checker=1")    # "policy" is none of them
    _anthropic(recorder).messages.create(model="policy", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    (span,) = _calls(exporter)
    assert semconv.POLICY_NAME not in span.attributes and span.attributes[semconv.MODEL_VERSION] == 9
