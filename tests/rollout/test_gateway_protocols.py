"""Every protocol through the real gateway process, driven by curl, against the session's real vLLM.

The stack is the one an agent we cannot instrument meets: ``lightspan gateway`` (its own process,
OTLP to a real collector process) in front of a recording pass-through proxy in front of vLLM
(tests/tracing/test_frameworks.py). For chat completions, completions, the Responses API and
Anthropic Messages, each streamed and not:

- the stored span's ids (and logprobs, or ``no_logprobs`` with its reason) are what vLLM put on
  the wire, read from the recording by code written apart from lightspan's parsers;
- the span has the instrumentor's attributes: rollout (from the per-rollout URL prefix), agent
  (``x-lightspan-agent``), finish reason, temperature, policy version, messages with tool calls;
- curl's answer parses as the provider's type (the ``openai`` / ``anthropic`` SDK models) and holds
  nothing the caller did not ask for; the SDK clients pointed at the gateway work, and the Anthropic
  answer greedily equals vLLM's own ``/v1/messages``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
import requests
from pydantic import TypeAdapter

from lightspan.tracing import semconv
from tests.conftest import collector_process, free_port
from tests.tracing.test_frameworks import _f32, _Recorder, vllm_returned
from tests.tracing.test_protocols import WEATHER

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

VERSION = 3
AGENT = "curl-agent"
RESPONSES_TOOL_TURN = [
    {"role": "user", "content": "Weather in Tokyo?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Tokyo"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}]
CHAT_TOOL_TURN = [
    {"role": "user", "content": "Weather in Tokyo?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
ANTHROPIC_TOOL_TURN = [
    {"role": "user", "content": "Weather in Tokyo?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {
        "type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Tokyo"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "Sunny"}]}]
TOOL_CALL = {"type": "tool_call", "id": "call_1", "name": "get_weather", "arguments": {"city": "Tokyo"}}
TOOL_RESULT = {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1", "response": "Sunny"}]}

# protocol: (path, request body, upstream path vLLM was called on)
PROTOCOLS = {
    "chat": ("/v1/chat/completions", {"messages": CHAT_TOOL_TURN, "max_tokens": 6}, "/v1/chat/completions"),
    "completions": ("/v1/completions", {"prompt": "Say hi.", "max_tokens": 6}, "/v1/completions"),
    # (as a chat completion, which has every token's logprob: tracing/protocols/responses_convert.py)
    "responses": ("/v1/responses", {"input": RESPONSES_TOOL_TURN, "max_output_tokens": 6}, "/v1/chat/completions"),
    "messages": ("/v1/messages", {"system": "Be brief.", "messages": ANTHROPIC_TOOL_TURN, "tools": WEATHER,
                                  "max_tokens": 6}, "/v1/chat/completions"),
}


@pytest.fixture(scope="module")
def stack(vllm_server, tmp_path_factory):
    """(gateway URL, data dir, collector ports, recorder): the gateway process in front of the recorder."""
    from lightspan import inference
    from lightspan.runs import wait_http

    data = tmp_path_factory.mktemp("gateway-protocols")
    (data / "policy.json").write_text(json.dumps({"version": VERSION}))
    recorder = _Recorder(vllm_server.url)
    threading.Thread(target=recorder.serve_forever, daemon=True).start()
    with collector_process(data, data / "collector.log") as (_, ports):
        port = free_port()
        log_path = data / "gateway.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lightspan.cli", "gateway", "--upstream", recorder.url, "--port", str(port),
                 "--otlp-endpoint", f"http://127.0.0.1:{ports['grpc']}", "--data-dir", str(data)],
                env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100"}, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}/health", proc, 60, log_path)
            yield url, data, ports, recorder
        finally:
            inference.stop(proc)
            recorder.shutdown()
            recorder.server_close()


def curl(url: str, body: dict, *headers: str) -> tuple[int, str, bytes]:
    """(status, content type, body) of ``curl -X POST`` with a JSON body (``-N``: a stream unbuffered)."""
    args = ["curl", "-sS", "-N", "-o", "-", "-w", "\n%{http_code} %{content_type}", "-H",
            "Content-Type: application/json", "--data-binary", "@-", *[a for h in headers for a in ("-H", h)], url]
    run = subprocess.run(args, input=json.dumps(body).encode(), capture_output=True, timeout=120, check=True)
    out, _, tail = run.stdout.rpartition(b"\n")
    status, _, ctype = tail.decode().partition(" ")
    return int(status), ctype, out


def sse(body: bytes) -> list[tuple[str | None, dict | str]]:
    """(event name, data) of each server-sent event (data decoded when it is JSON)."""
    events = []
    for block in body.decode().split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
        if data is not None:
            events.append((name, data if data == "[DONE]" else json.loads(data)))
    return events


def exchanges(recorder, n: int) -> list:
    """The recorder's exchanges once it holds ``n`` (it keeps one just after relaying the answer)."""
    deadline = time.monotonic() + 30
    while True:
        with recorder.lock:
            if len(recorder.exchanges) >= n or time.monotonic() > deadline:
                return list(recorder.exchanges)
        time.sleep(0.01)


