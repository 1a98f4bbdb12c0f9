"""Real agent frameworks, run unchanged under ``opentelemetry-instrument`` by ``lightspan rollout``,
against the session's real vLLM, exporting to a real lightspan collector.

Ground truth is what vLLM put on the wire: the agents' base URL is a recording pass-through proxy
on loopback in front of vLLM (it forwards every request unchanged and keeps a copy of each
response, streams included). It is not a fake: every token comes from vLLM, and the proxy is the
only place where what vLLM returned can be seen independently of the frameworks, which hide the
raw response. For each framework the test asserts that

- every call's prompt ids, completion ids and logprobs on the stored spans are exactly vLLM's;
- each call produced exactly one usable LLM span (and one transition: no call trained twice);
- a rollout's calls all carry that rollout's id, the one the runner gave it.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
from array import array
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from lightspan.tracing import semconv
from tests.conftest import collector_process

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 2  # two rollouts of one task, run at once: the smallest GRPO group


class _Recorder(ThreadingHTTPServer):
    """A pass-through HTTP proxy to ``upstream`` that keeps (path, request, response) of each POST."""

    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _Relay)
        self.upstream = urlsplit(upstream)
        self.exchanges: list[tuple[str, dict, str, bytes]] = []  # path, request, content type, body
        self.lock = threading.Condition()
        self.relaying = 0   # POSTs being relayed: each is kept only after its answer went out

    def clear(self, timeout_s: float = 30.0) -> None:
        """Forget every exchange, once the POSTs being relayed are kept: a test's last exchange is
        appended after its client had the answer, so clearing sooner could leave it to the next test."""
        with self.lock:
            if not self.lock.wait_for(lambda: self.relaying == 0, timeout_s):
                raise TimeoutError(f"{self.relaying} requests still being relayed after {timeout_s} s")
            self.exchanges.clear()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Relay(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client expects

    def log_message(self, *args):  # quiet
        pass

    def _forward(self, method: str):
        server: _Recorder = self.server
        if method != "POST":
            return self._relay(server, method, b"")
        with server.lock:
            server.relaying += 1
        try:
            self._relay(server, method, self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        finally:
            with server.lock:
                server.relaying -= 1
                server.lock.notify_all()

    def _relay(self, server: _Recorder, method: str, body: bytes):
        upstream = http.client.HTTPConnection(server.upstream.hostname, server.upstream.port, timeout=120)
        upstream.request(method, self.path, body or None, {"Content-Type": self.headers.get("Content-Type", "")})
        resp = upstream.getresponse()
        ctype = resp.getheader("Content-Type", "")
        self.send_response(resp.status)
        self.send_header("Content-Type", ctype)
        received = b""
        if ctype.startswith("text/event-stream"):  # relayed chunk by chunk, as vLLM sends it
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := resp.read1(65536):
                received += chunk
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        else:
            received = resp.read()
            self.send_header("Content-Length", str(len(received)))
            self.end_headers()
            self.wfile.write(received)
        upstream.close()
        if method == "POST":
            with server.lock:
                server.exchanges.append((self.path, json.loads(body or b"{}"), ctype, received))

    def do_POST(self):
        self._forward("POST")

    def do_GET(self):
        self._forward("GET")


def _f32(values) -> list[float]:
    """Floats as float32, as the span stores logprobs."""
    return array("f", values).tolist()


def vllm_returned(exchange) -> tuple:
    """(prompt ids, completion ids, logprobs) of choice 0 of one recorded chat completion, read
    from vLLM's JSON body or from its SSE chunks in order: written independently of lightspan's
    own parser, so that a bug there cannot cancel out."""
    _, _, ctype, body = exchange
    if ctype.startswith("text/event-stream"):
        events = [json.loads(line[len(b"data: "):]) for line in body.splitlines()
                  if line.startswith(b"data: ") and line != b"data: [DONE]"]
    else:
        events = [json.loads(body)]
    prompt, ids, logprobs = None, [], []
    for event in events:
        prompt = prompt or event.get("prompt_token_ids")
        for choice in event.get("choices") or ():
            assert choice.get("index", 0) == 0
            ids += choice.get("token_ids") or []
            logprobs += [t["logprob"] for t in ((choice.get("logprobs") or {}).get("content") or ())]
    assert prompt and ids and len(ids) == len(logprobs), exchange
    return tuple(prompt), tuple(ids), tuple(_f32(logprobs))


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    """One real lightspan collector (OTLP gRPC → WAL → Parquet) for the whole module."""
    data = tmp_path_factory.mktemp("frameworks-data")
    with collector_process(data, data / "collector.log") as running:
        yield running


# (name, agent script, module it needs, LLM calls per rollout, instrumentations switched off)
FRAMEWORKS = [
    ("openai_sdk", "examples/openai_sdk_agent.py", None, 4, ""),
    ("langchain", "examples/frameworks/langchain_agent.py", "langchain_openai", 4, ""),
    # without traceloop's LangChain instrumentation (when installed): the client's span alone
    ("langchain_client_spans", "examples/frameworks/langchain_agent.py", "langchain_openai", 4, "langchain"),
    ("openai_agents", "examples/frameworks/openai_agents_agent.py", "agents", 2, ""),
    ("litellm", "examples/frameworks/litellm_agent.py", "litellm", 4, ""),
]


@pytest.mark.parametrize("name,script,module,calls,disabled", FRAMEWORKS, ids=[f[0] for f in FRAMEWORKS])
def test_framework_agent_is_captured(name, script, module, calls, disabled, collector, recorder, vllm_server,
                                     tmp_path):
    from lightspan import store
    from lightspan.lightningrl.builder import build_transitions
    from lightspan.lightningrl.config import TransitionsConfig

    if module:
        pytest.importorskip(module)
    data, ports = collector
    task_id = f"{name}-add"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": task_id, "prompt": "What is 2 + 3?", "answer": "5", "max_tokens": 6,
                                 "temperature": 0.8}) + "\n")
    env = {**os.environ, "AGENT_MODEL": vllm_server.model_name, "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": disabled,
           "OTEL_BSP_SCHEDULE_DELAY": "200"}
    recorder.clear()
    run = subprocess.run(
        [sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(tasks), "--samples", str(SAMPLES),
         "--concurrency", str(SAMPLES), "--timeout-s", "240", "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}",
         "--openai-base-url", f"{recorder.url}/v1", "--data-dir", str(data), "--logs-dir", str(tmp_path),
         "--", sys.executable, str(ROOT / script)],
        env=env, text=True, capture_output=True, timeout=600, check=False)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("*.log"))
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    assert outcome["ok"] == SAMPLES, (outcome, logs)
    requests.post(f"http://127.0.0.1:{ports['api']}/v1/flush", timeout=60).raise_for_status()

    # what vLLM returned: every call went through the recorder, asked for token ids by the
    # instrumentor (the agents themselves never ask)
    with recorder.lock:
        exchanges = list(recorder.exchanges)
    assert [path for path, *_ in exchanges] == ["/v1/chat/completions"] * (SAMPLES * calls), logs
    assert all(request.get("return_token_ids") is True for _, request, *_ in exchanges)
    expected = Counter(vllm_returned(e) for e in exchanges)

    con = store.connect(data)
    rollout_ids = {r for (r,) in con.execute(
        "SELECT rollout_id FROM spans WHERE name = ? AND task_id = ?", [semconv.SPAN_RUNNER, task_id]).fetchall()}
    assert len(rollout_ids) == SAMPLES
    rows = con.execute("""
        SELECT rollout_id, capture_status, scope_name, prompt_token_ids, completion_token_ids,
               completion_logprobs, num_choices
        FROM llm_calls WHERE task_id = ?""", [task_id]).fetchall()
    # exactly one LLM call span per call, each usable: none left without ids beside the one with them
    assert [r[1] for r in rows] == ["ok"] * len(rows), [(r[1], r[2]) for r in rows]
    assert len(rows) == SAMPLES * calls, [(r[1], r[2]) for r in rows]
    assert all(r[6] == 1 for r in rows)
    # the stored ids and logprobs are exactly vLLM's
    stored = Counter((tuple(r[3]), tuple(r[4]), tuple(_f32(r[5]))) for r in rows)
    assert stored == expected
    # a rollout's calls share its one rollout id
    assert Counter(r[0] for r in rows) == {rid: calls for rid in rollout_ids}
    scopes = {r[2] for r in rows}
    if name == "litellm":
        # LiteLLM posts through the openai client, bypassing chat.completions.create: the OpenAI
        # instrumentation sees nothing, and lightspan's instrumentor opens the GenAI span itself
        assert scopes == {"lightspan.instrumentor"}
    else:  # the ids went on the instrumentation's span; lightspan opened none of its own
        assert "lightspan.instrumentor" not in scopes, scopes

    # what would be trained: one transition per call, with vLLM's tokens, none twice
    table, metrics = build_transitions(con, TransitionsConfig(data_dir=str(data), incremental=False))
    ours = [t for t in table.to_pylist() if t["rollout_id"] in rollout_ids]
    assert Counter(t["rollout_id"] for t in ours) == {rid: calls for rid in rollout_ids}, metrics
    assert Counter((tuple(t["prompt_token_ids"]), tuple(t["completion_token_ids"]),
                    tuple(_f32(t["completion_logprobs"]))) for t in ours) == expected
    con.close()


# --- the two instrumentor paths the frameworks need, on a mocked transport -------------------
# (loopback URL, so capture applies; a provider of its own, and traceloop's OpenAI instrumentation,
# if another module installed it, kept out through its suppression key)

def _completion_body():
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "policy", "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"},
                         "token_ids": [5, 6], "logprobs": {"content": [
                             {"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": []},
                             {"token": "i", "logprob": -0.25, "bytes": [105], "top_logprobs": []}]}}]}


def _chunks():
    first = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "policy", "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None, "token_ids": None}]}
    token = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "policy", "prompt_token_ids": None,
             "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop", "token_ids": [7],
                          "logprobs": {"content": [{"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": []}]}}]}
    return [first, token]


def _transport(httpx, sent):
    def handler(request):
        body = json.loads(request.content)
        sent.append(body)
        if body.get("stream"):
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in _chunks()) + "data: [DONE]\n\n"
            return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=_completion_body())
    return httpx.MockTransport(handler)


@pytest.fixture()
def mocked():
    """(sync client, async client, tracer, exporter, bodies sent) with only lightspan's instrumentor."""
    import httpx2 as httpx  # the HTTP client openai 3.x is built on
    from openai import AsyncOpenAI, OpenAI
    from opentelemetry import context, trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from lightspan.tracing.instrumentor import LightspanInstrumentor

    exporter, provider, sent = InMemorySpanExporter(), TracerProvider(), []
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    LightspanInstrumentor().instrument(tracer_provider=provider)
    previous, trace._TRACER_PROVIDER = trace._TRACER_PROVIDER, provider  # the global one cannot be reset
    token = context.attach(context.set_value("suppress_language_model_instrumentation", True))
    try:
        url = "http://127.0.0.1:9/v1"
        yield (OpenAI(base_url=url, api_key="x", http_client=httpx.Client(transport=_transport(httpx, sent))),
               AsyncOpenAI(base_url=url, api_key="x", http_client=httpx.AsyncClient(transport=_transport(httpx, sent))),
               provider.get_tracer("framework"), exporter, sent)
    finally:
        context.detach(token)
        trace._TRACER_PROVIDER = previous
        LightspanInstrumentor().uninstrument()


