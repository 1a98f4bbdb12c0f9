"""Fuzz: thousands of malformed and mutated OTLP payloads (hypothesis) on OTLP/HTTP (protobuf,
JSON, gzip, content types) and OTLP/gRPC (traces and logs) against one running collector.

Every answer must be 200 (possibly with ``partial_success``) or a client error (400 /
INVALID_ARGUMENT, 413 past the body cap, 415 for a content type or encoding the collector does
not speak): never a 5xx, INTERNAL or UNKNOWN, never an error logged by the collector or gRPC.
Valid requests interleaved with the fuzz are acknowledged every time and are all stored.
"""

from __future__ import annotations

import base64
import gzip
import itertools
import json
import logging
import zlib

import grpc
import pytest
import requests
from google.protobuf import json_format
from google.rpc import status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from lightspan.collector import otlp, otlp_logs, otlp_parse
from lightspan.collector.server import EXPORT_METHOD, LOGS_EXPORT_METHOD
from lightspan.tracing import semconv as sc
from tests.collector.helpers import query

BODY_CAP = 64 << 10
FUZZ = settings(max_examples=1000, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROTOBUF, JSON = "application/x-protobuf", "application/json"
ALLOWED_HTTP = {200, 400, 413, 415}
ALLOWED_GRPC = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


# --- seeds: small valid requests that touch every part of the schema ----------------------------

def _any(value) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, list):
        out = AnyValue()
        out.array_value.values.extend(_any(v) for v in value)
        return out
    if isinstance(value, dict):
        out = AnyValue()
        for k, v in value.items():
            out.kvlist_value.values.add(key=k, value=_any(v))
        return out
    return AnyValue(string_value=value)


def trace_request(tag: int, spans: int = 2) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    for key, value in (("service.name", "fuzz"), (sc.ROLLOUT_ID, f"r-{tag}"), ("host.cores", 2)):
        rs.resource.attributes.add(key=key, value=_any(value))
    ss = rs.scope_spans.add()
    ss.scope.name = "fuzz.scope"
    for i in range(spans):
        span = ss.spans.add(trace_id=tag.to_bytes(16, "big"), span_id=(i + 1).to_bytes(8, "big"),
                            parent_span_id=b"\x00" * 7 + b"\x09" if i else b"", name=f"chat {tag}-{i}", kind=3,
                            start_time_unix_nano=1_700_000_000_000_000_000 + i,
                            end_time_unix_nano=1_700_000_000_500_000_000)
        span.status.code = 2 if i else 1
        for key, value in ((sc.GEN_AI_OPERATION_NAME, "chat"), (sc.GEN_AI_USAGE_INPUT_TOKENS, 12),
                           (sc.GEN_AI_REQUEST_TEMPERATURE, 0.7), (sc.PROMPT_TOKEN_IDS, sc.encode_ids([1, 2, 3])),
                           (sc.COMPLETION_TOKEN_IDS, [sc.encode_ids([4]), sc.encode_ids([5, 6])]),
                           (sc.COMPLETION_LOGPROBS, sc.encode_floats([-0.5])), (sc.REWARD, 1.0),
                           (sc.GEN_AI_RESPONSE_FINISH_REASONS, ["stop"]), ("nested", {"a": [1, {"b": True}]})):
            span.attributes.add(key=key, value=_any(value))
        span.events.add(time_unix_nano=1_700_000_000_100_000_000, name="ev").attributes.add(key="k", value=_any("v"))
        span.links.add(trace_id=b"\x07" * 16, span_id=b"\x08" * 8).attributes.add(key="l", value=_any(1))
    return request


def logs_request(tag: int) -> ExportLogsServiceRequest:
    request = ExportLogsServiceRequest()
    rl = request.resource_logs.add()
    rl.resource.attributes.add(key="service.name", value=_any("fuzz"))
    sl = rl.scope_logs.add()
    record = sl.log_records.add(time_unix_nano=1_700_000_000_000_000_000, severity_number=9, severity_text="INFO",
                                event_name="gen_ai.choice", trace_id=tag.to_bytes(16, "big"), span_id=b"\x01" * 8)
    record.body.CopyFrom(_any({"message": {"role": "assistant", "content": "hi"}, "index": 0}))
    record.attributes.add(key=sc.ROLLOUT_ID, value=_any(f"r-{tag}"))
    return request


