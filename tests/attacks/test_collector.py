"""Attacks on the collector's receivers and API: what a bad exporter, a web page or a bad request sends.

Findings of the attack pass (issue "Hardening"): 2 (one SQL query exhausts memory), 3 (a web page
drives the tokenless API), 4 (no cap on connections or in-flight memory), 5 (NaN logprobs
accepted at ingest), 6 (requests that got no answer), 7 (a reward re-posted after the window, a
repeated token-id key, a non-loopback bind without a token).
"""

from __future__ import annotations

import errno
import json
import socket
import threading
import time

import grpc
import pytest
import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)

from lightspan.collector.config import CollectorConfig
from lightspan.collector.server import Collector
from lightspan.core.config import ConfigError
from lightspan.tracing import semconv as sc
from tests.attacks.conftest import PeakRSS, raw_request, status_of
from tests.collector.helpers import api_url, config, grpc_call, query, raw_rows, traces_url

MiB = 1 << 20


def sql(collector, statement: str, **kwargs):
    return requests.post(api_url(collector, "/v1/sql"), json={"sql": statement}, timeout=60, **kwargs)


def one_span(logprobs: bytes | None = None, repeat_ids: bytes | None = None, tag: int = 1,
             sibling: bool = False) -> bytes:
    """A request with one chat span (and, with ``sibling``, a valid span beside it)."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key=sc.ROLLOUT_ID).value.string_value = f"attack-{tag}"
    scope = rs.scope_spans.add()
    if sibling:
        scope.spans.add(trace_id=tag.to_bytes(16, "big"), span_id=b"\x02" * 8, name="agent",
                        start_time_unix_nano=1_700_000_000_000_000_000, end_time_unix_nano=1_700_000_000_200_000_000)
    span = scope.spans.add(trace_id=tag.to_bytes(16, "big"), span_id=b"\x01" * 8, name="chat",
                           start_time_unix_nano=1_700_000_000_000_000_000,
                           end_time_unix_nano=1_700_000_000_100_000_000)
    attrs = [(sc.GEN_AI_OPERATION_NAME, "chat"), (sc.PROMPT_TOKEN_IDS, sc.encode_ids([1, 2, 3])),
             (sc.COMPLETION_TOKEN_IDS, sc.encode_ids([4, 5])),
             (sc.COMPLETION_LOGPROBS, logprobs if logprobs is not None else sc.encode_floats([-0.5, -1.0])),
             (sc.CAPTURE_STATUS, "ok")]
    if repeat_ids is not None:   # another copy of the key first, then the good one: which is the call's?
        attrs.insert(1, (sc.PROMPT_TOKEN_IDS, repeat_ids))
    for key, value in attrs:
        v = span.attributes.add(key=key).value
        if isinstance(value, bytes):
            v.bytes_value = value
        else:
            v.string_value = value
    return request.SerializeToString()


# --- finding 2: SQL ---------------------------------------------------------------------------------

def test_one_query_cannot_exhaust_the_collectors_memory(collector_factory):
    collector = collector_factory(sql_memory_limit_bytes=256 * MiB)
    assert sql(collector, "SELECT 1").status_code == 200            # the worker is warm
    with PeakRSS() as rss:                                          # this process: the collector's
        answer = sql(collector, "SELECT repeat('x', 1000000) AS s FROM range(1500)")   # 1.5 GB of strings
    assert answer.status_code == 400 and "sql_memory_limit_bytes" in answer.json()["error"], answer.text[:300]
    assert rss.growth < 100 * MiB, f"the collector grew by {rss.growth / MiB:.0f} MiB"
    assert sql(collector, "SELECT 42").json()["rows"] == [[42]]     # the next query runs


def test_an_answer_is_capped_in_bytes_not_only_rows(collector_factory):
    collector = collector_factory(sql_max_result_bytes=1 * MiB)
    answer = sql(collector, "SELECT repeat('x', 100000) AS s FROM range(200)")   # 20 MB of rows
    assert answer.status_code == 200 and answer.json()["truncated"] is True
    assert len(answer.content) <= 1.1 * MiB and 1 <= answer.json()["row_count"] < 11


def test_concurrent_queries_are_bounded_and_the_rest_told_to_retry(collector_factory):
    collector = collector_factory(sql_max_concurrent=1, sql_timeout_s=3)
    assert sql(collector, "SELECT 1").status_code == 200
    codes, lock = [], threading.Lock()

    def slow():
        answer = sql(collector, "SELECT count(*) FROM range(100000000) a, range(100) b")
        with lock:
            codes.append((answer.status_code, answer.headers.get("Retry-After")))

    threads = [threading.Thread(target=slow) for _ in range(14)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    refused = [c for c in codes if c[0] == 429]
    assert len(codes) == 14 and refused and all(retry == "1" for _, retry in refused), codes


# --- finding 3: cross-site use of the tokenless API -------------------------------------------------

def test_a_web_page_cannot_post_rewards_or_read_through_rebinding(collector_factory, data_dir):
    collector = collector_factory()
    url = api_url(collector, "/v1/rewards")
    simple = requests.post(url, data=json.dumps({"rollout_id": "r", "value": 999}), timeout=10,
                           headers={"Content-Type": "text/plain"})                 # a form, no preflight
    assert simple.status_code == 415
    cross = requests.post(url, json={"rollout_id": "r", "value": 999}, timeout=10,
                          headers={"Origin": "http://attacker.example"})
    assert cross.status_code == 403
    port = collector.api_port
    for path in ("/v1/sql?q=SELECT+1", "/metrics"):
        rebound = requests.get(api_url(collector, path), headers={"Host": f"attacker.example:{port}"}, timeout=10)
        assert rebound.status_code == 403, path
    flush = requests.post(api_url(collector, "/v1/flush"), headers={"Origin": "null"}, timeout=10)
    assert flush.status_code == 403
    otlp = requests.post(traces_url(collector), data=one_span(), timeout=10,
                         headers={"Content-Type": "application/x-protobuf", "Host": "attacker.example"})
    assert otlp.status_code == 403
    collector.flush()
    assert raw_rows(data_dir) == 0                                   # nothing was stored
    # the UI's own origin and a configured name pass
    same = requests.post(url, json={"rollout_id": "r", "value": 1}, headers={"Origin": f"http://127.0.0.1:{port}"},
                         timeout=10)
    assert same.status_code == 200
    named = collector_factory(data_dir=data_dir.parent / "named", allowed_hosts=("lightspan-collector",))
    assert requests.get(api_url(named, "/metrics"), headers={"Host": "lightspan-collector:8321"},
                        timeout=10).status_code == 200


# --- finding 4: connections and request bytes -----------------------------------------------------

def test_stalled_big_bodies_hold_a_bounded_budget_and_time_out(collector_factory):
    collector = collector_factory(max_inflight_bytes=32 * MiB, read_timeout_s=1.0)
    sockets, answers = [], []
    with PeakRSS() as rss:
        for _ in range(10):   # each declares 60 MiB and sends 20 MiB of it, then stalls
            sock = socket.create_connection(("127.0.0.1", collector.http_port))
            sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-protobuf\r\n"
                         b"Content-Length: %d\r\n\r\n" % (60 * MiB))
            sockets.append(sock)
        for sock in sockets:
            try:
                sock.sendall(b"\x00" * (20 * MiB))
            except OSError:
                pass                          # refused and closed: the rest is not read
        for sock in sockets:
            sock.settimeout(15)
            answer = b""
            try:
                while chunk := sock.recv(65536):
                    answer += chunk
            except OSError:
                pass
            answers.append(status_of(answer) if answer else None)
            sock.close()
    assert answers.count(503) + answers.count(None) >= 9 and answers.count(408) <= 1, answers
    assert rss.growth < 150 * MiB, f"the collector grew by {rss.growth / MiB:.0f} MiB"
    assert collector.health()["inflight_bytes"] == 0
    assert grpc_call(collector, one_span())[1] is None                  # and it still takes exports


def test_connections_past_the_cap_get_503_and_never_exhaust_descriptors(collector_factory):
    collector = collector_factory(max_connections=8, read_timeout_s=1.0)
    idle = [socket.create_connection(("127.0.0.1", collector.http_port)) for _ in range(40)]
    try:
        try:      # past twice the cap: closed at once (a reset); past the cap: 503
            answer = raw_request(collector.http_port, b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                                      b"Content-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n")
        except OSError as err:   # the reset surfaces at send, at shutdown (not connected) or at recv
            assert err.errno in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN), err
            answer = b""
        assert answer == b"" or status_of(answer) == 503
        assert collector.health()["connections"] <= 16
        assert grpc_call(collector, one_span())[1] is None               # gRPC and the API keep serving
        assert requests.get(api_url(collector, "/healthz"), timeout=10).status_code == 200
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10      # silent connections are closed after read_timeout_s
    while collector.health()["connections"] and time.monotonic() < deadline:
        time.sleep(0.05)
    ok = requests.post(traces_url(collector), data=one_span(tag=2), timeout=10,
                       headers={"Content-Type": "application/x-protobuf"})
    assert ok.status_code == 200 and collector.health()["connections_refused_total"] >= 1


def test_a_big_otlp_json_body_is_refused_before_it_is_decoded(collector_factory):
    collector = collector_factory(max_json_bytes=1 * MiB)
    spans = [{"traceId": f"{i + 1:032x}", "spanId": f"{i + 1:016x}", "name": "x" * 100} for i in range(20000)]
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}).encode()
    assert len(body) > 3 * MiB
    start = time.monotonic()
    answer = requests.post(traces_url(collector), data=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert answer.status_code == 413 and time.monotonic() - start < 5


# --- finding 5: NaN logprobs ----------------------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logprobs_are_stored_unusable_and_warned_about(collector_factory, data_dir, value):
    collector = collector_factory()
    answer, error = grpc_call(collector, one_span(logprobs=sc.encode_floats([-0.5, value])))
    assert error is None
    partial = ExportTraceServiceResponse.FromString(answer).partial_success
    assert partial.rejected_spans == 0 and "invalid_logprobs" in partial.error_message     # an OTLP warning
    collector.flush()
    assert query(data_dir, "SELECT capture_status, completion_logprobs, prompt_token_ids FROM spans") == [
        ("invalid_logprobs", None, [1, 2, 3])]
    assert query(data_dir, "SELECT count(*) FROM llm_calls WHERE list_count(completion_logprobs) > 0") == [(0,)]


# --- finding 6: every request is answered -----------------------------------------------------------

@pytest.mark.parametrize("path, body", [
    ("/v1/rewards", b"null"), ("/v1/sql", b"null"), ("/v1/rewards", b"[null]"), ("/v1/sql", b"[]"),
    ("/v1/rewards", b'{"rollout_id": "\\ud800", "value": 1}'), ("/v1/sql", b'{"sql": "SELECT \'\\udfff\'"}'),
    ("/v1/rewards", b'{"rollout_id": "r", "value": 1e999}'), ("/v1/sql", b"\xff\xfe\x00"),
])
def test_bad_json_bodies_get_400(collector_factory, data_dir, path, body):
    collector = collector_factory()
    answer = requests.post(api_url(collector, path), data=body, headers={"Content-Type": "application/json"},
                           timeout=10)
    assert answer.status_code == 400 and answer.json()["error"], answer.text
    collector.flush()
    assert raw_rows(data_dir) == 0


# --- finding 7 ----------------------------------------------------------------------------------------

def test_a_reward_posted_again_after_the_window_and_a_restart_is_stored_once(data_dir):
    first = Collector(config(data_dir)).start()
    try:
        url = api_url(first, "/v1/rewards")
        assert requests.post(url, json={"rollout_id": "r1", "value": 0.5}, timeout=10).status_code == 200
    finally:
        first.stop()
    again = Collector(config(data_dir, dedup_window_s=1e-6)).start()    # restarted, the window long gone
    try:
        url = api_url(again, "/v1/rewards")
        same = requests.post(url, json={"rollout_id": "r1", "value": 0.5}, timeout=10)
        assert same.status_code == 200
        again.flush()
        assert query(data_dir, "SELECT reward FROM rewards") == [(0.5,)]    # not stored twice
        changed = requests.post(url, json={"rollout_id": "r1", "value": 1.0}, timeout=10)
        assert changed.status_code == 409 and "new 'id'" in changed.json()["error"]   # never dropped silently
        assert same.json()["rewards"][0]["status"] == "already_stored"
        correction = requests.post(url, json={"rollout_id": "r1", "value": 1.0, "id": "fix-1"}, timeout=10)
        assert correction.status_code == 200 and correction.json()["stored"] == 1
        again.flush()
    finally:
        again.stop()
    assert query(data_dir, "SELECT reward FROM rewards ORDER BY reward") == [(0.5,), (1.0,)]


@pytest.mark.parametrize("first_copy, message", [
    (b"\x01\x02\x03", "not a multiple of 4"),                  # reported rejected, once stored anyway
    (sc.encode_ids([9, 9, 9, 9]), "appears more than once"),    # two valid copies: ambiguous
])
def test_a_span_whose_token_id_key_repeats_is_rejected_and_not_stored(collector_factory, data_dir, first_copy,
                                                                       message):
    collector = collector_factory()
    answer, error = grpc_call(collector, one_span(repeat_ids=first_copy, sibling=True))
    assert error is None
    partial = ExportTraceServiceResponse.FromString(answer).partial_success
    assert partial.rejected_spans == 1 and message in partial.error_message
    collector.flush()
    assert query(data_dir, "SELECT name FROM spans") == [("agent",)]      # the sibling only


def test_a_non_loopback_bind_without_a_token_refuses_to_start(tmp_path):
    with pytest.raises(ConfigError) as info:
        CollectorConfig(data_dir=str(tmp_path), host="0.0.0.0")
    assert info.value.field == "collector.auth_token" and "allow_no_token" in str(info.value)
    assert CollectorConfig(data_dir=str(tmp_path), host="0.0.0.0", auth_token="t0ken").auth_token
    assert CollectorConfig(data_dir=str(tmp_path), host="0.0.0.0", allow_no_token=True).allow_no_token
    assert CollectorConfig(data_dir=str(tmp_path), host="::1").host == "::1"


def test_grpc_requests_share_the_byte_budget(collector_factory):
    collector = collector_factory(max_inflight_bytes=1)
    collector.budget.take(1)                     # another request holds the whole budget
    try:
        _, error = grpc_call(collector, one_span())
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "in flight" in error.details()
        assert "google.rpc.retryinfo-bin" in dict(error.trailing_metadata())
    finally:
        collector.budget.give(1)
    assert grpc_call(collector, one_span())[1] is None