def stored(data, ports, rollout: str, n: int = 1) -> list[dict]:
    """The collector's span rows of ``rollout`` once ``n`` are stored (flushed on each poll)."""
    from lightspan import store

    deadline = time.monotonic() + 60
    while True:
        requests.post(f"http://127.0.0.1:{ports['api']}/v1/flush", timeout=60).raise_for_status()
        con = store.connect(data)
        try:
            cur = con.execute("SELECT * FROM spans WHERE rollout_id = ?", [rollout])
            rows = [dict(zip([d[0] for d in cur.description], r)) for r in cur.fetchall()]
        finally:
            con.close()
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def completions_returned(exchange) -> tuple:
    """(prompt ids, completion ids, logprobs) of a recorded completions answer (choice 0)."""
    _, _, ctype, body = exchange
    events = ([e for _, e in sse(body) if e != "[DONE]"] if ctype.startswith("text/event-stream")
              else [json.loads(body)])
    prompt, ids, logprobs = None, [], []
    for event in events:
        for choice in event["choices"]:
            prompt = prompt or choice.get("prompt_token_ids")
            ids += choice.get("token_ids") or []
            logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
    return tuple(prompt), tuple(ids), tuple(_f32(logprobs))


def validate(protocol: str, stream: bool, ctype: str, body: bytes):
    """curl's answer as the provider's SDK types; asserts it holds nothing the caller did not ask for."""
    import anthropic
    import openai.types as o
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.responses import Response, ResponseStreamEvent

    if not stream:
        assert ctype.startswith("application/json")
        doc = json.loads(body)
        if protocol == "chat":
            ChatCompletion.model_validate(doc)
            assert doc["prompt_token_ids"] is None and doc["choices"][0]["token_ids"] is None
            assert doc["choices"][0]["logprobs"] is None
        elif protocol == "completions":
            o.Completion.model_validate(doc)
            assert doc["choices"][0]["token_ids"] is None and doc["choices"][0]["logprobs"] is None
        elif protocol == "responses":
            response = Response.model_validate(doc)
            assert doc["input_messages"] is None and doc["output_messages"] is None
            assert all(p.logprobs is None for item in response.output if item.type == "message" for p in item.content)
        else:
            message = anthropic.types.Message.model_validate(doc)
            assert message.type == "message" and not message.model_extra
        return doc
    assert ctype.startswith("text/event-stream")
    events = sse(body)
    if protocol in ("chat", "completions"):
        assert events[-1] == (None, "[DONE]")
        kind = ChatCompletionChunk if protocol == "chat" else o.Completion
        for _, chunk in events[:-1]:
            # (the SDK builds stream chunks without validating them: its Completion type has no null
            # finish_reason, which every chunk but the last carries)
            kind.model_validate({**chunk, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"}
                                                      for c in chunk["choices"]]} if kind is o.Completion else chunk)
            assert all(c.get("token_ids") is None and c.get("logprobs") is None for c in chunk["choices"])
            assert chunk.get("prompt_token_ids") is None
    elif protocol == "responses":
        adapter = TypeAdapter(ResponseStreamEvent)
        for name, event in events:
            assert adapter.validate_python(event).type == name
            assert not event.get("logprobs")
        assert events[-1][1]["response"]["output_messages"] is None
    else:
        adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
        for name, event in events:
            assert adapter.validate_python(event).type == name
        assert [n for n, _ in events][:1] == ["message_start"] and events[-1][0] == "message_stop"
    return events


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_curl_through_the_gateway_stores_what_vllm_returned(stack, protocol, stream):
    url, data, ports, recorder = stack
    path, body, upstream = PROTOCOLS[protocol]
    rollout = f"curl-{protocol}-{stream}-{uuid.uuid4().hex[:6]}"
    recorder.clear()
    headers = [f"x-lightspan-agent: {AGENT}"]
    if protocol == "messages":
        headers += ["x-api-key: k", "anthropic-version: 2023-06-01"]
    status, ctype, answer = curl(f"{url}/rollouts/{rollout}{path}", {"model": "policy", "temperature": 0.5,
                                                                     "stream": stream, **body}, *headers)
    assert status == 200, answer[:500]
    validate(protocol, stream, ctype, answer)

    (exchange,) = exchanges(recorder, 1)
    assert exchange[0] == upstream
    returned = {"completions": completions_returned}.get(protocol, vllm_returned)(exchange)
    (row,) = stored(data, ports, rollout)
    ids = (tuple(row["prompt_token_ids"]), tuple(row["completion_token_ids"]))
    assert ids == returned[:2] and all(returned[:2])
    assert row["capture_status"] == "ok"
    assert tuple(_f32(row["completion_logprobs"])) == returned[2] and len(returned[2]) == len(returned[1])
    assert (row["agent_name"], row["model_version"], row["temperature"]) == (AGENT, VERSION, 0.5)
    assert row["operation_name"] == ("text_completion" if protocol == "completions" else "chat")
    assert row["scope_name"] == "lightspan.gateway" and row["finish_reasons"]
    system = json.loads(row["attributes"][semconv.GEN_AI_SYSTEM])
    assert system == ("anthropic" if protocol == "messages" else "openai")
    inputs, outputs = json.loads(row["input_messages"]), json.loads(row["output_messages"])
    assert outputs[-1]["role"] == "assistant" and outputs[-1]["finish_reason"]
    if protocol != "completions":   # the tool turn, in the instrumentor's shape
        assert inputs[-2]["parts"][-1] == TOOL_CALL and inputs[-1] == TOOL_RESULT, inputs


