"""OTLP request bodies → protobuf messages: binary protobuf, and OTLP/JSON (hex ids, lowerCamelCase
keys, integer enums, unknown fields ignored). Anything that is not an OTLP request raises
:class:`DecodeError` (answered with 400 / INVALID_ARGUMENT); the traces' and the logs' JSON share
the helpers here (collector/otlp_logs.py)."""

from __future__ import annotations

import base64
import binascii
import json

from google.protobuf import json_format
from google.protobuf.message import DecodeError as _ProtobufDecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class DecodeError(ValueError):
    """The request body is not an OTLP request (answered with 400 / INVALID_ARGUMENT)."""


def parse_protobuf_request(body: bytes, cls=ExportTraceServiceRequest):
    """Binary protobuf (OTLP/gRPC and ``application/x-protobuf``) of a ``cls`` request."""
    try:
        return cls.FromString(body)
    except _ProtobufDecodeError as exc:
        raise DecodeError(f"not an OTLP {cls.__name__}: {exc}") from None


_ID_KEYS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


def hex_ids_to_base64(obj: dict, where: str) -> None:
    # OTLP/JSON writes ids as hex where protobuf's JSON mapping expects base64 bytes
    for key in _ID_KEYS:
        value = obj.get(key)
        if isinstance(value, str):
            try:
                obj[key] = base64.b64encode(bytes.fromhex(value)).decode("ascii")
            except ValueError:
                raise DecodeError(f"{where}.{key} {value[:40]!r} is not hex") from None


def items(obj, *keys) -> list:
    if not isinstance(obj, dict):
        return []
    for key in keys:
        value = obj.get(key)
        if isinstance(value, list):
            return value
    return []


def json_doc(body: bytes) -> dict:
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DecodeError(f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise DecodeError("body is not a JSON object")
    return doc


def parse_json_request(body: bytes) -> ExportTraceServiceRequest:
    """OTLP/JSON (``application/json``): lowerCamelCase keys, hex ids, integer enums, unknown
    fields ignored."""
    doc = json_doc(body)
    for r, rs in enumerate(items(doc, "resourceSpans", "resource_spans")):
        for s, ss in enumerate(items(rs, "scopeSpans", "scope_spans")):
            for i, span in enumerate(items(ss, "spans")):
                if not isinstance(span, dict):
                    continue
                where = f"resourceSpans[{r}].scopeSpans[{s}].spans[{i}]"
                hex_ids_to_base64(span, where)
                for j, link in enumerate(items(span, "links")):
                    if isinstance(link, dict):
                        hex_ids_to_base64(link, f"{where}.links[{j}]")
    try:
        return json_format.ParseDict(doc, ExportTraceServiceRequest(), ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError, binascii.Error) as exc:
        raise DecodeError(f"not an OTLP/JSON trace request: {exc}") from None
