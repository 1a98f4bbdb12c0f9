"""collector/server.py against the real OTLP exporters, on loopback and ephemeral ports."""

from __future__ import annotations

import gzip
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import requests
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace.export import SpanExportResult

from lightspan.collector.config import CollectorConfig
from lightspan.collector.server import Collector, CollectorError, Outcome, status_for
from lightspan.collector.wal import WAL
from lightspan.core.config import ConfigError, resolve
from lightspan.tracing import semconv as sc
from tests.collector.helpers import (agent_run, api_url, build_provider, config, grpc_call,
                                    grpc_exporter, http_exporter, make_spans, query, raw_rows, request_bytes,
                                    traces_url, wait_for, with_bad_span)


# --- the happy paths ---------------------------------------------------------------------------

def test_grpc_exporter_spans_land_in_parquet_with_token_ids(collector_factory, data_dir):
    collector = collector_factory()
    exporter = grpc_exporter(collector)
    provider, _ = build_provider("rollout-grpc", exporter)   # SimpleSpanProcessor → real gRPC export
    agent_run(provider, calls=2)
    assert collector.flush() == 3
    rows = query(data_dir, """SELECT name, rollout_id, task_id, service_name, prompt_token_ids,
                                     completion_token_ids, completion_logprobs, num_choices, model_version
                              FROM spans ORDER BY start_time_unix_nano""")
    assert [r[0] for r in rows] == ["agent", "chat", "chat"]
    assert {r[1:4] for r in rows} == {("rollout-grpc", "task-1", "agent")}
    assert [r[4] for r in rows[1:]] == [[100, 101, 102], [101, 101, 102]]
    assert [r[5] for r in rows[1:]] == [[7, 0], [7, 1]]
    assert rows[1][6] == pytest.approx([-0.5, -1.5]) and rows[1][7:] == (2, 3)
    assert collector.metrics.snapshot()["spans_accepted_total"] == 3
    provider.shutdown()


def test_http_exporter_gzip_and_resent_batch_is_deduplicated(collector_factory, data_dir):
    collector = collector_factory()
    spans = make_spans("rollout-http")
    exporter = http_exporter(collector, compression=Compression.Gzip)
    assert exporter.export(spans) == SpanExportResult.SUCCESS
    assert exporter.export(spans) == SpanExportResult.SUCCESS   # at-least-once: the same batch again
    collector.flush()
    assert raw_rows(data_dir) == 3                               # the writer kept the first copy only
    assert collector.metrics.snapshot()["spans_deduplicated_total"] == 3
    assert query(data_dir, "SELECT count(*), count(DISTINCT rollout_id) FROM spans") == [(3, 1)]
    assert query(data_dir, "SELECT num_llm_calls FROM rollouts WHERE rollout_key = 'rollout-http'") == [(2,)]
    exporter.shutdown()


def test_otlp_json_over_http_answers_json(collector_factory, data_dir):
    collector = collector_factory()
    body = {"resourceSpans": [{
        "resource": {"attributes": [{"key": sc.ROLLOUT_ID, "value": {"stringValue": "json-rollout"}}]},
        "scopeSpans": [{"spans": [{
            "traceId": "5B8EFFF798038103D269B633813FC60C", "spanId": "EEE19B7EC3C1B174", "name": "chat",
            "kind": 2, "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000001000000000",
            "attributes": [{"key": sc.GEN_AI_USAGE_INPUT_TOKENS, "value": {"intValue": "12"}}]}]}]}]}
    answer = requests.post(traces_url(collector), json=body, timeout=5)
    assert answer.status_code == 200 and answer.headers["Content-Type"] == "application/json"
    assert answer.json() == {}
    collector.flush()
    assert query(data_dir, "SELECT trace_id, span_id, kind, rollout_id, input_tokens FROM spans") == [
        ("5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174", "SERVER", "json-rollout", 12)]
    assert list((data_dir / "spans").glob("date=*")) == [data_dir / "spans" / "date=2023-11-14"]


# --- bad input -----------------------------------------------------------------------------------