TRACE_SEEDS = [trace_request(t, n).SerializeToString() for t, n in ((1, 1), (2, 2), (3, 3))]
LOGS_SEEDS = [logs_request(t).SerializeToString() for t in (1, 2)]
JSON_SEED = {"resourceSpans": [{
    "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "fuzz"}},
                                {"key": sc.ROLLOUT_ID, "value": {"intValue": "42"}}]},
    "scopeSpans": [{"scope": {"name": "fuzz.json"}, "spans": [{
        "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
        "parentSpanId": "eee19b7ec3c1b175", "name": "chat", "kind": 3,
        "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000001000000000",
        "status": {"code": 2, "message": "x"},
        "attributes": [
            {"key": sc.GEN_AI_USAGE_INPUT_TOKENS, "value": {"intValue": "12"}},
            {"key": sc.GEN_AI_REQUEST_TEMPERATURE, "value": {"doubleValue": 0.5}},
            {"key": sc.PROMPT_TOKEN_IDS, "value": {"bytesValue": "AQAAAAIAAAA="}},
            {"key": "list", "value": {"arrayValue": {"values": [{"boolValue": True}, {"kvlistValue": {"values": [
                {"key": "k", "value": {"stringValue": "v"}}]}}]}}}],
        "events": [{"timeUnixNano": "1700000000500000000", "name": "e", "attributes": []}],
        "links": [{"traceId": "5b8efff798038103d269b633813fc60d", "spanId": "eee19b7ec3c1b176"}]}]}]}]}


# --- strategies ------------------------------------------------------------------------------------

