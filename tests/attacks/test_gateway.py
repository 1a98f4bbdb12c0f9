"""Attacks on the gateway: what an agent under training (untrusted code) or a web page can send it.

Findings of the attack pass (issue "Hardening"): 1 (path escape into vLLM's dev-mode routes),
3 (cross-site admin), 4 (bodies that never arrive hold every slot), 6 (requests that got no
answer), 7 (a shared cookie jar; the admin token compared with ``!=``).
"""

from __future__ import annotations

import hmac
import json
import socket
import threading
import time

import pytest
import requests

from lightspan.core.config import ConfigError
from lightspan.rollout.gateway import GatewayConfig
from lightspan.rollout.paths import ENDPOINTS
from tests.attacks.conftest import CHAT, Upstream, port_of, raw_request, status_of

TOKEN = "gateway-admin-token"

ESCAPES = ["/v1/../sleep", "/v1/../../collective_rpc", "/v1/..", "/v1/%2e%2e/pause", "/v1/%2E%2E/%2E%2E/sleep",
           "/v1/./../resume", "/rollouts/r1/v1/../reset_prefix_cache", "/v1/chat/../../update_weights",
           "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/..%2fsleep", "/v1/%2e%2e%2fsleep",
           "/v1/models/../../is_paused", "/v1\\..\\sleep",
           # the Responses and Anthropic routes: their sub-paths are not served, nor escapes through them
           "/v1/messages/../../sleep", "/rollouts/r1/v1/responses/../../collective_rpc",
           "/v1/responses/%2e%2e/%2e%2e/pause", "/v1/messages/count_tokens/../../../reset_prefix_cache",
           "/v1/responses/resp_1/cancel", "/v1/messages/batches", "/v1/messages/count_tokens/x"]


@pytest.mark.parametrize("path", ESCAPES)
def test_a_path_never_escapes_the_table_into_vllm(gateway_factory, upstream, path):
    gw = gateway_factory(upstream)
    for method in ("GET", "POST"):
        answer = raw_request(port_of(gw), f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                              f"application/json\r\nContent-Length: 2\r\n\r\n{{}}".encode())
        assert status_of(answer) in (400, 404), answer[:300]
    assert upstream.requests == []             # nothing reached vLLM
    # the routes the table serves still pass (the recorder sees them, as sent)
    assert requests.get(f"{gw.url}/v1/models", timeout=10).status_code == 200
    assert upstream.paths() == ["/v1/models"]
    assert set(upstream.paths()) <= set(ENDPOINTS)


def test_a_body_that_never_arrives_holds_no_slot(gateway_factory, upstream):
    """Past max_in_flight stalled bodies, calls still get through and /admin/pause drains at once;
    the stalled requests are answered 408 and closed after read_timeout_s."""
    gw = gateway_factory(upstream, max_in_flight=2, read_timeout_s=1.0)
    stalled = []
    for _ in range(10):
        sock = socket.create_connection(("127.0.0.1", port_of(gw)))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"model\"")
        stalled.append(sock)
    try:
        ok = requests.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert ok.status_code == 200, ok.text
        start = time.monotonic()
        drained = requests.post(f"{gw.url}/admin/pause?timeout_s=5", timeout=10)
        assert drained.status_code == 200 and drained.json()["drained"] is True
        assert time.monotonic() - start < 2
        requests.post(f"{gw.url}/admin/resume", timeout=10)
        for sock in stalled:                       # each is answered 408, then closed
            sock.settimeout(10)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            assert status_of(answer) == 408, answer[:200]
    finally:
        for sock in stalled:
            sock.close()


def test_admin_routes_refuse_cross_site_use(gateway_factory, upstream):
    gw = gateway_factory(upstream)
    port = port_of(gw)
    rebinding = requests.post(f"{gw.url}/admin/pause?timeout_s=0", headers={"Host": f"attacker.example:{port}"},
                              timeout=10)
    assert rebinding.status_code == 403
    cross_site = requests.post(f"{gw.url}/admin/resume", data=json.dumps({"model_version": 999}), timeout=10,
                               headers={"Origin": "http://attacker.example", "Content-Type": "text/plain"})
    assert cross_site.status_code == 403
    form = requests.post(f"{gw.url}/admin/resume", data=json.dumps({"model_version": 999}), timeout=10,
                         headers={"Content-Type": "text/plain"})    # a simple request, no Origin (old browsers)
    assert form.status_code == 415
    assert gw.version.get() != 999 and gw.status()["paused"] is False
    chat = requests.post(f"{gw.url}/v1/chat/completions", data=json.dumps(CHAT), timeout=10,
                         headers={"Origin": "http://attacker.example", "Content-Type": "text/plain"})
    assert chat.status_code == 403 and upstream.requests == []
    # the gateway's own origin and configured names pass
    same = requests.post(f"{gw.url}/admin/resume", json={"model_version": 4}, timeout=10,
                         headers={"Origin": gw.url})
    assert same.status_code == 200 and gw.version.get() == 4
    named = gateway_factory(upstream, allowed_hosts=("gateway.internal",))
    assert requests.get(f"{named.url}/admin/status", headers={"Host": "gateway.internal:8100"},
                        timeout=10).status_code == 200


