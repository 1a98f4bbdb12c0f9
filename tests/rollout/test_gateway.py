"""The gateway in front of the session's real vLLM, called with plain HTTP as a non-Python agent would."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightspan.core.config import ConfigError
from lightspan.tracing import semconv
from lightspan.tracing.protocols.chat import Capture
from lightspan.rollout.gateway import Gateway, GatewayConfig, route

TRACE_ID, PARENT_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


# --- pure pieces --------------------------------------------------------------------------------

def test_route_reads_ids_from_the_path_prefix():
    assert route("/v1/chat/completions") == ({}, "/v1/chat/completions")
    assert route("/rollouts/r%201/tasks/t%2F7/v1/completions?x=1") == (
        {semconv.ROLLOUT_ID: "r 1", semconv.TASK_ID: "t/7"}, "/v1/completions?x=1")
    assert route("/splits/val/rollouts/r/v1/models")[0] == {semconv.SPLIT: "val", semconv.ROLLOUT_ID: "r"}
    assert route("/admin/pause") is None and route("/rollouts/r/chat/completions") is None


def test_hide_keeps_what_the_caller_asked_for():
    def payload():
        return {"prompt_token_ids": [1], "choices": [{"index": 0, "token_ids": [2], "logprobs": {"content": []}}]}

    def hidden(asked: dict, op: str) -> dict:
        cap, out = Capture.for_request(asked, op), payload()
        cap.add(out, hide=True)
        assert cap.prompt == semconv.encode_ids([1]) and cap.choices[0].ids == [2]  # read before hiding
        return out

    assert hidden({}, "chat") == {
        "prompt_token_ids": None, "choices": [{"index": 0, "token_ids": None, "logprobs": None}]}
    assert hidden({"return_token_ids": True, "logprobs": True}, "chat") == payload()
    # completions: logprobs=0 is a request for the sampled token's logprob
    kept = hidden({"logprobs": 0}, "text_completion")
    assert kept["choices"][0]["logprobs"] is not None and kept["choices"][0]["token_ids"] is None


def test_config_rejects_a_non_http_upstream():
    with pytest.raises(ConfigError, match="gateway.upstream"):
        GatewayConfig(upstream="127.0.0.1:8000")


def test_start_stop_start_again(tmp_path):
    gw = Gateway(GatewayConfig(port=0, data_dir=str(tmp_path)), TracerProvider())
    for _ in range(2):
        url = gw.start()
        assert requests.get(f"{url}/health", timeout=5).json()["status"] == "ok"
        gw.stop()
    gw.stop()  # idempotent


# --- against vLLM -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gateway(vllm_server, tmp_path_factory):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    data_dir = tmp_path_factory.mktemp("gateway")
    (data_dir / "policy.json").write_text(json.dumps({"version": 2}))
    gw = Gateway(GatewayConfig(upstream=f"{vllm_server.url}/v1", port=0, data_dir=str(data_dir)), provider)
    gw.url_ = gw.start()
    gw.exporter = exporter
    yield gw
    gw.stop()


@pytest.fixture()
def spans(gateway):
    gateway.exporter.clear()
    return gateway.exporter


def _only_span(exporter):
    (span,) = exporter.get_finished_spans()
    return span


def _ids(span):
    a = span.attributes
    return (semconv.decode_ids(a[semconv.PROMPT_TOKEN_IDS]),
            [semconv.decode_ids(b) for b in a[semconv.COMPLETION_TOKEN_IDS]])


def test_chat_span_joins_the_callers_trace_with_token_ids(gateway, spans):
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Lightspan-Rollout-Id": "r-header",
               "X-Lightspan-Task-Id": "t-1", "X-Lightspan-Agent": "planner"}
    resp = requests.post(f"{gateway.url_}/v1/chat/completions", headers=headers, timeout=60,
                         json={**CHAT, "return_token_ids": True, "logprobs": True})
    assert resp.status_code == 200
    body = resp.json()
    span = _only_span(spans)
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_ID
    a = span.attributes
    assert a[semconv.ROLLOUT_ID] == "r-header" and a[semconv.TASK_ID] == "t-1"
    assert a[semconv.GEN_AI_AGENT_NAME] == "planner"   # named by the agent's header (rollout/headers.py)
    assert a[semconv.GEN_AI_OPERATION_NAME] == "chat" and a[semconv.CAPTURE_STATUS] == "ok"
    assert a[semconv.MODEL_VERSION] == 2  # from policy.json
    # asked for, so kept in the answer: the span's ids are exactly the ones vLLM returned
    assert _ids(span) == (body["prompt_token_ids"], [body["choices"][0]["token_ids"]])
    lps = semconv.decode_floats(a[semconv.COMPLETION_LOGPROBS][0])
    assert lps == pytest.approx([t["logprob"] for t in body["choices"][0]["logprobs"]["content"]], abs=1e-6)
    assert json.loads(a[semconv.GEN_AI_INPUT_MESSAGES])[0]["parts"][0]["content"] == "hi"


def test_unasked_fields_are_stripped_and_rollout_comes_from_the_path(gateway, spans):
    resp = requests.post(f"{gateway.url_}/rollouts/r-path/tasks/t%2F2/v1/chat/completions",
                         json={**CHAT, "temperature": 0.5}, headers={"X-Lightspan-Task-Id": "t-header"}, timeout=60)
    body = resp.json()
    assert body["prompt_token_ids"] is None and body["choices"][0]["token_ids"] is None
    assert body["choices"][0]["logprobs"] is None  # as vLLM answers a request without them
    span = _only_span(spans)
    assert span.parent is None  # no traceparent: a trace of its own
    assert span.attributes[semconv.ROLLOUT_ID] == "r-path"
    assert span.attributes[semconv.TASK_ID] == "t-header"  # a header wins over the path
    prompt, (completion,) = _ids(span)
    assert prompt and len(completion) == body["usage"]["completion_tokens"]
    # vLLM's logprobs are those of the tempered distribution: the trainer reads the temperature here
    assert span.attributes[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.5


def _sse(resp):
    events = [line[len(b"data: "):] for line in resp.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streams_are_relayed_and_captured(gateway, spans):
    """Completions with n=2 as the caller sent it (ids stripped), then a chat stream whose caller
    asked for the ids: the span's ids are the ones in the chunks."""
    resp = requests.post(f"{gateway.url_}/v1/completions", stream=True, timeout=60,
                         json={"model": "policy", "prompt": "abc", "max_tokens": 3, "n": 2, "stream": True})
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    chunks = _sse(resp)
    assert all(c["choices"][0]["token_ids"] is None and c["choices"][0]["logprobs"] is None for c in chunks)
    _, completions = _ids(_only_span(spans))
    assert [len(ids) for ids in completions] == [3, 3]

    spans.clear()
    resp = requests.post(f"{gateway.url_}/v1/chat/completions", stream=True, timeout=60,
                         json={**CHAT, "stream": True, "return_token_ids": True})
    chunks = _sse(resp)
    prompt = next(c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids"))
    completion = [i for c in chunks for ch in c["choices"] for i in (ch.get("token_ids") or [])]
    assert all(ch.get("logprobs") is None for c in chunks for ch in c["choices"])  # not asked for
    span = _only_span(spans)
    assert _ids(span) == (prompt, [completion])
    assert span.attributes[semconv.CAPTURE_STATUS] == "ok"


def test_pause_refuses_with_429_until_resume(gateway, spans):
    try:
        assert requests.post(f"{gateway.url_}/admin/pause", timeout=60).json()["drained"] is True
        paused = requests.post(f"{gateway.url_}/v1/chat/completions", json=CHAT, timeout=60)
        assert paused.status_code == 429 and paused.headers["Retry-After"] == "1"
        assert "paused" in paused.json()["error"]["message"]
        # everything but generation still passes through
        assert requests.get(f"{gateway.url_}/v1/models", timeout=60).json()["data"][0]["id"] == "policy"
    finally:
        resumed = requests.post(f"{gateway.url_}/admin/resume", json={"model_version": 5}, timeout=60)
    assert resumed.json()["paused"] is False and resumed.json()["refused_paused"] >= 1
    assert requests.post(f"{gateway.url_}/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    assert _only_span(spans).attributes[semconv.MODEL_VERSION] == 5  # the version given at resume
    gateway.version.override = None


class _SlowUpstream:
    """A stand-in for vLLM whose stream sends one chunk, then waits for ``release``: a call that
    stays in flight for as long as the test wants, with no sleeps."""

    def __init__(self):
        release = self.release = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the body ends when the connection closes
                chunk = {"id": "c", "object": "chat.completion.chunk", "model": "policy", "prompt_token_ids": [1, 2],
                         "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None,
                                      "token_ids": [7], "logprobs": {"content": [{"token": "a", "logprob": -0.5}]}}]}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
                release.wait(60)
                chunk["choices"][0].update(finish_reason="stop", token_ids=[8])
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_pause_waits_for_the_calls_in_flight(tmp_path):
    upstream = _SlowUpstream()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    gw = Gateway(GatewayConfig(upstream=upstream.url, port=0, data_dir=str(tmp_path)), provider)
    url = gw.start()
    try:
        inflight = requests.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True}, stream=True, timeout=60)
        lines = inflight.iter_lines()
        assert next(lines).startswith(b"data: ")  # the call is now in flight, its upstream waiting
        not_yet = requests.post(f"{url}/admin/pause?timeout_s=0", timeout=60)
        assert not_yet.status_code == 504
        assert (not_yet.json()["drained"], not_yet.json()["in_flight"]) == (False, 1)
        assert requests.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60).status_code == 429

        seen_at_drain = {}

        def pause():  # blocks until the in-flight call has finished
            resp = requests.post(f"{url}/admin/pause", timeout=60)
            seen_at_drain.update(resp.json(), code=resp.status_code, spans=len(exporter.get_finished_spans()))

        waiter = threading.Thread(target=pause)
        waiter.start()
        upstream.release.set()
        assert b"data: [DONE]" in list(lines)
        waiter.join(60)
        assert seen_at_drain["code"] == 200 and seen_at_drain["drained"] is True
        assert seen_at_drain["spans"] == 1  # drained means: its span has ended, with its ids
        (span,) = exporter.get_finished_spans()
        assert span.attributes[semconv.CAPTURE_STATUS] == "ok"
        assert [semconv.decode_ids(b) for b in span.attributes[semconv.COMPLETION_TOKEN_IDS]] == [[7, 8]]
        assert requests.post(f"{url}/admin/resume", timeout=60).json()["paused"] is False
    finally:
        upstream.release.set()
        gw.stop()
        upstream.server.shutdown()


def test_upstream_errors_pass_through(gateway, spans):
    resp = requests.post(f"{gateway.url_}/v1/chat/completions", json={**CHAT, "model": "no-such-model"}, timeout=60)
    assert resp.status_code == 404 and "error" in resp.json()
    span = _only_span(spans)
    assert span.attributes[semconv.CAPTURE_STATUS] == "upstream_error"
    assert span.status.status_code.name == "ERROR"
    assert requests.post(f"{gateway.url_}/v1/chat/completions", data=b"{not json", timeout=60,
                         headers={"Content-Type": "application/json"}).status_code == 400
    # a body that is not declared JSON is refused before it is read (a cross-site form cannot post)
    assert requests.post(f"{gateway.url_}/v1/chat/completions", data=b"{}", timeout=60).status_code == 415
