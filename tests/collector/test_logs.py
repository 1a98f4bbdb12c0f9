"""OTLP logs: flatten_logs by hand, then the real SDK log exporters over gRPC and HTTP, JSON, WAL replay."""

from __future__ import annotations

import json
import shutil

import grpc
import requests
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry._logs import LogRecord
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as GrpcLogExporter
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HttpLogExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource

from lightspan.collector import otlp, otlp_logs, otlp_parse
from lightspan.collector.server import LOGS_EXPORT_METHOD, Collector
from lightspan.tracing import semconv as sc
from tests.collector.helpers import config, query

TRACE, SPAN = bytes(range(1, 17)), bytes(range(1, 9))
T0 = 1_700_000_000_000_000_000          # 2023-11-14


def logs_request(records: list[dict], resource: dict | None = None) -> ExportLogsServiceRequest:
    request = ExportLogsServiceRequest()
    rl = request.resource_logs.add()
    for key, value in (resource or {}).items():
        rl.resource.attributes.add(key=key, value=AnyValue(string_value=value))
    sl = rl.scope_logs.add()
    sl.scope.name = "test.scope"
    for fields in records:
        fields = dict(fields)
        attrs = fields.pop("attributes", {})
        record = sl.log_records.add(**fields)
        record.attributes.extend(KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in attrs.items())
    return request


def test_flatten_logs_promotes_ids_and_keeps_the_rest():
    body = AnyValue()
    body.kvlist_value.values.add(key="content", value=AnyValue(string_value="4"))
    request = logs_request([
        dict(time_unix_nano=T0, severity_number=9, severity_text="INFO", body=body, event_name="gen_ai.choice",
             trace_id=TRACE, span_id=SPAN, attributes={"gen_ai.system": "openai"}),
        dict(observed_time_unix_nano=T0 + 5, body=AnyValue(string_value="plain"),
             attributes={"event.name": "gen_ai.user.message", sc.ROLLOUT_ID: "own-rollout"}),
        dict(time_unix_nano=T0, trace_id=TRACE[:15]),                      # bad trace id: rejected
    ], resource={"service.name": "agent", sc.ROLLOUT_ID: "r-1", sc.TASK_ID: "t-1"})
    table, rejected, first = otlp_logs.flatten_logs(request, T0 + 99)
    assert rejected == 1 and "log_records[2]" in first and "trace_id has 15 bytes" in first
    rows = table.to_pylist()
    assert [r["time_unix_nano"] for r in rows] == [T0, T0 + 5]              # observed time as fallback
    assert [r["event_name"] for r in rows] == ["gen_ai.choice", "gen_ai.user.message"]
    assert json.loads(rows[0]["body"]) == {"content": "4"} and json.loads(rows[1]["body"]) == "plain"
    assert (rows[0]["trace_id"], rows[0]["span_id"]) == (TRACE.hex(), SPAN.hex())
    assert rows[1]["trace_id"] is None
    assert [(r["rollout_id"], r["task_id"], r["service_name"]) for r in rows] == [
        ("r-1", "t-1", "agent"), ("own-rollout", "t-1", "agent")]
    assert dict(rows[0]["attributes"]) == {"gen_ai.system": '"openai"'}
    assert sc.ROLLOUT_ID not in dict(rows[0]["resource_attributes"])        # promoted
    assert sc.ROLLOUT_ID in dict(rows[1]["resource_attributes"])           # overridden: kept visible
    again, _, _ = otlp_logs.flatten_logs(request, T0 + 1000)                    # the same records re-sent
    assert again.column("record_id").to_pylist() == table.column("record_id").to_pylist()
    assert len(set(table.column("record_id").to_pylist())) == 2


def sdk_logs(exporter, rollout: str) -> None:
    provider = LoggerProvider(resource=Resource.create({"service.name": "agent", sc.ROLLOUT_ID: rollout}))
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    logger = provider.get_logger("agent")
    logger.emit(LogRecord(event_name="gen_ai.choice", body={"index": 0, "message": {"content": "hi"}},
                          attributes={"gen_ai.system": "openai"}))
    logger.emit(body="plain text", severity_text="WARN")
    provider.shutdown()


def test_sdk_log_exporters_grpc_and_http_land_in_the_logs_view(collector_factory, data_dir):
    collector = collector_factory()
    sdk_logs(GrpcLogExporter(endpoint=f"127.0.0.1:{collector.grpc_port}", insecure=True, timeout=5), "via-grpc")
    sdk_logs(HttpLogExporter(endpoint=f"http://127.0.0.1:{collector.http_port}/v1/logs", timeout=5), "via-http")
    assert collector.flush_counts() == {"spans": 0, "logs": 4}
    assert query(data_dir, """SELECT rollout_id, count(*), count(event_name), max(service_name)
                              FROM logs GROUP BY 1 ORDER BY 1""") == [("via-grpc", 2, 1, "agent"),
                                                                       ("via-http", 2, 1, "agent")]
    assert query(data_dir, "SELECT json_extract_string(body, '$.message.content') FROM logs "
                           "WHERE event_name = 'gen_ai.choice' AND rollout_id = 'via-grpc'") == [("hi",)]
    files = list((data_dir / "logs").rglob("*.parquet"))
    assert files and all(p.parent.name.startswith("date=") for p in files)
    assert collector.metrics.snapshot()["log_records_accepted_total"] == 4


