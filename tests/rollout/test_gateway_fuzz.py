"""Fuzz: hundreds of mutated routes, headers and bodies (hypothesis) against one running gateway
in front of a recording stand-in for vLLM (tests/attacks/conftest.py).

Every request must get an HTTP answer (never a dropped connection), never a 5xx (the stand-in
always answers, so a 5xx is the gateway's own failure), never an error logged by lightspan; nothing
outside the gateway's table of upstream paths may reach the upstream; the admin state never moves
without the admin token; valid calls interleaved with the fuzz get 200 every time.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightspan.rollout.paths import ENDPOINTS
from tests.attacks.conftest import CHAT, Upstream, gateway_factory, port_of  # noqa: F401 (fixture)

TOKEN = "fuzz-admin-token"
FUZZ = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

_segments = st.one_of(st.sampled_from(["v1", "chat", "completions", "models", "embeddings", "responses", "messages",
                                       "..", ".", "%2e%2e", "%2E%2e", "%2f", "..%2f", "admin", "pause", "resume",
                                       "status", "rollouts", "tasks", "splits", "sleep", "collective_rpc",
                                       "load_lora_adapter", "", "health", "%00", "%ff", "\\..", "a;b", "~"]),
                      st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#"),
                              max_size=8))
paths = st.one_of(
    st.sampled_from(sorted(ENDPOINTS)),
    st.builds(lambda p: "/" + "/".join(p), st.lists(_segments, max_size=7)),
    st.builds(lambda pre, p: f"/rollouts/{pre}{p}", st.text(max_size=6).map(lambda t: t.encode().hex() or "r"),
              st.sampled_from(sorted(ENDPOINTS))),
    st.builds(lambda p, q: f"{p}?{q}", st.sampled_from(["/admin/pause", "/v1/models", "/v1/chat/completions"]),
              st.sampled_from(["timeout_s=abc", "timeout_s=1e309", "timeout_s=0", "timeout_s=-1", "x=%ff", "a=1&a=2"])))

_json = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=False),
                               st.text(max_size=20)),
                     lambda inner: st.one_of(st.lists(inner, max_size=4),
                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=10)
_fields = st.dictionaries(st.sampled_from(["model", "messages", "prompt", "stream", "max_tokens", "logprobs",
                                           "return_token_ids", "n", "temperature", "model_version", "tools"]),
                          _json, max_size=6)


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["chat", "fields", "raw", "special"]))
    if kind == "chat":
        doc = {**CHAT, **draw(_fields)}
        doc.pop("stream", None) if draw(st.booleans()) else None
        return json.dumps(doc).encode()
    if kind == "fields":
        return json.dumps(draw(_fields)).encode()
    if kind == "raw":
        return draw(st.binary(max_size=200))
    return draw(st.sampled_from([b"null", b"[]", b'"x"', b"1e309", b'{"messages": NaN}', b'{"model": "\\ud800"}',
                                 b"[" * 5000, b'{"a":' * 3000, b'{"model_version": 1e309}', b"\xff\xfe{}", b""]))


@st.composite
def cases(draw):
    method = draw(st.sampled_from(["POST", "POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]))
    headers = {"Content-Type": draw(st.sampled_from(["application/json", "application/json", "text/plain",
                                                     "application/x-www-form-urlencoded", "", "application/ld+json"]))}
    for name, values in (("Host", ["127.0.0.1", "localhost:1", "attacker.example", "[::1]:80", "", "a:b:c"]),
                         ("Origin", ["http://attacker.example", "null", "http://127.0.0.1:1", "x"]),
                         ("Authorization", [f"Bearer {TOKEN}", "Bearer nope", "Basic x", "Bearer"]),
                         ("traceparent", ["00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "zz", "00-" + "0" * 49]),
                         ("X-Lightspan-Rollout-Id", ["r1", "", "é", "x" * 300])):
        if draw(st.booleans()):
            headers[name] = draw(st.sampled_from(values))
    return method, draw(paths), headers, draw(bodies())


@pytest.fixture
def fuzzed(gateway_factory, caplog):  # noqa: F811 (the fixture above)
    caplog.set_level(logging.WARNING)
    upstream = Upstream()
    gw = gateway_factory(upstream, admin_token=TOKEN, max_body_bytes=1 << 16)
    yield gw, upstream
    upstream.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("lightspan")]
    assert errors == [], [r.getMessage() for r in errors[:3]]


def test_gateway_fuzz_routes_headers_and_bodies(fuzzed):
    gw, upstream = fuzzed
    port = port_of(gw)
    counter, statuses = itertools.count(), set()

    def send(method: str, path: str, headers: dict, body: bytes) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
            for name, value in headers.items():
                conn.putheader(name, value.encode("utf-8"))
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            answer = conn.getresponse()
            answer.read()
            return answer.status
        finally:
            conn.close()

    @FUZZ
    @given(case=cases())
    def run(case):
        method, path, headers, body = case
        paused, version = gw.status()["paused"], gw.version.override
        try:
            status = send(method, path, headers, body)
        except http.client.InvalidURL:   # a path the client itself refuses to send
            return
        statuses.add(status)
        assert status < 500 or status == 504, (status, case)    # 504: a pause that did not drain in time
        if headers.get("Authorization") != f"Bearer {TOKEN}":
            assert (gw.status()["paused"], gw.version.override) == (paused, version), case
        if gw.status()["paused"]:
            send("POST", "/admin/resume", {"Authorization": f"Bearer {TOKEN}"}, b"")
        if next(counter) % 10 == 0:
            ok = send("POST", "/v1/chat/completions", {"Content-Type": "application/json"}, json.dumps(CHAT).encode())
            assert ok == 200

    run()
    assert {p.split("?")[0] for p in upstream.paths()} <= set(ENDPOINTS), sorted(set(upstream.paths()))[:10]
    assert {200, 400, 403, 404}.issubset(statuses), statuses