def test_malformed_http_gets_400_and_a_valid_batch_afterwards_lands(collector_factory, data_dir):
    collector = collector_factory()
    bad = requests.post(traces_url(collector), data=b"\xff\xff\xff\xff",
                        headers={"Content-Type": "application/x-protobuf"}, timeout=5)
    assert bad.status_code == 400 and bad.headers["Content-Type"] == "application/x-protobuf"
    assert status_pb2.Status.FromString(bad.content).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    bad_json = requests.post(traces_url(collector), data=b"{not json", headers={"Content-Type": "application/json"},
                             timeout=5)
    assert bad_json.status_code == 400 and "not JSON" in bad_json.json()["message"]
    assert http_exporter(collector).export(make_spans("after-bad")) == SpanExportResult.SUCCESS
    collector.flush()
    assert query(data_dir, "SELECT count(*) FROM spans WHERE rollout_id = 'after-bad'") == [(3,)]
    assert collector.metrics.snapshot()["requests_refused_total"]["invalid"] == 2


def test_malformed_grpc_gets_invalid_argument_and_nothing_else_is_lost(collector_factory, data_dir):
    collector = collector_factory()
    exporter = grpc_exporter(collector)
    assert exporter.export(make_spans("before")) == SpanExportResult.SUCCESS
    _, error = grpc_call(collector, b"\xff\xff\xff\xff")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exporter.export(make_spans("after")) == SpanExportResult.SUCCESS
    collector.flush()
    assert query(data_dir, "SELECT rollout_id, count(*) FROM spans GROUP BY 1 ORDER BY 1") == [
        ("after", 3), ("before", 3)]


def test_bad_span_is_rejected_through_partial_success(collector_factory, data_dir):
    collector = collector_factory()
    answer, error = grpc_call(collector, with_bad_span(make_spans("grpc-partial")))
    assert error is None
    partial = ExportTraceServiceResponse.FromString(answer).partial_success
    assert partial.rejected_spans == 1 and "trace_id has 15 bytes" in partial.error_message
    http = requests.post(traces_url(collector), data=with_bad_span(make_spans("http-partial")),
                         headers={"Content-Type": "application/x-protobuf"}, timeout=5)
    assert http.status_code == 200
    assert ExportTraceServiceResponse.FromString(http.content).partial_success.rejected_spans == 1
    collector.flush()
    assert query(data_dir, "SELECT rollout_id, count(*) FROM spans GROUP BY 1 ORDER BY 1") == [
        ("grpc-partial", 3), ("http-partial", 3)]
    snapshot = collector.metrics.snapshot()
    assert (snapshot["spans_received_total"], snapshot["spans_accepted_total"], snapshot["spans_rejected_total"]) == (8, 6, 2)


def test_body_caps_before_and_after_gunzip(collector_factory, data_dir):
    collector = collector_factory(max_http_body_bytes=4096)
    headers = {"Content-Type": "application/x-protobuf"}
    too_big = requests.post(traces_url(collector), data=b"\x00" * 5000, headers=headers, timeout=5)
    assert too_big.status_code == 413
    bomb = gzip.compress(b"\x00" * 100_000)
    assert len(bomb) < 4096
    inflated = requests.post(traces_url(collector), data=bomb, headers={**headers, "Content-Encoding": "gzip"},
                             timeout=5)
    assert inflated.status_code == 413
    broken = requests.post(traces_url(collector), data=b"not gzip", headers={**headers, "Content-Encoding": "gzip"},
                           timeout=5)
    assert broken.status_code == 400
    # the exporter treats 413 as permanent: one request, no retries, the batch is dropped
    assert http_exporter(collector).export(make_spans(calls=30)) == SpanExportResult.FAILURE
    assert collector.metrics.snapshot()["requests_refused_total"]["too_large"] == 3
    # the connection is still usable and small gzipped batches pass
    small = requests.post(traces_url(collector), data=gzip.compress(request_bytes(make_spans("small"))),
                          headers={**headers, "Content-Encoding": "gzip"}, timeout=5)
    assert small.status_code == 200
    collector.flush()
    assert query(data_dir, "SELECT count(*) FROM spans") == [(3,)]