def test_the_admin_token_is_compared_in_constant_time(gateway_factory, upstream, monkeypatch):
    seen = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))
    gw = gateway_factory(upstream, admin_token=TOKEN)
    assert requests.get(f"{gw.url}/admin/status", headers={"Authorization": "Bearer nope"},
                        timeout=10).status_code == 401
    assert requests.get(f"{gw.url}/admin/status", headers={"Authorization": f"Bearer {TOKEN}"},
                        timeout=10).status_code == 200
    assert (b"nope", TOKEN.encode()) in seen and (TOKEN.encode(), TOKEN.encode()) in seen


def test_an_upstream_cookie_never_reaches_another_caller(gateway_factory):
    cookie_upstream = Upstream(set_cookie="session=victim-secret; Path=/")
    try:
        gw = gateway_factory(cookie_upstream)
        first = requests.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=10)
        second = requests.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=10)
        models = requests.get(f"{gw.url}/v1/models", timeout=10)
        assert first.status_code == second.status_code == models.status_code == 200
        assert all("set-cookie" not in r.headers for r in (first, second, models))
        assert [h.get("cookie") for _, _, h in cookie_upstream.requests] == [None, None, None]
    finally:
        cookie_upstream.close()


@pytest.mark.parametrize("body", [
    {**CHAT, "messages": "not a list"},
    {**CHAT, "messages": [1, "two", None, {"content": {"a": 1}}, {"role": "user", "content": [3, {"type": "x"}]}]},
    {**CHAT, "messages": [{"role": "assistant", "tool_calls": "x"}, {"tool_calls": [1, {"function": "f"}]}]},
    {**CHAT, "messages": None},
])
def test_malformed_messages_get_an_answer(gateway_factory, upstream, body):
    gw = gateway_factory(upstream)
    answer = requests.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10)
    assert answer.status_code == 200                           # vLLM's to judge; the gateway relays
    (span,) = gw.exporter.get_finished_spans()
    assert span.attributes["lightspan.capture.status"] == "ok"


@pytest.mark.parametrize("path, body, content_type", [
    ("/admin/pause?timeout_s=abc", b"", None),
    ("/admin/pause?timeout_s=nan", b"", None),
    ("/admin/pause?timeout_s=-1", b"", None),
    ("/admin/resume", b'{"model_version": 1e309}', "application/json"),
    ("/admin/resume", b'{"model_version": "3"}', "application/json"),
    ("/admin/resume", b'{"model_version": 1.5}', "application/json"),
    ("/admin/resume", b'[1]', "application/json"),
    ("/admin/resume", b'{"model_version": NaN}', "application/json"),
    ("/v1/chat/completions", b'{"model": "\\ud800", "messages": []}', "application/json"),
    ("/v1/chat/completions", b'null', "application/json"),
    ("/v1/chat/completions", b'\xff\xfe', "application/json"),
])
def test_bad_admin_and_call_bodies_are_refused_with_400(gateway_factory, upstream, path, body, content_type):
    gw = gateway_factory(upstream)
    headers = {"Content-Type": content_type} if content_type else {}
    answer = requests.post(f"{gw.url}{path}", data=body, headers=headers, timeout=10)
    assert answer.status_code == 400 and answer.json()["error"]["message"], answer.text
    assert gw.status()["paused"] is False and gw.version.override is None and upstream.requests == []


def test_a_non_loopback_bind_without_an_admin_token_refuses_to_start():
    with pytest.raises(ConfigError) as info:
        GatewayConfig(host="0.0.0.0")
    assert info.value.field == "gateway.admin_token" and "allow_no_admin_token" in str(info.value)
    assert GatewayConfig(host="0.0.0.0", admin_token=TOKEN).host == "0.0.0.0"
    assert GatewayConfig(host="0.0.0.0", allow_no_admin_token=True).allow_no_admin_token


def test_connections_past_the_cap_are_refused_and_the_gateway_recovers(gateway_factory, upstream):
    gw = gateway_factory(upstream, max_connections=4, read_timeout_s=2.0)
    idle = [socket.create_connection(("127.0.0.1", port_of(gw))) for _ in range(4)]   # accepted in order
    try:
        refused = requests.get(f"{gw.url}/health", timeout=10)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 5       # the server notices the closed connections
    while requests.get(f"{gw.url}/health", timeout=10).status_code != 200 and time.monotonic() < deadline:
        pass
    assert requests.get(f"{gw.url}/health", timeout=10).status_code == 200


