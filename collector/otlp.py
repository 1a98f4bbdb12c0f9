"""OTLP requests → rows of :data:`~lightspan.store.SPAN_SCHEMA`. Pure functions.

:func:`flatten` turns one ``ExportTraceServiceRequest`` into an Arrow table, one row per span;
:mod:`lightspan.collector.otlp_logs` does the same for an ``ExportLogsServiceRequest`` (GenAI
events sent through the logs signal), one row per log record.
What readers filter or join on is promoted to typed columns (docs/architecture.md, "Storage"); every other
attribute is kept, JSON-encoded, in the ``attributes`` / ``resource_attributes`` maps.

Malformed input never raises in the middle of a batch: a span with a bad id, with token-id
bytes whose length is not a multiple of 4, or with a token-id attribute that appears twice (which
one is the call's?) is rejected and counted, its siblings are kept (OTLP ``partial_success``).
A span whose logprobs hold NaN or an infinity is stored without them, with capture status
``invalid_logprobs`` (:data:`INVALID_LOGPROBS`), and the answer carries a warning: the call stays
visible, and the transition builder treats it like any call whose capture failed (no token ids
and logprobs to train on) instead of a rollout silently missing one of its calls. A promoted attribute of an unexpected type (say, a string where
an int belongs) is not promoted and stays in ``attributes``, so nothing is lost.

A span that claims a reward's source (``lightspan.reward.source``) outside the API's reward scope
is stored with the claim set aside as ``lightspan.reward.claimed_source`` and counted: a reward's
source is the collector's to say (:mod:`lightspan.collector.reward_integrity`).

Token ids and logprobs arrive as little-endian int32/float32 bytes (``semconv.encode_ids``);
they are decoded with one ``numpy.frombuffer`` per batch instead of per-span Python lists.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from lightspan.collector.otlp_values import (_INT64_MAX, _choices, _dumps, _float, _int, _json_object, _Keep, _packed, _py,
                                             _Reject, _str, _str_list)
from lightspan.store import SPAN_SCHEMA
from lightspan.store.schema import REWARD_SCOPE
from lightspan.tracing import semconv as sc

# traceloop's instrumentation names the operation here when gen_ai.operation.name is absent
LLM_REQUEST_TYPE = sc.LLM_REQUEST_TYPE

_KIND = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}  # 0 = unspecified
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}
_ZERO_TRACE, _ZERO_SPAN = bytes(16), bytes(8)
INVALID_LOGPROBS = "invalid_logprobs"   # lightspan.capture.status of a span stored without its logprobs


# (attribute, column, converter): the first attribute that converts fills the column, so a
# GenAI-convention name (v0.1.0) wins over the older name that follows it (semconv.RENAMED).
_PROMOTED = [
    (sc.ROLLOUT_ID, "rollout_id", _str),
    (sc.TASK_ID, "task_id", _str),
    (sc.SPLIT, "split", _str),
    (sc.GEN_AI_OPERATION_NAME, "operation_name", _str),
    (LLM_REQUEST_TYPE, "operation_name", _str),
    (sc.GEN_AI_REQUEST_MODEL, "request_model", _str),
    (sc.GEN_AI_RESPONSE_MODEL, "response_model", _str),
    (sc.GEN_AI_REQUEST_TEMPERATURE, "temperature", _float),
    (sc.GEN_AI_USAGE_INPUT_TOKENS, "input_tokens", _int),
    (sc.GEN_AI_USAGE_PROMPT_TOKENS, "input_tokens", _int),
    (sc.GEN_AI_USAGE_OUTPUT_TOKENS, "output_tokens", _int),
    (sc.GEN_AI_USAGE_COMPLETION_TOKENS, "output_tokens", _int),
    (sc.GEN_AI_RESPONSE_FINISH_REASONS, "finish_reasons", _str_list),
    (sc.GEN_AI_AGENT_NAME, "agent_name", _str),
    (sc.GEN_AI_WORKFLOW_NAME, "agent_name", _str),       # an invoke_workflow span's, before v0.1.0
    (sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, "cache_read_input_tokens", _int),
    (sc.RENAMED[sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS], "cache_read_input_tokens", _int),
    (sc.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS, "cache_creation_input_tokens", _int),
    (sc.RENAMED[sc.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS], "cache_creation_input_tokens", _int),
    (sc.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS, "reasoning_output_tokens", _int),
    (sc.RENAMED[sc.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS], "reasoning_output_tokens", _int),
    (sc.GEN_AI_INPUT_MESSAGES, "input_messages", _str),
    (sc.GEN_AI_OUTPUT_MESSAGES, "output_messages", _str),
    (sc.PROMPT_TOKEN_IDS, "prompt_token_ids", _packed),
    (sc.COMPLETION_TOKEN_IDS, "completion_token_ids", _choices),
    (sc.COMPLETION_LOGPROBS, "completion_logprobs", _choices),
    (sc.MODEL_VERSION, "model_version", _int),
    (sc.POLICY_NAME, "policy", _str),
    (sc.CAPTURE_STATUS, "capture_status", _str),
    (sc.REWARD, "reward", _float),
    (sc.REWARD_NAME, "reward_name", _str),
]
# grouping columns that fall back to the resource; service_name comes only from the resource
_FROM_RESOURCE = [(sc.ROLLOUT_ID, "rollout_id"), (sc.TASK_ID, "task_id"), (sc.SPLIT, "split"),
                  (sc.SERVICE_NAME, "service_name")]
_PACKED_COLUMNS = {"prompt_token_ids": "<i4", "completion_token_ids": "<i4", "completion_logprobs": "<f4"}
_COLUMNS = [f.name for f in SPAN_SCHEMA]


def _attributes(span) -> dict:
    """The span's attributes by key; rejects a span on which a token-id or logprob attribute
    appears more than once (which one would be the call's?)."""
    attrs = {kv.key: kv.value for kv in span.attributes}
    if len(attrs) != len(span.attributes):
        seen = set()
        for kv in span.attributes:
            if kv.key in _PACKED_KEYS and kv.key in seen:
                raise _Reject(f"attribute {kv.key} appears more than once")
            seen.add(kv.key)
    return attrs


def _logprob_chunks(value: AnyValue) -> list[bytes]:
    """The float32 bytes of every choice's logprobs."""
    kind = value.WhichOneof("value")
    if kind == "bytes_value":
        return [value.bytes_value]
    if kind == "array_value":
        return [v.bytes_value for v in value.array_value.values if v.WhichOneof("value") == "bytes_value"]
    return []


def _all_finite(chunks: list[bytes]) -> bool:
    """Whether every float32 in ``chunks`` is finite: one numpy pass for a whole request."""
    data = b"".join(c for c in chunks if len(c) % 4 == 0)
    return bool(np.isfinite(np.frombuffer(data, dtype="<f4")).all())


def _unusable(row: dict, attrs: dict) -> None:
    """A row whose logprobs hold NaN or an infinity: stored without them, as INVALID_LOGPROBS; the
    raw value (and the agent's own capture status) stay in ``attributes``."""
    row["completion_logprobs"] = None
    row["capture_status"] = INVALID_LOGPROBS
    kept = {key for key, _ in row["attributes"]}
    row["attributes"] = row["attributes"] + [(key, _dumps(_py(attrs[key])))
                                             for key in (sc.COMPLETION_LOGPROBS, sc.CAPTURE_STATUS)
                                             if key in attrs and key not in kept]


def _id(data: bytes, what: str, size: int, zero: bytes) -> str:
    if len(data) != size:
        raise _Reject(f"{what} has {len(data)} bytes, want {size}")
    if data == zero:
        raise _Reject(f"{what} is all zeros")
    return data.hex()


def _time(ns: int, what: str) -> int:
    if ns > _INT64_MAX:
        raise _Reject(f"{what} {ns} does not fit int64 nanoseconds")
    return ns


def _span_row(span, scope_name: str, resource: dict, received_unix_nano: int) -> tuple[dict, dict]:
    """One row as a column → value dict, and the span's attributes. Raises _Reject for a malformed span."""
    row = {
        "trace_id": _id(span.trace_id, "trace_id", 16, _ZERO_TRACE),
        "span_id": _id(span.span_id, "span_id", 8, _ZERO_SPAN),
        "parent_span_id": (_id(span.parent_span_id, "parent_span_id", 8, _ZERO_SPAN)
                           if span.parent_span_id else None),
        "name": span.name,
        "kind": _KIND.get(span.kind, "INTERNAL"),  # the spec lets receivers read UNSPECIFIED as INTERNAL
        "scope_name": scope_name or None,
        "start_time_unix_nano": _time(span.start_time_unix_nano, "start_time_unix_nano"),
        "end_time_unix_nano": _time(span.end_time_unix_nano, "end_time_unix_nano"),
        "status_code": _STATUS.get(span.status.code, "UNSET"),
        "status_message": span.status.message or None,
        "received_unix_nano": received_unix_nano,
    }
    attrs = _attributes(span)
    if sc.REWARD_SOURCE in attrs and scope_name != REWARD_SCOPE:   # only the API says who gave a reward
        attrs[sc.REWARD_CLAIMED_SOURCE] = attrs.pop(sc.REWARD_SOURCE)
    keep_anyway = set()
    promoted = set()
    for key, column, convert in _PROMOTED:
        if column in row or key not in attrs:
            continue
        try:
            value = convert(attrs[key], key)
        except _Keep:
            continue
        if convert is _choices:
            value, num_choices = value
            if num_choices > 1:
                keep_anyway.add(key)  # the schema holds choice 0; the others stay in attributes
            row.setdefault("num_choices", num_choices)
        row[column] = value
        promoted.add(key)
    promoted -= keep_anyway
    span_grouping = False
    for key, column in _FROM_RESOURCE:
        if column in row:
            span_grouping = span_grouping or column in resource["values"]
        elif column in resource["values"]:
            row[column] = resource["values"][column]
    # a span that overrides a resource grouping attribute keeps the resource's value visible
    row["resource_attributes"] = resource["all"] if span_grouping else resource["rest"]
    row["attributes"] = [(k, _dumps(_py(v))) for k, v in attrs.items() if k not in promoted]
    row["events"] = [{"time_unix_nano": _time(e.time_unix_nano, "event time"), "name": e.name,
                      "attributes": _json_object(e.attributes)} for e in span.events]
    row["links"] = [{"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex(),
                     "attributes": _json_object(link.attributes)} for link in span.links]
    return row, attrs


def _resource(resource_spans) -> dict:
    attrs = {kv.key: kv.value for kv in resource_spans.resource.attributes}
    values, used = {}, set()
    for key, column in _FROM_RESOURCE:
        if key in attrs:
            try:
                values[column] = _str(attrs[key], key)
                used.add(key)
            except _Keep:
                pass
    items = [(k, _dumps(_py(v))) for k, v in attrs.items()]
    return {"values": values, "all": items, "rest": [(k, v) for k, v in items if k not in used]}


def _packed_array(chunks: list, dtype: str, type_: pa.DataType) -> pa.Array:
    """list<int32|float32> from per-row little-endian bytes (None = null) without Python lists."""
    lengths = np.fromiter((len(c) // 4 if c is not None else 0 for c in chunks), dtype=np.int64, count=len(chunks))
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.frombuffer(b"".join(c for c in chunks if c), dtype=dtype).astype(dtype[1:], copy=False)
    mask = pa.array([c is None for c in chunks], type=pa.bool_())
    array = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values), mask=mask)
    return array.cast(type_)


def flatten(request: ExportTraceServiceRequest, received_unix_nano: int) -> tuple[pa.Table, int, str | None]:
    """One row per span in ``SPAN_SCHEMA``; returns (table, spans rejected, first rejection reason)."""
    rows, spans_attrs = [], []
    rejected, first_error = 0, None
    for r, resource_spans in enumerate(request.resource_spans):
        resource = _resource(resource_spans)
        for s, scope_spans in enumerate(resource_spans.scope_spans):
            scope_name = scope_spans.scope.name
            for i, span in enumerate(scope_spans.spans):
                try:
                    row, attrs = _span_row(span, scope_name, resource, received_unix_nano)
                except (_Reject, ValueError, TypeError, OverflowError) as exc:
                    rejected += 1
                    if first_error is None:
                        first_error = f"resource_spans[{r}].scope_spans[{s}].spans[{i}]: {exc}"
                    continue
                rows.append(row)
                spans_attrs.append(attrs)

    def logprobs(row: dict, attrs: dict) -> list[bytes]:   # choice 0 is in the row; more choices are rare
        if (row.get("num_choices") or 1) > 1 and sc.COMPLETION_LOGPROBS in attrs:
            return _logprob_chunks(attrs[sc.COMPLETION_LOGPROBS])
        return [row["completion_logprobs"]] if row.get("completion_logprobs") else []

    if not _all_finite([c for row, attrs in zip(rows, spans_attrs) for c in logprobs(row, attrs)]):
        for row, attrs in zip(rows, spans_attrs):
            if not _all_finite(logprobs(row, attrs)):
                _unusable(row, attrs)
    columns = {name: [row.get(name) for row in rows] for name in _COLUMNS}
    arrays = []
    for field in SPAN_SCHEMA:
        values = columns[field.name]
        if field.name in _PACKED_COLUMNS:
            arrays.append(_packed_array(values, _PACKED_COLUMNS[field.name], field.type))
        else:
            arrays.append(pa.array(values, type=field.type))
    return pa.Table.from_arrays(arrays, schema=SPAN_SCHEMA), rejected, first_error


def _check_span(span) -> tuple[AnyValue | None, bool]:
    """Raise _Reject where :func:`_span_row` would: the same conditions, without building the row;
    returns its logprobs attribute (see :func:`_unusable`) and whether it claims a reward source."""
    _id(span.trace_id, "trace_id", 16, _ZERO_TRACE)
    _id(span.span_id, "span_id", 8, _ZERO_SPAN)
    if span.parent_span_id:
        _id(span.parent_span_id, "parent_span_id", 8, _ZERO_SPAN)
    _time(span.start_time_unix_nano, "start_time_unix_nano")
    _time(span.end_time_unix_nano, "end_time_unix_nano")
    for event in span.events:
        _time(event.time_unix_nano, "event time")
    seen, logprobs, claim = 0, None, False
    for kv in span.attributes:
        key = kv.key
        if key in _WATCHED:          # one lookup per attribute, as before the source was watched
            watched = _WATCHED[key]
            if watched is None:      # lightspan.reward.source
                claim = True
                continue
            convert, bit = watched
            if seen & bit:
                raise _Reject(f"attribute {key} appears more than once")
            seen |= bit
            try:
                convert(kv.value, key)
            except _Keep:   # not promoted: stays in attributes, never trained on
                continue
            if key == sc.COMPLETION_LOGPROBS:
                logprobs = kv.value
    return logprobs, claim


# token-id and logprob keys: (converter, a bit of their own, to find a key given twice)
_PACKED_KEYS = {key: (convert, 1 << n) for n, (key, _, convert) in
                enumerate(p for p in _PROMOTED if p[2] in (_packed, _choices))}
_WATCHED = {**_PACKED_KEYS, sc.REWARD_SOURCE: None}


def check(request: ExportTraceServiceRequest) -> tuple[int, int, str | None, str | None, int]:
    """What :func:`flatten` would accept, at a fraction of its cost: (spans accepted, spans
    rejected, first rejection reason, a warning naming the spans stored as ``invalid_logprobs`` or
    whose reward source claim was set aside, or None; and how many such claims). The receivers
    answer with this; the writer flattens."""
    accepted, rejected, first_error, with_logprobs = 0, 0, None, []
    claims, first_claim = 0, None
    for r, resource_spans in enumerate(request.resource_spans):
        for s, scope_spans in enumerate(resource_spans.scope_spans):
            own = scope_spans.scope.name == REWARD_SCOPE      # the API's rewards: their source is theirs
            for i, span in enumerate(scope_spans.spans):
                try:
                    logprobs, claim = _check_span(span)
                except (_Reject, ValueError, TypeError, OverflowError) as exc:
                    rejected += 1
                    if first_error is None:
                        first_error = f"resource_spans[{r}].scope_spans[{s}].spans[{i}]: {exc}"
                    continue
                accepted += 1
                if claim and not own:
                    claims += 1
                    first_claim = first_claim or f"resource_spans[{r}].scope_spans[{s}].spans[{i}]"
                if logprobs is not None:
                    with_logprobs.append(((r, s, i), _logprob_chunks(logprobs)))
    unusable, first_unusable = 0, None
    if with_logprobs and not _all_finite([c for _, chunks in with_logprobs for c in chunks]):
        bad = [where for where, chunks in with_logprobs if not _all_finite(chunks)]
        unusable, first_unusable = len(bad), "resource_spans[{}].scope_spans[{}].spans[{}]".format(*bad[0])
    warnings = [f"{unusable} span(s) stored with capture status {INVALID_LOGPROBS} (NaN or infinite values in "
                f"{sc.COMPLETION_LOGPROBS}: never trained on); first: {first_unusable}"] if unusable else []
    if claims:
        warnings.append(f"{claims} span(s) claim {sc.REWARD_SOURCE}: stored as the agent's, the claim set aside "
                        f"as {sc.REWARD_CLAIMED_SOURCE} (a judge's or a person's reward is posted to POST "
                        f"/v1/rewards); first: {first_claim}")
    return accepted, rejected, first_error, "; ".join(warnings) or None, claims


def count_spans(request: ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