def test_the_anthropic_client_gets_vllms_own_messages_answer(stack, vllm_server):
    """Greedy, the anthropic SDK pointed at the gateway gets what vLLM's /v1/messages answers (ids
    aside), streamed too; its errors are Anthropic's."""
    import anthropic

    url, data, ports, _ = stack
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    direct = requests.post(f"{vllm_server.url}/v1/messages", json={**body, "temperature": 0}, timeout=120).json()
    client = anthropic.Anthropic(base_url=f"{url}/rollouts/sdk-anthropic", api_key="k")
    message = client.messages.create(**body, extra_body={"temperature": 0})
    expected = anthropic.types.Message.model_validate(direct).model_dump(exclude={"id"})
    # but for the cache counts Anthropic's API always sends (0 here), which vLLM's route leaves out
    assert expected["usage"]["cache_read_input_tokens"] is None and message.usage.cache_read_input_tokens == 0
    expected["usage"].update(cache_read_input_tokens=0, cache_creation_input_tokens=0)
    assert message.model_dump(exclude={"id"}) == expected
    with client.messages.stream(**body, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text and final.stop_reason == message.stop_reason
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in message.content]
    assert [r["capture_status"] for r in stored(data, ports, "sdk-anthropic", 2)] == ["ok", "ok"]
    # count_tokens passes through (untraced): the prompt's size as vLLM tokenises it
    counted = client.messages.count_tokens(model="policy", messages=body["messages"])
    own = requests.post(f"{vllm_server.url}/v1/messages/count_tokens", timeout=60,
                        json={"model": "policy", "messages": body["messages"]}).json()
    assert counted.input_tokens == own["input_tokens"] > 0
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(**{**body, "model": "no-such-model"})
    assert err.value.body["type"] == "error" and "no-such-model" in err.value.body["error"]["message"]


def test_the_openai_client_speaks_responses_through_the_gateway(stack):
    from openai import OpenAI

    url, data, ports, _ = stack
    client = OpenAI(base_url=f"{url}/rollouts/sdk-responses/v1", api_key="k")
    response = client.responses.create(model="policy", input="Say hi.", max_output_tokens=6)
    assert response.status == "incomplete" and response.model_extra["output_messages"] is None
    with client.responses.stream(model="policy", input="Say hi.", max_output_tokens=6) as stream:
        events = list(stream)
        final = stream.get_final_response()
    # (vLLM's stream ends with response.completed where its answer says incomplete)
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert final.model_extra["input_messages"] is None and final.model_extra["output_messages"] is None
    rows = stored(data, ports, "sdk-responses", 2)
    assert [r["capture_status"] for r in rows] == ["ok", "ok"]
    assert all(len(r["completion_token_ids"]) == len(r["completion_logprobs"]) > 0 for r in rows)