@st.composite
def mutated(draw, seeds: list[bytes]) -> bytes:
    """A valid request with 1-6 byte-level mutations: flips, inserts, deletes, truncation,
    and runs of 0xff (varints and lengths that never end or claim gigabytes)."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "varint"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 64))]
        elif op == "truncate":
            del data[pos:]
        elif op == "varint":
            data[pos:pos] = b"\xff" * draw(st.integers(1, 11))
    return bytes(data)


# attribute keys the flattener reads: a wrong type or size under one of these must not break it
KEYS = sorted({key for key, _, _ in otlp._PROMOTED} | {"service.name", otlp_logs.EVENT_NAME, "other"})
_ids = st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=20), st.just(bytes(16)), st.just(b""))
_u64 = st.one_of(st.integers(0, (1 << 64) - 1), st.sampled_from([0, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]))
_scalar_values = st.one_of(
    st.builds(AnyValue), st.text(max_size=20).map(lambda v: AnyValue(string_value=v)),
    st.booleans().map(lambda v: AnyValue(bool_value=v)),
    st.integers(-(1 << 63), (1 << 63) - 1).map(lambda v: AnyValue(int_value=v)),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda v: AnyValue(double_value=v)),
    st.binary(max_size=21).map(lambda v: AnyValue(bytes_value=v)))


def _array(values: list) -> AnyValue:
    out = AnyValue()
    out.array_value.values.extend(values)
    return out


def _kvlist(items: list) -> AnyValue:
    out = AnyValue()
    for key, value in items:
        out.kvlist_value.values.add(key=key, value=value)
    return out


any_values = st.recursive(_scalar_values, lambda inner: st.one_of(
    st.lists(inner, max_size=3).map(_array), st.lists(st.tuples(st.text(max_size=8), inner), max_size=3).map(_kvlist)),
    max_leaves=8)
attributes = st.lists(st.tuples(st.one_of(st.sampled_from(KEYS), st.text(max_size=10)), any_values), max_size=6)


def _fill(repeated_kv, items) -> None:
    for key, value in items:
        repeated_kv.add(key=key, value=value)


@st.composite
def structured_traces(draw) -> bytes:
    """A well-formed protobuf whose field values are anything their types allow: ids of any
    length (or zero), times past int64, unknown enums, attributes of every AnyValue kind under
    the keys the flattener promotes (token ids of odd byte lengths, NaN rewards, ...)."""
    request = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(1, 2))):
        rs = request.resource_spans.add()
        _fill(rs.resource.attributes, draw(attributes))
        ss = rs.scope_spans.add()
        ss.scope.name = draw(st.text(max_size=10))
        for _ in range(draw(st.integers(0, 3))):
            span = ss.spans.add(trace_id=draw(_ids), span_id=draw(_ids)[:draw(st.sampled_from([8, 8, 9, 0]))],
                                parent_span_id=draw(_ids)[:draw(st.sampled_from([0, 8, 5]))], name=draw(st.text(max_size=10)),
                                kind=draw(st.integers(-3, 9)), start_time_unix_nano=draw(_u64),
                                end_time_unix_nano=draw(_u64))
            span.status.code = draw(st.integers(-1, 5))
            span.status.message = draw(st.text(max_size=10))
            _fill(span.attributes, draw(attributes))
            for _ in range(draw(st.integers(0, 2))):
                event = span.events.add(time_unix_nano=draw(_u64), name=draw(st.text(max_size=6)))
                _fill(event.attributes, draw(attributes))
            for _ in range(draw(st.integers(0, 1))):
                link = span.links.add(trace_id=draw(_ids), span_id=draw(_ids)[:8])
                _fill(link.attributes, draw(attributes))
    return request.SerializeToString()


@st.composite
def structured_logs(draw) -> bytes:
    request = ExportLogsServiceRequest()
    rl = request.resource_logs.add()
    _fill(rl.resource.attributes, draw(attributes))
    sl = rl.scope_logs.add()
    sl.scope.name = draw(st.text(max_size=10))
    for _ in range(draw(st.integers(0, 3))):
        record = sl.log_records.add(time_unix_nano=draw(_u64), observed_time_unix_nano=draw(_u64),
                                    severity_number=draw(st.integers(-2, 30)), severity_text=draw(st.text(max_size=6)),
                                    event_name=draw(st.text(max_size=8)), trace_id=draw(_ids),
                                    span_id=draw(_ids)[:draw(st.sampled_from([8, 0, 3]))])
        if draw(st.booleans()):
            record.body.CopyFrom(draw(any_values))
        _fill(record.attributes, draw(attributes))
    return request.SerializeToString()


def protobuf_bodies(seeds: list[bytes]):
    structured = structured_traces() if seeds is TRACE_SEEDS else structured_logs()
    return st.one_of(structured, structured, mutated(seeds), st.binary(max_size=512),
                     st.sampled_from(seeds).map(lambda s: s[: len(s) // 2]), st.sampled_from(seeds))


def _hex_ids(node):
    """protobuf's JSON mapping (base64 ids) → OTLP/JSON (hex ids)."""
    if isinstance(node, dict):
        return {k: (base64.b64decode(v).hex() if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str)
                    else _hex_ids(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_hex_ids(v) for v in node]
    return node


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=True),
                       st.text(max_size=40), st.sampled_from(["", "zz", "0" * 31, "0" * 32, "ff" * 16, "1e400",
                                                              "NaN", "-1", "18446744073709551616", "9" * 30]))
_json_any = st.recursive(_json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                         max_leaves=12)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, prefix + (i,))


def _deep(depth: int) -> dict:
    value = {"stringValue": "bottom"}
    for _ in range(depth):
        value = {"arrayValue": {"values": [value]}}
    return value