def test_logs_json_partial_success_resend_dedup_and_wal_replay(collector_factory, data_dir, tmp_path):
    collector = collector_factory()
    doc = {"resourceLogs": [{"resource": {"attributes": [{"key": sc.ROLLOUT_ID, "value": {"stringValue": "js"}}]},
                             "scopeLogs": [{"logRecords": [
                                 {"timeUnixNano": str(T0), "severityNumber": 17, "body": {"stringValue": "boom"},
                                  "traceId": TRACE.hex().upper(), "spanId": SPAN.hex()},
                                 {"timeUnixNano": str(T0), "spanId": "0102"}]}]}]}     # 2-byte span id: rejected
    url = f"http://127.0.0.1:{collector.http_port}/v1/logs"
    for _ in range(2):                                               # at-least-once: the same batch twice
        answer = requests.post(url, json=doc, timeout=5)
        assert answer.status_code == 200 and answer.headers["Content-Type"] == "application/json"
        assert answer.json()["partialSuccess"]["rejectedLogRecords"] == "1"
    with grpc.insecure_channel(f"127.0.0.1:{collector.grpc_port}") as channel:
        export = channel.unary_unary(LOGS_EXPORT_METHOD)
        reply = export(logs_request([dict(time_unix_nano=T0, body=AnyValue(string_value="over grpc"))],
                                    {sc.ROLLOUT_ID: "pb"}).SerializeToString(), timeout=5)
        assert ExportLogsServiceResponse.FromString(reply).partial_success.rejected_log_records == 0
    bad = requests.post(url, data=b"\xff\xff", headers={"Content-Type": "application/x-protobuf"}, timeout=5)
    assert bad.status_code == 400
    crashed = tmp_path / "crashed"
    shutil.copytree(data_dir / "wal", crashed / "wal")               # acknowledged, only in the WAL
    collector.flush()
    assert query(data_dir, "SELECT rollout_id, severity_number, body, trace_id FROM logs ORDER BY 1") == [
        ("js", 17, '"boom"', TRACE.hex()), ("pb", 0, '"over grpc"', None)]
    assert query(data_dir, "SELECT DISTINCT date FROM read_parquet('%s/logs/**/*.parquet', hive_partitioning=true)"
                 % data_dir)[0][0].isoformat() == "2023-11-14"
    recovered = Collector(config(crashed)).start()                   # WAL replay: tagged log records
    try:
        assert query(crashed, "SELECT rollout_id, count(*) FROM logs GROUP BY 1 ORDER BY 1") == [("js", 1), ("pb", 1)]
        snapshot = recovered.metrics.snapshot()      # 2 js copies + 1 replayed; the repeat is not written
        assert (snapshot["log_records_written_total"], snapshot["log_records_deduplicated_total"]) == (2, 1)
    finally:
        recovered.stop()


_VALID = logs_request([dict(time_unix_nano=T0, body=AnyValue(string_value="x"), trace_id=TRACE, span_id=SPAN,
                            attributes={"event.name": "e", sc.ROLLOUT_ID: "r"})], {"service.name": "s"}).SerializeToString()


@settings(max_examples=300, deadline=None)
@given(cuts=st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), max_size=6),
       length=st.integers(0, len(_VALID)))
def test_mutated_log_requests_parse_and_flatten_or_raise_decode_error(cuts, length):
    body = bytearray(_VALID[:length])
    for position, value in cuts:
        if position < len(body):
            body[position] = value
    try:
        request = otlp_parse.parse_protobuf_request(bytes(body), ExportLogsServiceRequest)
    except otlp_parse.DecodeError:
        return
    table, rejected, _ = otlp_logs.flatten_logs(request, T0)
    assert table.num_rows + rejected == otlp_logs.count_log_records(request)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                         st.sampled_from(["resourceLogs", "scopeLogs", "logRecords", "body", "traceId", "spanId",
                                          "timeUnixNano", "attributes", "stringValue", "x"]), inner, max_size=4),
                     max_leaves=15)


@settings(max_examples=300, deadline=None)
@given(doc=_json)
def test_arbitrary_json_logs_parse_or_raise_decode_error(doc):
    try:
        request = otlp_logs.parse_json_logs_request(json.dumps(doc).encode())
    except otlp_parse.DecodeError:
        return
    otlp_logs.flatten_logs(request, T0)