def test_stalled_streams_do_not_block_others(gateway_factory, upstream):
    """Streams to clients that stopped reading each hold their own connection only."""
    gw = gateway_factory(upstream)
    results = []

    def call():
        results.append(requests.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True},
                                     timeout=10).status_code)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert results == [200] * 8


ANTHROPIC = {"model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path", ["/v1/responses", "/rollouts/r1/v1/messages"])
def test_the_responses_and_messages_routes_refuse_bad_bodies_in_their_own_shape(gateway_factory, upstream, path):
    """Malformed JSON, a body that is not an object, one past max_body_bytes, one not declared JSON:
    refused before anything reaches vLLM, as OpenAI's error for /v1/responses and as Anthropic's
    (``{"type": "error", "error": {"type", "message"}}``) for /v1/messages."""
    gw = gateway_factory(upstream, max_body_bytes=1024)
    anthropic = path.endswith("/messages")
    cases = [(b'{"model": ', "application/json", 400, "invalid_request_error"),
             (b"[1, 2]", "application/json", 400, "invalid_request_error"),
             (json.dumps({**ANTHROPIC, "pad": "x" * 2048}).encode(), "application/json", 413, "request_too_large"),
             (json.dumps(ANTHROPIC).encode(), "text/plain", 415, "invalid_request_error")]
    for body, content_type, status, kind in cases:
        answer = requests.post(f"{gw.url}{path}", data=body, headers={"Content-Type": content_type}, timeout=10)
        assert answer.status_code == status, answer.text
        doc = answer.json()
        if anthropic:
            assert doc["type"] == "error" and doc["error"]["type"] == kind and doc["error"]["message"], doc
        else:
            assert doc["error"]["code"] == status and doc["error"]["message"], doc
    assert upstream.requests == []


def test_the_anthropic_client_reads_the_gateways_refusals(gateway_factory, upstream):
    import anthropic

    gw = gateway_factory(upstream, max_body_bytes=1024)
    client = anthropic.Anthropic(base_url=gw.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as err:
        client.messages.create(**{**ANTHROPIC, "messages": [{"role": "user", "content": "x" * 4096}]})
    assert err.value.status_code == 413 and err.value.body["error"]["type"] == "request_too_large"
    gw.admission.pause(0)
    try:
        with pytest.raises(anthropic.RateLimitError) as err:
            client.messages.create(**ANTHROPIC)
        assert err.value.body["error"]["type"] == "rate_limit_error"
    finally:
        gw.admission.resume()
    assert upstream.requests == []


def test_an_anthropic_call_reaches_only_chat_completions_with_its_key_as_a_bearer(gateway_factory, upstream):
    gw = gateway_factory(upstream)
    answer = requests.post(f"{gw.url}/v1/messages", json=ANTHROPIC, timeout=10,
                           headers={"x-api-key": "k-1", "anthropic-version": "2023-06-01"})
    assert answer.status_code == 200 and answer.json()["type"] == "message", answer.text
    ((method, path, headers),) = upstream.requests
    assert (method, path, headers["authorization"]) == ("POST", "/v1/chat/completions", "Bearer k-1")
    (span,) = gw.exporter.get_finished_spans()
    assert span.attributes["lightspan.capture.status"] == "ok"


@pytest.mark.parametrize("body", [
    {**ANTHROPIC, "system": ["not a block"]},
    {**ANTHROPIC, "tool_choice": "auto"},
    {**ANTHROPIC, "tools": [5]},
    {**ANTHROPIC, "messages": "hi"},
])
def test_a_malformed_anthropic_body_goes_to_vllm_as_it_is(gateway_factory, upstream, body):
    """What the conversion cannot read, vLLM's own /v1/messages judges (it refuses it with its 400)."""
    gw = gateway_factory(upstream)
    answer = requests.post(f"{gw.url}/v1/messages", json=body, timeout=10)
    assert answer.status_code == 200 and upstream.paths() == ["/v1/messages"]
    (span,) = gw.exporter.get_finished_spans()
    assert span.attributes["lightspan.capture.status"] == "unsupported_request"


RESPONSES = {"model": "policy", "input": "hi"}
WRONG_TYPES = [  # (path, body, the field the gateway reads with the wrong type)
    ("/v1/responses", {**RESPONSES, "include": 5}, "include"),
    ("/v1/responses", {**RESPONSES, "include": "message.output_text.logprobs"}, "include"),
    ("/v1/responses", {**RESPONSES, "include": [1]}, "include"),
    ("/v1/responses", {**RESPONSES, "background": "yes"}, "background"),
    ("/v1/responses", {**RESPONSES, "enable_response_messages": {}}, "enable_response_messages"),
    ("/v1/responses", {**RESPONSES, "stream": "true"}, "stream"),
    ("/v1/responses", {**RESPONSES, "top_p": "x"}, "top_p"),            # echoed in the Response as a number
    ("/v1/responses", {**RESPONSES, "presence_penalty": [1]}, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "stream": 1}, "stream"),
    ("/v1/chat/completions", {**CHAT, "model": {"name": "policy"}}, "model"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "return_token_ids": [True]}, "return_token_ids"),
    ("/v1/chat/completions", {**CHAT, "temperature": "0.7"}, "temperature"),
    ("/v1/completions", {"model": "policy", "prompt": "hi", "logprobs": True}, "logprobs"),
    ("/v1/messages", {**ANTHROPIC, "stream": "yes"}, "stream"),
    ("/v1/messages", {**ANTHROPIC, "model": 5}, "model"),
]