def test_grpc_receive_limit_is_raised_past_4_mib_and_still_enforced(collector_factory, data_dir, tmp_path):
    provider, memory = build_provider("big")
    with provider.get_tracer("t").start_as_current_span("chat") as span:
        span.set_attribute(sc.PROMPT_TOKEN_IDS, sc.encode_ids(range(5 << 18)))   # 5 MiB of token ids
    payload = request_bytes(memory.get_finished_spans())
    assert len(payload) > 5 << 20
    collector = collector_factory()
    assert grpc_call(collector, payload)[1] is None
    collector.flush()
    assert query(data_dir, "SELECT len(prompt_token_ids), prompt_token_ids[-1] FROM spans") == [(5 << 18, (5 << 18) - 1)]
    small = collector_factory(data_dir=tmp_path / "small", grpc_max_receive_bytes=1 << 20)
    assert grpc_call(small, payload)[1].code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_http_routing_and_content_types(collector_factory):
    collector = collector_factory()
    assert requests.get(traces_url(collector), timeout=5).status_code == 405
    assert requests.post(f"http://127.0.0.1:{collector.http_port}/v1/metrics", data=b"x", timeout=5).status_code == 404
    unsupported = requests.post(traces_url(collector), data=b"x", headers={"Content-Type": "text/plain"}, timeout=5)
    assert unsupported.status_code == 415
    brotli = requests.post(traces_url(collector), data=b"x", timeout=5,
                           headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "br"})
    assert brotli.status_code == 415


# --- backpressure ----------------------------------------------------------------------------

def test_queue_full_http_503_with_retry_after(collector_factory, data_dir):
    collector = collector_factory(max_queue_bytes=1, retry_after_s=2)
    headers = {"Content-Type": "application/x-protobuf"}
    first = requests.post(traces_url(collector), data=request_bytes(make_spans("a")), headers=headers, timeout=5)
    assert first.status_code == 200                       # an empty queue admits any one request
    refused = requests.post(traces_url(collector), data=request_bytes(make_spans("b")), headers=headers, timeout=5)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "2"
    details = status_pb2.Status.FromString(refused.content).details
    assert details[0].Is(error_details_pb2.RetryInfo.DESCRIPTOR)
    as_json = requests.post(traces_url(collector), json={"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": "01" * 16, "spanId": "02" * 8, "name": "x"}]}]}]}, timeout=5)
    assert as_json.status_code == 503 and as_json.headers["Retry-After"] == "2"
    assert as_json.json()["details"][0]["retryDelay"] == "2s"
    assert collector.queue_bytes > 0
    collector.flush()
    assert collector.queue_bytes == 0
    again = requests.post(traces_url(collector), data=request_bytes(make_spans("b")), headers=headers, timeout=5)
    assert again.status_code == 200
    collector.flush()
    assert query(data_dir, "SELECT rollout_id, count(*) FROM spans GROUP BY 1 ORDER BY 1") == [("a", 3), ("b", 3)]


def test_queue_full_grpc_unavailable_with_retryinfo_trailer(collector_factory):
    collector = collector_factory(max_queue_bytes=1, retry_after_s=3)
    assert grpc_call(collector, request_bytes(make_spans("a")))[1] is None
    _, error = grpc_call(collector, request_bytes(make_spans("b")))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "queue full" in error.details()
    trailers = dict(error.trailing_metadata())
    info = error_details_pb2.RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"])
    assert info.retry_delay.seconds == 3
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    assert status.code == grpc.StatusCode.UNAVAILABLE.value[0] and status.details[0].Is(info.DESCRIPTOR)
    assert collector.metrics.snapshot()["requests_refused_total"]["queue_full"] == 1


def test_grpc_exporter_retries_after_the_delay_and_succeeds(collector_factory, data_dir):
    collector = collector_factory(max_queue_bytes=1, retry_after_s=1)
    exporter = grpc_exporter(collector, timeout=10)
    assert exporter.export(make_spans("first")) == SpanExportResult.SUCCESS
    result = []
    sender = threading.Thread(target=lambda: result.append(exporter.export(make_spans("retried"))))
    sender.start()
    wait_for(lambda: collector.metrics.snapshot()["requests_refused_total"]["queue_full"] >= 1, what="a refusal")
    collector.flush()                                      # room again: the retry (after 1 s) gets in
    sender.join(timeout=15)
    assert result == [SpanExportResult.SUCCESS]
    collector.flush()
    assert query(data_dir, "SELECT count(*) FROM spans WHERE rollout_id = 'retried'") == [(3,)]


# --- durability --------------------------------------------------------------------------------