@st.composite
def json_bodies(draw) -> bytes:
    """OTLP/JSON with random subtrees replaced: bad hex ids, wrong types, huge numbers, deep
    nesting; or text that is not JSON at all."""
    kind = draw(st.sampled_from(["structured", "structured", "mutate", "mutate", "deep", "raw"]))
    if kind == "structured":   # every field value its type allows, written as OTLP/JSON
        request = ExportTraceServiceRequest.FromString(draw(structured_traces()))
        return json.dumps(_hex_ids(json_format.MessageToDict(request))).encode()
    if kind == "raw":
        return draw(st.one_of(st.binary(max_size=200), st.sampled_from([
            b"[" * 100_000, b'{"resourceSpans": ' + b"[" * 5000, b"1" * 5000, b"\xff\xfe{}", b"null", b"[]",
            b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": ' + b"9" * 5000 + b"}]}]}]}"])))
    doc = json.loads(json.dumps(JSON_SEED))
    if kind == "deep":
        attrs = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]
        attrs.append({"key": "deep", "value": _deep(draw(st.integers(1, 300)))})
    else:
        paths = list(_paths(doc))
        for _ in range(draw(st.integers(1, 4))):
            path = draw(st.sampled_from(paths[1:]))
            node = doc
            try:
                for key in path[:-1]:
                    node = node[key]
                node[path[-1]] = draw(_json_any)
            except (KeyError, IndexError, TypeError):   # an earlier replacement removed the path
                continue
    return json.dumps(doc).encode()   # allow_nan: NaN / Infinity tokens, which Python's json reads


@st.composite
def http_cases(draw) -> tuple[str, bytes, dict]:
    signal = draw(st.sampled_from(["traces", "traces", "traces", "logs"]))
    content_type = draw(st.sampled_from([PROTOBUF, PROTOBUF, JSON, JSON, "application/x-protobuf; charset=x",
                                         "text/plain", "", "application/grpc", "APPLICATION/JSON"]))
    if content_type.lower().startswith(JSON) and signal == "traces":
        body = draw(json_bodies())
    elif content_type.lower().startswith(JSON):
        body = draw(st.one_of(st.binary(max_size=200), st.just(b'{"resourceLogs": [{"scopeLogs": [{"logRecords": '
                                                               b'[{"traceId": "xyz"}]}]}]}')))
    else:
        body = draw(protobuf_bodies(TRACE_SEEDS if signal == "traces" else LOGS_SEEDS))
    headers = {"Content-Type": content_type}
    encoding = draw(st.sampled_from(["identity", "identity", "gzip", "gzip-broken", "deflate", "br", "gzip-bomb"]))
    if encoding == "gzip":
        body = gzip.compress(body)
    elif encoding == "gzip-broken":
        body = draw(mutated([gzip.compress(body)]))
        encoding = "gzip"
    elif encoding == "deflate":
        body = zlib.compress(body)
    elif encoding == "gzip-bomb":              # small on the wire, past the cap once inflated
        body, encoding = gzip.compress(b"\x00" * (BODY_CAP + 1)), "gzip"
    if encoding != "identity":
        headers["Content-Encoding"] = encoding
    return signal, body, headers


# --- the collector under fuzz -------------------------------------------------------------------

@pytest.fixture
def fuzzed(collector_factory, caplog):
    """A running collector; afterwards, no error was logged by it or by gRPC's server."""
    caplog.set_level(logging.WARNING)
    collector = collector_factory(max_http_body_bytes=BODY_CAP)
    yield collector
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR
              and r.name.startswith(("lightspan", "grpc"))]
    assert errors == [], [r.getMessage() for r in errors[:3]]


class Valid:
    """Valid requests interleaved with the fuzz: each must be acknowledged, and stored."""

    def __init__(self, first_tag: int):
        self.tags = itertools.count(first_tag)
        self.sent: list[str] = []

    def next(self) -> bytes:
        tag = next(self.tags)
        self.sent.append(tag.to_bytes(16, "big").hex())
        return trace_request(tag, spans=2).SerializeToString()

    def check_stored(self, collector) -> None:
        collector.flush()
        stored = dict(query(collector.data_dir, "SELECT trace_id, count(*) FROM spans GROUP BY 1"))
        assert len(self.sent) >= FUZZ.max_examples // 10
        assert [t for t in self.sent if stored.get(t) != 2] == []


