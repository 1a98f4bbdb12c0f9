"""OTLP logs requests → rows of :data:`~lightspan.store.LOG_SCHEMA`: GenAI events sent through the
logs signal, one row per log record. Pure functions, with the rules of :mod:`lightspan.collector.otlp`
(a malformed record is rejected and counted, its siblings kept; unpromoted attributes kept as JSON).
"""

from __future__ import annotations

import binascii
import hashlib

import pyarrow as pa
from google.protobuf import json_format
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from lightspan.collector.otlp import _FROM_RESOURCE, _ZERO_SPAN, _ZERO_TRACE, _id, _resource, _time
from lightspan.collector.otlp_values import _dumps, _Keep, _py, _Reject, _str
from lightspan.collector.otlp_parse import DecodeError, hex_ids_to_base64, items, json_doc
from lightspan.store import LOG_SCHEMA

_LOG_COLUMNS = [f.name for f in LOG_SCHEMA]
EVENT_NAME = "event.name"     # where events were named before LogRecord.event_name existed


def _optional_id(data: bytes, what: str, size: int, zero: bytes) -> str | None:
    """A log record's trace/span id: optional, but the right length when present."""
    if not data or data == zero:
        return None
    return _id(data, what, size, zero)


def _log_row(record, scope_name: str, resource: dict, resource_hash: bytes, received_unix_nano: int) -> dict:
    """One row as a column → value dict. Raises _Reject for a malformed record."""
    observed = _time(record.observed_time_unix_nano, "observed_time_unix_nano")
    time_ns = _time(record.time_unix_nano, "time_unix_nano") or observed or received_unix_nano
    attrs = {kv.key: kv.value for kv in record.attributes}
    row = {
        "time_unix_nano": time_ns,
        "observed_time_unix_nano": observed or None,
        "severity_number": record.severity_number,
        "severity_text": record.severity_text or None,
        "body": _dumps(_py(record.body)) if record.HasField("body") else None,
        "event_name": record.event_name or None,
        "trace_id": _optional_id(record.trace_id, "trace_id", 16, _ZERO_TRACE),
        "span_id": _optional_id(record.span_id, "span_id", 8, _ZERO_SPAN),
        "scope_name": scope_name or None,
        "received_unix_nano": received_unix_nano,
    }
    if row["event_name"] is None and EVENT_NAME in attrs:
        try:
            row["event_name"] = _str(attrs[EVENT_NAME], EVENT_NAME)
        except _Keep:
            pass
    promoted = set()
    for key, column in _FROM_RESOURCE[:3]:     # rollout, task, split: the record's attribute first
        if key in attrs:
            try:
                row[column] = _str(attrs[key], key)
                promoted.add(key)
            except _Keep:
                pass
    for key, column in _FROM_RESOURCE:
        if column not in row and column in resource["values"]:
            row[column] = resource["values"][column]
    row["resource_attributes"] = resource["all"] if promoted else resource["rest"]
    row["attributes"] = [(k, _dumps(_py(v))) for k, v in attrs.items() if k not in promoted]
    row["record_id"] = record_id(resource_hash, scope_name, record)
    return row


def resource_digest(resource_logs) -> bytes:
    return hashlib.blake2b(resource_logs.resource.SerializeToString(deterministic=True), digest_size=16).digest()


def record_id(resource_hash: bytes, scope_name: str, record) -> str:
    """A log record's id: logs carry none, so the same record re-sent (at-least-once) hashes to the
    same one (its resource's :func:`resource_digest`, its scope's name, the record)."""
    digest = hashlib.blake2b(resource_hash, digest_size=16)
    digest.update(scope_name.encode())
    digest.update(record.SerializeToString(deterministic=True))
    return digest.hexdigest()


def flatten_logs(request: ExportLogsServiceRequest, received_unix_nano: int) -> tuple[pa.Table, int, str | None]:
    """One row per log record in ``LOG_SCHEMA``; returns (table, records rejected, first reason)."""
    columns: dict[str, list] = {name: [] for name in _LOG_COLUMNS}
    rejected, first_error = 0, None
    for r, resource_logs in enumerate(request.resource_logs):
        resource = _resource(resource_logs)
        digest = resource_digest(resource_logs)
        for s, scope_logs in enumerate(resource_logs.scope_logs):
            scope_name = scope_logs.scope.name
            for i, record in enumerate(scope_logs.log_records):
                try:
                    row = _log_row(record, scope_name, resource, digest, received_unix_nano)
                except (_Reject, ValueError, TypeError, OverflowError) as exc:
                    rejected += 1
                    if first_error is None:
                        first_error = f"resource_logs[{r}].scope_logs[{s}].log_records[{i}]: {exc}"
                    continue
                for name in _LOG_COLUMNS:
                    columns[name].append(row.get(name))
    arrays = [pa.array(columns[field.name], type=field.type) for field in LOG_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=LOG_SCHEMA), rejected, first_error


def count_log_records(request: ExportLogsServiceRequest) -> int:
    return sum(len(sl.log_records) for rl in request.resource_logs for sl in rl.scope_logs)


def parse_json_logs_request(body: bytes) -> ExportLogsServiceRequest:
    """OTLP/JSON logs (``application/json``), with the same rules as
    :func:`lightspan.collector.otlp_parse.parse_json_request`."""
    doc = json_doc(body)
    for r, rl in enumerate(items(doc, "resourceLogs", "resource_logs")):
        for s, sl in enumerate(items(rl, "scopeLogs", "scope_logs")):
            for i, record in enumerate(items(sl, "logRecords", "log_records")):
                if isinstance(record, dict):
                    hex_ids_to_base64(record, f"resourceLogs[{r}].scopeLogs[{s}].logRecords[{i}]")
    try:
        return json_format.ParseDict(doc, ExportLogsServiceRequest(), ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError, binascii.Error) as exc:
        raise DecodeError(f"not an OTLP/JSON logs request: {exc}") from None