def _ids(span):
    a = span.attributes
    return (a.get(semconv.CAPTURE_STATUS), semconv.decode_ids(a.get(semconv.PROMPT_TOKEN_IDS, b"")),
            [semconv.decode_ids(b) for b in a.get(semconv.COMPLETION_TOKEN_IDS, ())])


def test_raw_responses_are_captured_and_parse_to_the_same_object(mocked):
    """``with_raw_response`` (LangChain's ``ChatOpenAI``) returns a raw response; lightspan parses it
    through its cache, so the caller's own ``parse()`` gets the very object (or stream) it read."""
    import asyncio

    client, aclient, _, exporter, sent = mocked
    messages = [{"role": "user", "content": "q"}]
    raw = client.chat.completions.with_raw_response.create(model="policy", messages=messages)
    assert raw.parse() is raw.parse() and raw.parse().choices[0].message.content == "hi"
    raw_stream = client.chat.completions.with_raw_response.create(model="policy", messages=messages, stream=True)
    assert [c.choices[0].delta.content for c in raw_stream.parse()] == ["", "a"]

    async def call_async():
        raw = await aclient.chat.completions.with_raw_response.create(model="policy", messages=messages, stream=True)
        return [c.choices[0].delta.content async for c in raw.parse()]

    assert asyncio.run(call_async()) == ["", "a"]
    assert all(body["return_token_ids"] is True for body in sent)
    spans = exporter.get_finished_spans()
    assert [_ids(s) for s in spans] == [("ok", [1, 2, 3], [[5, 6]]), ("ok", [1, 2], [[7]]), ("ok", [1, 2], [[7]])]