def test_a_request_the_conversion_cannot_reproduce_goes_to_vllms_messages_route(stack):
    url, data, ports, recorder = stack
    recorder.clear()
    status, _, answer = curl(f"{url}/rollouts/inline-system/v1/messages", {
        "model": "policy", "max_tokens": 4, "messages": [{"role": "system", "content": "inline"},
                                                         {"role": "user", "content": "hi"}]})
    assert status == 200 and json.loads(answer)["type"] == "message"
    ((path, sent, _, _),) = exchanges(recorder, 1)
    assert path == "/v1/messages" and "return_token_ids" not in sent
    (row,) = stored(data, ports, "inline-system")
    assert row["capture_status"] == "unsupported_request"
    assert "role 'system'" in json.loads(row["attributes"][semconv.CAPTURE_REASON])


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
def test_a_responses_request_the_conversion_cannot_reproduce_goes_to_vllms_responses_route(stack, stream):
    """A Responses request that asks for the output text's logprobs itself (only vLLM's Responses
    route writes them) goes there, with ``enable_response_messages``; the caller gets the logprobs
    it asked for and not the ids; the span has vLLM's ids, and ``no_logprobs`` where vLLM gave no
    logprob for a token (a stream's end of turn)."""
    from tests.tracing.test_protocols import responses_returned

    url, data, ports, recorder = stack
    recorder.clear()
    rollout = f"responses-native-{stream}-{uuid.uuid4().hex[:6]}"
    status, ctype, answer = curl(f"{url}/rollouts/{rollout}/v1/responses", {
        "model": "policy", "input": "Say hi.", "max_output_tokens": 6, "stream": stream,
        "temperature": 0, "include": ["message.output_text.logprobs"]})   # greedy: never an empty answer
    assert status == 200, answer[:500]
    ((path, sent, _, _),) = exchanges(recorder, 1)
    assert path == "/v1/responses" and sent["enable_response_messages"] is True
    if stream:
        response = [e for _, e in sse(answer) if e["type"] == "response.completed"][-1]["response"]
    else:
        response = json.loads(answer)
    assert response["input_messages"] is None and response["output_messages"] is None
    assert response["output"][0]["content"][0]["logprobs"]   # asked for: the caller's
    prompt, completion, logprobs = responses_returned(exchanges(recorder, 1)[0])
    (row,) = stored(data, ports, rollout)
    assert (tuple(row["prompt_token_ids"]), tuple(row["completion_token_ids"])) == (prompt, completion)
    assert row["capture_status"] == ("ok" if len(logprobs) == len(completion) else "no_logprobs")


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
@pytest.mark.parametrize("protocol", ["chat", "completions", "responses", "messages"])
def test_the_sdk_client_sees_through_the_gateway_what_it_sees_from_vllm(stack, vllm_server, monkeypatch, protocol,
                                                                        stream):
    """Greedy, the provider's SDK objects (tests/tracing/agent_view.py) of a call through the gateway
    equal those of the same call straight to vLLM, ids aside: nothing the gateway asked for (ids,
    logprobs, the chunks vLLM sends only for them) reaches the caller but as vLLM's own ``null``."""
    import anthropic
    from openai import OpenAI

    from tests.tracing.agent_view import aside, call

    url, data, ports, _ = stack
    monkeypatch.setenv("LIGHTSPAN_CAPTURE_URLS", "http://127.0.0.1:9")   # this process captures nothing itself
    rollout = f"view-{protocol}-{stream}-{uuid.uuid4().hex[:6]}"

    def client(base: str):
        return anthropic.Anthropic(base_url=base, api_key="k") if protocol == "messages" else OpenAI(
            base_url=f"{base}/v1", api_key="k")

    plain = call(client(vllm_server.url), protocol, stream)
    seen = call(client(f"{url}/rollouts/{rollout}"), protocol, stream)
    assert aside(seen, protocol) == aside(plain, protocol)
    (row,) = stored(data, ports, rollout)
    assert row["capture_status"] == "ok"