def test_http_fuzz_protobuf_json_gzip_and_content_types(fuzzed):
    url = f"http://127.0.0.1:{fuzzed.http_port}"
    session = requests.Session()
    valid, counter = Valid(1 << 40), itertools.count()

    @FUZZ
    @given(case=http_cases())
    def run(case):
        signal, body, headers = case
        answer = session.post(f"{url}/v1/{signal}", data=body, headers=headers, timeout=10)
        assert answer.status_code in ALLOWED_HTTP, (answer.status_code, answer.text[:300])
        if answer.headers.get("Content-Type") == JSON:
            doc = answer.json()
            assert answer.status_code == 200 or doc["message"]
        elif answer.status_code == 200:
            response = (ExportTraceServiceResponse if signal == "traces" else ExportLogsServiceResponse)
            response.FromString(answer.content)
        else:
            assert status_pb2.Status.FromString(answer.content).message
        if next(counter) % 10 == 0:
            ok = session.post(f"{url}/v1/traces", data=valid.next(), headers={"Content-Type": PROTOBUF}, timeout=10)
            assert ok.status_code == 200 and not ExportTraceServiceResponse.FromString(ok.content).HasField(
                "partial_success")

    run()
    valid.check_stored(fuzzed)
    refused = fuzzed.metrics.snapshot()["requests_refused_total"]
    assert refused["invalid"] > 100 and refused["too_large"] > 0 and refused["unsupported"] > 0


def test_grpc_fuzz_traces_and_logs(fuzzed):
    channel = grpc.insecure_channel(f"127.0.0.1:{fuzzed.grpc_port}")
    methods = {"traces": channel.unary_unary(EXPORT_METHOD), "logs": channel.unary_unary(LOGS_EXPORT_METHOD)}
    valid, counter, codes = Valid(1 << 41), itertools.count(), set()

    @FUZZ
    @given(signal=st.sampled_from(["traces", "traces", "logs"]), data=st.data())
    def run(signal, data):
        body = data.draw(protobuf_bodies(TRACE_SEEDS if signal == "traces" else LOGS_SEEDS))
        try:
            answer = methods[signal](body, timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()
            assert error.details()
        assert code in ALLOWED_GRPC, code
        codes.add(code)
        if code == grpc.StatusCode.OK:
            (ExportTraceServiceResponse if signal == "traces" else ExportLogsServiceResponse).FromString(answer)
        if next(counter) % 10 == 0:
            response = ExportTraceServiceResponse.FromString(methods["traces"](valid.next(), timeout=10))
            assert not response.HasField("partial_success")

    try:
        run()
    finally:
        channel.close()
    valid.check_stored(fuzzed)
    assert codes == ALLOWED_GRPC
    snapshot = fuzzed.metrics.snapshot()     # the fuzz reached the flattener, not only the parser
    assert snapshot["spans_rejected_total"] > 100 and snapshot["spans_accepted_total"] > len(valid.sent) * 2  # some fuzzed spans stored too
    assert snapshot["log_records_rejected_total"] > 10 and snapshot["log_records_accepted_total"] > 10


@settings(max_examples=500, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(body=st.one_of(structured_traces(), mutated(TRACE_SEEDS)))
def test_check_accepts_exactly_what_flatten_converts(body):
    """The receivers answer with otlp.check and the writer flattens later: an acknowledged span
    that failed to flatten would be lost, so the two must agree on every span."""
    try:
        request = otlp_parse.parse_protobuf_request(body)
    except otlp_parse.DecodeError:
        return
    table, rejected, first_error = otlp.flatten(request, 1)
    accepted, checked_rejected, checked_error, warning, claims = otlp.check(request)
    assert (accepted, checked_rejected, checked_error) == (table.num_rows, rejected, first_error)
    unusable = table.column("capture_status").to_pylist().count(otlp.INVALID_LOGPROBS)
    if unusable:                 # named first in the warning
        assert warning.startswith(f"{unusable} span(s) stored with capture status {otlp.INVALID_LOGPROBS}")
    else:
        assert otlp.INVALID_LOGPROBS not in (warning or "")
    # a reward source claimed outside the API's scope: counted by check, set aside by flatten
    claimed = sum(any(k == "lightspan.reward.claimed_source" for k, _ in attrs)
                  for attrs in table.column("attributes").to_pylist())
    assert claims == claimed and (claims == 0) == ("lightspan.reward.source" not in (warning or ""))