@pytest.mark.parametrize("path,body,param", WRONG_TYPES)
def test_a_field_of_the_wrong_type_is_a_400_in_the_protocols_shape(gateway_factory, upstream, path, body, param):
    """``include: 5`` on /v1/responses was a 500 ``internal error: TypeError``: a field the gateway
    reads itself, of the wrong JSON type, is the caller's error, in OpenAI's shape (with ``param``)
    or Anthropic's, and never reaches vLLM."""
    gw = gateway_factory(upstream)
    answer = requests.post(f"{gw.url}{path}", json=body, timeout=10)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and f"'{param}'" in error["message"], error
    if path == "/v1/messages":
        assert answer.json()["type"] == "error"
    else:
        assert error["param"] == param and error["code"] == 400, error
    assert upstream.requests == [] and gw.status()["refused_invalid"] == 1


def test_the_openai_client_reads_a_wrong_type_refusal(gateway_factory, upstream):
    import openai

    gw = gateway_factory(upstream)
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="policy", input="hi", extra_body={"include": 5})
    assert err.value.param == "include" and err.value.type == "invalid_request_error"
    # the right types still pass (null is an unset field)
    ok = requests.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": None, "logprobs": None}, timeout=10)
    assert ok.status_code == 200, ok.text


def test_a_repeated_agent_or_rollout_header_is_its_first_value(gateway_factory, upstream):
    """``x-lightspan-agent: first`` and ``x-lightspan-agent: second`` made the span's agent
    "first, second" (which no --agent-match selects); the first value wins, as documented."""
    gw = gateway_factory(upstream)
    body = json.dumps(CHAT)
    answer = raw_request(port_of(gw), (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                       f"Content-Type: application/json\r\nX-Lightspan-Agent: first\r\n"
                                       f"x-lightspan-agent: second\r\nX-Lightspan-Rollout-Id: r1\r\n"
                                       f"X-Lightspan-Rollout-Id: r2\r\nConnection: close\r\n"
                                       f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    assert status_of(answer) == 200, answer[:300]
    (span,) = gw.exporter.get_finished_spans()
    assert span.attributes["gen_ai.agent.name"] == "first"
    assert span.attributes["lightspan.rollout.id"] == "r1"


def test_the_session_reward_route_cannot_post_a_persons_or_the_judges_score(gateway_factory, upstream,
                                                                            collector_factory, data_dir):
    """A harness behind the gateway reports its reward at POST /rollouts/{id}/reward (rollout/rewards.py).
    Whatever it sends, the reward is the agent's own: the body cannot name a source, another rollout or
    an id, and the gateway holds no reward token. Here the collector has no reward token at all, so a
    post straight to its API could claim any source: through the gateway it still cannot."""
    from tests.collector.helpers import query

    collector = collector_factory()
    gw = gateway_factory(upstream, collector_api_url=f"http://127.0.0.1:{collector.api_port}")
    url = f"{gw.url}/rollouts/r-1/reward"
    for forged in ({"value": 1.0, "source": "human"}, {"value": 1.0, "source": "judge", "name": "judge"},
                   {"value": 1.0, "rollout_id": "r-2"}, {"value": 1.0, "id": "correction-1"},
                   {"value": 1.0, "comment": "a person said so"}):
        answer = requests.post(url, json=forged, timeout=10)
        assert answer.status_code == 400, (forged, answer.text)
    # a source in the query string or a header is not read either
    answer = requests.post(url + "?source=human", json={"value": 0.5},
                           headers={"X-Lightspan-Reward-Source": "human"}, timeout=10)
    assert answer.status_code == 200, answer.text
    collector.flush()
    assert query(data_dir, "SELECT rollout_key, source, reward FROM rewards") == [("r-1", "agent", 0.5)]
    assert upstream.requests == []                 # nothing of it went to vLLM