def test_wal_replays_after_a_crash(collector_factory, data_dir, tmp_path):
    collector = collector_factory()
    assert grpc_exporter(collector).export(make_spans("survivor")) == SpanExportResult.SUCCESS
    assert not (data_dir / "spans").exists()               # acknowledged, not yet in Parquet
    crashed = tmp_path / "crashed"
    shutil.copytree(data_dir / "wal", crashed / "wal")    # what a kill -9 leaves behind: the fsynced WAL
    recovered = collector_factory(data_dir=crashed)       # start() replays before serving
    assert query(crashed, "SELECT count(*), any_value(rollout_id) FROM spans") == [(3, "survivor")]
    assert list((crashed / "wal").glob("*.wal")) == []
    assert recovered.metrics.snapshot()["spans_replayed_total"] == 3


def test_wal_written_directly_with_a_torn_tail_replays(data_dir):
    wal = WAL(data_dir / "wal")
    wal.append(request_bytes(make_spans("direct-1")))
    wal.append(request_bytes(make_spans("direct-2")))
    wal.close()
    [segment] = list((data_dir / "wal").glob("*.wal"))
    with segment.open("ab") as fh:
        fh.write(b"\x10\x00\x00\x00\x00\x00")              # a record torn inside its header
    collector = Collector(config(data_dir)).start()
    try:
        assert query(data_dir, "SELECT rollout_id, count(*) FROM spans GROUP BY 1 ORDER BY 1") == [
            ("direct-1", 3), ("direct-2", 3)]
    finally:
        collector.stop()


def test_stop_flushes_and_the_writer_flushes_on_its_interval(collector_factory, data_dir, tmp_path):
    collector = collector_factory()
    assert http_exporter(collector).export(make_spans("on-stop")) == SpanExportResult.SUCCESS
    collector.stop()
    assert query(data_dir, "SELECT count(*) FROM spans") == [(3,)]
    assert list((data_dir / "wal").glob("*.wal")) == []
    timed_dir = tmp_path / "timed"
    timed = collector_factory(data_dir=timed_dir, flush_interval_s=0.05)
    assert http_exporter(timed).export(make_spans("timer")) == SpanExportResult.SUCCESS
    wait_for(lambda: query(timed_dir, "SELECT count(*) FROM spans")[0][0] == 3, what="the timed flush")


# --- lifecycle, ports, API ---------------------------------------------------------------------

def test_start_stop_start_on_the_same_ports(data_dir):
    first = Collector(config(data_dir)).start()
    ports = dict(grpc_port=first.grpc_port, http_port=first.http_port, api_port=first.api_port)
    first.stop()
    first.stop()                                          # idempotent
    fixed = config(data_dir, **ports)
    collector = Collector(fixed)
    for round_ in range(2):
        collector.start()
        assert (collector.grpc_port, collector.http_port, collector.api_port) == tuple(ports.values())
        assert grpc_exporter(collector).export(make_spans(f"round-{round_}")) == SpanExportResult.SUCCESS
        collector.stop()
    assert query(data_dir, "SELECT count(DISTINCT rollout_id) FROM spans") == [(2,)]


@pytest.mark.parametrize("field", ["grpc_port", "http_port", "api_port"])
def test_a_taken_port_fails_fast_and_names_the_field(data_dir, field):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(CollectorError, match=f"collector.{field}"):
            Collector(config(data_dir, **{field: taken.getsockname()[1]})).start()
    collector = Collector(config(data_dir)).start()        # nothing was left bound or running
    collector.stop()


def test_api_healthz_metrics_flush(collector_factory):
    collector = collector_factory()
    assert requests.get(api_url(collector, "/healthz"), timeout=5).json() == {"status": "ok"}
    assert grpc_exporter(collector).export(make_spans()) == SpanExportResult.SUCCESS
    grpc_call(collector, b"\xff\xff")
    metrics = requests.get(api_url(collector, "/metrics"), timeout=5)
    assert metrics.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = dict(line.rsplit(" ", 1) for line in metrics.text.splitlines() if not line.startswith("#"))
    assert samples["lightspan_collector_spans_received_total"] == "3"
    assert samples["lightspan_collector_spans_accepted_total"] == "3"
    assert samples['lightspan_collector_requests_refused_total{reason="invalid"}'] == "1"
    assert int(samples["lightspan_collector_queue_bytes"]) > 0 and int(samples["lightspan_collector_wal_bytes"]) > 0
    assert int(samples["lightspan_collector_fsync_seconds_count"]) >= 1
    assert "# TYPE lightspan_collector_flush_seconds summary" in metrics.text
    flushed = requests.post(api_url(collector, "/v1/flush"), timeout=5)
    assert flushed.json() == {"flushed_spans": 3, "flushed_log_records": 0}
    after = requests.get(api_url(collector, "/metrics"), timeout=5).text
    assert "lightspan_collector_flush_seconds_count 1" in after and "lightspan_collector_queue_bytes 0" in after
    assert requests.get(api_url(collector, "/nope"), timeout=5).status_code == 404
    assert requests.get(api_url(collector, "/v1/flush"), timeout=5).status_code == 405


