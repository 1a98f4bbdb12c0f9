"""collector/otlp.py: OTLP requests → SPAN_SCHEMA rows, built by hand."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from lightspan.collector import otlp, otlp_parse
from lightspan.store import SPAN_SCHEMA
from lightspan.tracing import semconv as sc

TRACE = bytes(range(1, 17))
RECEIVED = 1_700_000_000_000_000_000


def any_value(v) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, str):
        return AnyValue(string_value=v)
    if isinstance(v, bytes):
        return AnyValue(bytes_value=v)
    if isinstance(v, list):
        out = AnyValue()
        out.array_value.values.extend(any_value(x) for x in v)
        return out
    if isinstance(v, dict):
        out = AnyValue()
        out.kvlist_value.values.extend(KeyValue(key=k, value=any_value(x)) for k, x in v.items())
        return out
    raise TypeError(v)


def kvs(attrs: dict) -> list[KeyValue]:
    return [KeyValue(key=k, value=any_value(v)) for k, v in attrs.items()]


def span(n: int, attrs: dict | None = None, *, trace_id=TRACE, parent: bytes = b"", **fields) -> trace_pb2.Span:
    s = trace_pb2.Span(trace_id=trace_id, span_id=fields.pop("span_id", bytes([0, 0, 0, 0, 0, 0, 0, n])),
                       parent_span_id=parent, name=fields.pop("name", f"span{n}"),
                       start_time_unix_nano=1_000 * n, end_time_unix_nano=1_000 * n + 500, **fields)
    s.attributes.extend(kvs(attrs or {}))
    return s


def request(spans, resource: dict | None = None, scope: str = "test.scope") -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.extend(kvs(resource or {}))
    ss = rs.scope_spans.add()
    ss.scope.name = scope
    ss.spans.extend(spans)
    return req


def rows(req) -> tuple[list[dict], int, str | None]:
    table, rejected, error = otlp.flatten(req, RECEIVED)
    assert table.schema == SPAN_SCHEMA
    return table.to_pylist(), rejected, error


def test_promoted_columns_leave_the_rest_in_attributes():
    attrs = {
        sc.GEN_AI_OPERATION_NAME: "chat", sc.GEN_AI_REQUEST_MODEL: "m-req", sc.GEN_AI_RESPONSE_MODEL: "m-resp",
        sc.GEN_AI_USAGE_INPUT_TOKENS: 3, sc.GEN_AI_USAGE_OUTPUT_TOKENS: 2,
        sc.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"], sc.GEN_AI_AGENT_NAME: "solver",
        sc.GEN_AI_INPUT_MESSAGES: '[{"role":"user"}]', sc.GEN_AI_OUTPUT_MESSAGES: '[{"role":"assistant"}]',
        sc.PROMPT_TOKEN_IDS: sc.encode_ids([1, 2, 70000]), sc.COMPLETION_TOKEN_IDS: sc.encode_ids([5, 6]),
        sc.COMPLETION_LOGPROBS: sc.encode_floats([-0.5, -0.25]), sc.MODEL_VERSION: 7,
        sc.CAPTURE_STATUS: "ok", sc.REWARD: 1, sc.REWARD_NAME: "exact", "custom.key": "kept",
    }
    resource = {sc.SERVICE_NAME: "agent", sc.ROLLOUT_ID: "r1", sc.TASK_ID: "t1", sc.SPLIT: "train",
                "host.name": "box"}
    [row], rejected, error = rows(request([span(1, attrs)], resource))
    assert (rejected, error) == (0, None)
    assert row["trace_id"] == TRACE.hex() and row["span_id"] == "0000000000000001"
    assert row["parent_span_id"] is None and row["scope_name"] == "test.scope"
    assert (row["service_name"], row["rollout_id"], row["task_id"], row["split"]) == ("agent", "r1", "t1", "train")
    assert (row["operation_name"], row["request_model"], row["response_model"]) == ("chat", "m-req", "m-resp")
    assert (row["input_tokens"], row["output_tokens"], row["finish_reasons"]) == (3, 2, ["stop"])
    assert row["agent_name"] == "solver" and row["input_messages"] == '[{"role":"user"}]'
    assert row["output_messages"] == '[{"role":"assistant"}]'
    assert row["prompt_token_ids"] == [1, 2, 70000]
    assert row["completion_token_ids"] == [5, 6] and row["completion_logprobs"] == [-0.5, -0.25]
    assert row["num_choices"] == 1 and row["model_version"] == 7 and row["capture_status"] == "ok"
    assert row["reward"] == 1.0 and isinstance(row["reward"], float) and row["reward_name"] == "exact"
    assert row["received_unix_nano"] == RECEIVED
    assert row["attributes"] == [("custom.key", '"kept"')]
    assert dict(row["resource_attributes"]) == {"host.name": '"box"'}


def test_span_attribute_wins_over_resource_and_keeps_resource_value_visible():
    resource = {sc.ROLLOUT_ID: "from-resource", sc.TASK_ID: "task"}
    out, _, _ = rows(request([span(1, {sc.ROLLOUT_ID: "from-span"}), span(2)], resource))
    by_name = {r["name"]: r for r in out}
    assert by_name["span1"]["rollout_id"] == "from-span"
    assert by_name["span1"]["task_id"] == "task"
    assert dict(by_name["span1"]["resource_attributes"])[sc.ROLLOUT_ID] == '"from-resource"'
    assert by_name["span2"]["rollout_id"] == "from-resource"
    assert sc.ROLLOUT_ID not in dict(by_name["span2"]["resource_attributes"])
    assert by_name["span1"]["attributes"] == []


def test_traceloop_names_are_fallbacks_only():
    old_only = {otlp.LLM_REQUEST_TYPE: "chat", sc.GEN_AI_USAGE_PROMPT_TOKENS: 11,
                sc.GEN_AI_USAGE_COMPLETION_TOKENS: 4}
    both = {sc.GEN_AI_OPERATION_NAME: "text_completion", otlp.LLM_REQUEST_TYPE: "completion",
            sc.GEN_AI_USAGE_INPUT_TOKENS: 9, sc.GEN_AI_USAGE_PROMPT_TOKENS: 8}
    out, _, _ = rows(request([span(1, old_only), span(2, both)]))
    first, second = out
    assert (first["operation_name"], first["input_tokens"], first["output_tokens"]) == ("chat", 11, 4)
    assert first["attributes"] == []
    assert (second["operation_name"], second["input_tokens"]) == ("text_completion", 9)
    # the older name did not fill the column, so it stays an ordinary attribute
    assert dict(second["attributes"]) == {otlp.LLM_REQUEST_TYPE: '"completion"', sc.GEN_AI_USAGE_PROMPT_TOKENS: "8"}


def test_completion_choices_promote_choice_zero_and_keep_the_others():
    choices = [sc.encode_ids([10, 11, 12]), sc.encode_ids([20])]
    logprobs = [sc.encode_floats([-1.0, -2.0, -3.0]), sc.encode_floats([-4.0])]
    [row], rejected, _ = rows(request([span(1, {sc.COMPLETION_TOKEN_IDS: choices, sc.COMPLETION_LOGPROBS: logprobs})]))
    assert rejected == 0
    assert row["completion_token_ids"] == [10, 11, 12]
    assert row["completion_logprobs"] == [-1.0, -2.0, -3.0]
    assert row["num_choices"] == 2
    kept = dict(row["attributes"])
    assert [base64.b64decode(x) for x in json.loads(kept[sc.COMPLETION_TOKEN_IDS])] == choices


def test_malformed_token_bytes_reject_only_that_span():
    bad = span(2, {sc.PROMPT_TOKEN_IDS: b"\x01\x02\x03\x04\x05"})
    bad_choice = span(3, {sc.COMPLETION_LOGPROBS: [sc.encode_floats([1.0]), b"\x00\x00"]})
    out, rejected, error = rows(request([span(1, {sc.PROMPT_TOKEN_IDS: sc.encode_ids([1])}), bad, bad_choice]))
    assert rejected == 2
    assert [r["name"] for r in out] == ["span1"] and out[0]["prompt_token_ids"] == [1]
    assert sc.PROMPT_TOKEN_IDS in error and "multiple of 4" in error and "spans[1]" in error


@pytest.mark.parametrize("fields, problem", [
    ({"trace_id": TRACE[:15]}, "trace_id has 15 bytes"),
    ({"trace_id": bytes(16)}, "trace_id is all zeros"),
    ({"span_id": b""}, "span_id has 0 bytes"),
    ({"parent": b"\x01\x02\x03"}, "parent_span_id has 3 bytes"),
])
def test_bad_ids_reject_the_span_and_keep_siblings(fields, problem):
    out, rejected, error = rows(request([span(1), span(2, **fields), span(3)]))
    assert rejected == 1 and problem in error
    assert [r["name"] for r in out] == ["span1", "span3"]


def test_wrongly_typed_promoted_attribute_stays_in_attributes():
    [row], rejected, _ = rows(request([span(1, {sc.GEN_AI_USAGE_INPUT_TOKENS: "12", sc.PROMPT_TOKEN_IDS: [1, 2],
                                                sc.REWARD: "high"})]))
    assert rejected == 0
    assert row["input_tokens"] is None and row["prompt_token_ids"] is None and row["reward"] is None
    assert dict(row["attributes"]) == {sc.GEN_AI_USAGE_INPUT_TOKENS: '"12"', sc.PROMPT_TOKEN_IDS: "[1,2]",
                                       sc.REWARD: '"high"'}


def test_kind_status_events_links_and_json_values():
    s = span(1, {"b": b"\xff\x00", "arr": [1, "x", True], "kv": {"n": 1.5}, "nan": float("nan")},
             parent=bytes([9] * 8), kind=trace_pb2.Span.SPAN_KIND_CLIENT)
    s.status.code = trace_pb2.Status.STATUS_CODE_ERROR
    s.status.message = "boom"
    event = s.events.add(time_unix_nano=1234, name="retry")
    event.attributes.extend(kvs({"attempt": 2}))
    link = s.links.add(trace_id=bytes([0xAB] * 16), span_id=bytes([0xCD] * 8))
    link.attributes.extend(kvs({"why": "follows"}))
    unspecified = span(2, kind=trace_pb2.Span.SPAN_KIND_UNSPECIFIED)
    first, second = rows(request([s, unspecified]))[0]
    assert (first["kind"], first["status_code"], first["status_message"]) == ("CLIENT", "ERROR", "boom")
    assert first["parent_span_id"] == "09" * 8
    assert first["events"] == [{"time_unix_nano": 1234, "name": "retry", "attributes": '{"attempt":2}'}]
    assert first["links"] == [{"trace_id": "ab" * 16, "span_id": "cd" * 8, "attributes": '{"why":"follows"}'}]
    attrs = {k: json.loads(v) for k, v in first["attributes"]}
    assert attrs == {"b": base64.b64encode(b"\xff\x00").decode(), "arr": [1, "x", True], "kv": {"n": 1.5}, "nan": "NaN"}
    assert (second["kind"], second["status_code"], second["status_message"]) == ("INTERNAL", "UNSET", None)


def test_empty_request_is_an_empty_table():
    table, rejected, error = otlp.flatten(ExportTraceServiceRequest(), RECEIVED)
    assert (table.num_rows, rejected, error) == (0, 0, None) and table.schema == SPAN_SCHEMA


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(-2**31, 2**31 - 1), max_size=20), min_size=1, max_size=8))
def test_token_ids_round_trip(id_lists):
    spans = [span(i + 1, {sc.PROMPT_TOKEN_IDS: sc.encode_ids(ids)}) for i, ids in enumerate(id_lists)]
    out, rejected, _ = rows(request(spans))
    assert rejected == 0 and [r["prompt_token_ids"] for r in out] == id_lists


# --- OTLP/JSON ----------------------------------------------------------------------------------

def json_body(**span_overrides) -> bytes:
    s = {"traceId": "5B8EFFF798038103D269B633813FC60C", "spanId": "EEE19B7EC3C1B174",
         "parentSpanId": "EEE19B7EC3C1B173", "name": "chat", "kind": 3,
         "startTimeUnixNano": "1544712660000000000", "endTimeUnixNano": 1544712661000000000,
         "attributes": [{"key": sc.GEN_AI_USAGE_INPUT_TOKENS, "value": {"intValue": "42"}},
                        {"key": sc.PROMPT_TOKEN_IDS, "value": {"bytesValue": base64.b64encode(sc.encode_ids([7, 8])).decode()}}],
         "links": [{"traceId": "00" * 15 + "01", "spanId": "00" * 7 + "02"}],
         "status": {"code": 2}, "someFutureField": {"x": 1}}
    s.update(span_overrides)
    return json.dumps({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "js-agent"}}]},
        "scopeSpans": [{"scope": {"name": "js"}, "spans": [s]}]}]}).encode()


def test_parse_json_request_hex_ids_integer_enums_unknown_fields():
    req = otlp_parse.parse_json_request(json_body())
    [row], rejected, _ = rows(req)
    assert rejected == 0
    assert row["trace_id"] == "5b8efff798038103d269b633813fc60c"
    assert (row["span_id"], row["parent_span_id"]) == ("eee19b7ec3c1b174", "eee19b7ec3c1b173")
    assert (row["kind"], row["status_code"], row["service_name"]) == ("CLIENT", "ERROR", "js-agent")
    assert row["start_time_unix_nano"] == 1544712660000000000 and row["input_tokens"] == 42
    assert row["prompt_token_ids"] == [7, 8]
    assert row["links"][0]["trace_id"] == "00" * 15 + "01"


def test_parse_json_request_bad_id_length_is_a_span_rejection():
    [], rejected, error = rows(otlp_parse.parse_json_request(json_body(spanId="abcd")))
    assert rejected == 1 and "span_id has 2 bytes" in error


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b"\xff\xfe", json_body(traceId="zz" * 16),
                                  b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": 5, "kind": "nope"}]}]}]}',
                                  b'{"resourceSpans": "x"}'])
def test_parse_json_request_rejects_what_is_not_otlp(body):
    with pytest.raises(otlp_parse.DecodeError):
        otlp_parse.parse_json_request(body)


def test_parse_protobuf_request_rejects_garbage():
    with pytest.raises(otlp_parse.DecodeError):
        otlp_parse.parse_protobuf_request(b"\xff\xff\xff\xff")
    assert otlp_parse.parse_protobuf_request(request([span(1)]).SerializeToString()).resource_spans