def test_framework_llm_span_that_is_not_current_gets_the_ids(mocked):
    """traceloop's LangChain instrumentation starts the call's LLM span, detaches it, and sets the
    suppression key: the ids go on that span, and lightspan opens no second one for the call."""
    client, _, tracer, exporter, _ = mocked
    framework = tracer.start_span("ChatOpenAI.chat", attributes={semconv.GEN_AI_OPERATION_NAME: "chat"})
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}], temperature=0.5)
    framework.end()
    (span,) = exporter.get_finished_spans()
    assert span.name == "ChatOpenAI.chat" and _ids(span) == ("ok", [1, 2, 3], [[5, 6]])
    assert span.attributes[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.5

    # only an open LLM span without a capture is taken: a second call under it gets a span of its own
    exporter.clear()
    holder = tracer.start_span("ChatOpenAI.chat", attributes={semconv.GEN_AI_OPERATION_NAME: "chat"})
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
    holder.end()
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
    assert sorted((s.name, _ids(s)[0]) for s in exporter.get_finished_spans()) == [
        ("ChatOpenAI.chat", "ok"), ("chat policy", "ok"), ("chat policy", "ok")]


def test_logprobs_reach_the_caller_only_when_it_asked(mocked):
    """lightspan asks vLLM for logprobs; a caller that did not gets ``logprobs: None``, as vLLM would
    have answered it (frameworks act on the field), while the span still records them."""
    client, _, _, exporter, sent = mocked
    messages = [{"role": "user", "content": "q"}]
    plain = client.chat.completions.create(model="policy", messages=messages)
    asked = client.chat.completions.create(model="policy", messages=messages, logprobs=True)
    chunks = list(client.chat.completions.create(model="policy", messages=messages, stream=True))
    assert [body["logprobs"] for body in sent] == [True, True, True]
    assert plain.choices[0].logprobs is None
    assert [t.logprob for t in asked.choices[0].logprobs.content] == [-0.5, -0.25]
    assert all(c.choices[0].logprobs is None for c in chunks)
    recorded = [[semconv.decode_floats(b) for b in s.attributes[semconv.COMPLETION_LOGPROBS]]
                for s in exporter.get_finished_spans()]
    assert recorded == [[[-0.5, -0.25]], [[-0.5, -0.25]], [[-1.0]]]