def test_serve_logs_addresses_and_exits_cleanly_on_sigterm(tmp_path):
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr);"
            "from lightspan.collector.server import serve; from lightspan.collector.config import CollectorConfig;"
            f"sys.exit(serve(CollectorConfig(data_dir={str(tmp_path)!r}, grpc_port=0, http_port=0, api_port=0)))")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline, seen = time.monotonic() + 30, ""
        while "OTLP/gRPC" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stderr], [], [], 1)
            if ready:
                line = proc.stderr.readline()
                if not line:
                    break
                seen += line
        assert "OTLP/gRPC 127.0.0.1:" in seen and "/v1/traces" in seen, seen
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stderr.close()


# --- the one status mapping, and the config ------------------------------------------------

def test_status_for_separates_permanent_from_retryable():
    retryable = {Outcome.QUEUE_FULL, Outcome.DISK, Outcome.UNAVAILABLE, Outcome.BUSY}
    assert {o for o in Outcome if status_for(o).retryable} == retryable
    assert all(status_for(o).http_status == 503 and status_for(o).grpc_code == grpc.StatusCode.UNAVAILABLE
               for o in retryable)
    assert status_for(Outcome.INVALID).http_status == 400
    assert status_for(Outcome.INVALID).grpc_code == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(Outcome.TOO_LARGE).http_status == 413
    assert all(status_for(o).http_status < 500 for o in Outcome if not status_for(o).retryable)


@pytest.mark.parametrize("overrides, field", [
    ({"grpc_port": 70000}, "collector.grpc_port"),
    ({"http_port": -1}, "collector.http_port"),
    ({"max_queue_bytes": 0}, "collector.max_queue_bytes"),
    ({"max_http_body_bytes": -5}, "collector.max_http_body_bytes"),
    ({"grpc_max_receive_bytes": 1 << 31}, "collector.grpc_max_receive_bytes"),
    ({"flush_interval_s": 0}, "collector.flush_interval_s"),
    ({"retry_after_s": 0}, "collector.retry_after_s"),
    ({"data_dir": ""}, "collector.data_dir"),
    ({"grpc_port": 5000, "http_port": 5000}, "collector.api_port"),
    ({"sql_timeout_s": 0}, "collector.sql_timeout_s"),
    ({"sql_max_rows": 0}, "collector.sql_max_rows"),
    ({"compact_min_files": -1}, "collector.compact_min_files"),
    ({"retention_days": 1.5}, "collector.retention_days"),
])
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        CollectorConfig(**overrides)
    assert info.value.field == field and "fix:" in str(info.value)


def test_config_resolves_env_alias_and_rejects_bad_env(tmp_path):
    resolved = resolve(CollectorConfig, section="collector",
                       environ={"LIGHTSPAN_DATA_DIR": str(tmp_path), "LIGHTSPAN_COLLECTOR_GRPC_PORT": "5317"},
                       cli={"http_port": "5318"})
    assert (resolved.data_dir, resolved.grpc_port, resolved.http_port) == (str(tmp_path), 5317, 5318)
    assert resolved.max_queue_bytes == 256 << 20 and resolved.grpc_max_receive_bytes == 64 << 20
    with pytest.raises(ConfigError) as info:
        resolve(CollectorConfig, section="collector", environ={"LIGHTSPAN_COLLECTOR_API_PORT": "http"})
    assert info.value.field == "collector.api_port"


def test_collector_help_documents_every_field(capsys):
    from lightspan.cli import main

    with pytest.raises(SystemExit) as info:
        main(["collector", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert all(name in text for name in ("--auth-token", "--tls-cert-file", "--sql-timeout-s",
                                               "--sql-max-rows", "--compact-min-files", "--retention-days"))


def test_store_import_does_not_pull_in_the_receivers():
    code = ("import sys, lightspan.store;"
            "bad = [m for m in ('grpc', 'http.server', 'lightspan.collector.server', 'lightspan.collector.httpd') if m in sys.modules];"
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.CRITICAL)  # expected failures are noisy
