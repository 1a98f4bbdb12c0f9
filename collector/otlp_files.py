"""OTLP JSON files in and out (docs/architecture.md, "Files and forwarding").

In (``lightspan import FILE...``): the OTel Collector file exporter's format, one OTLP/JSON export
request per line (``format: json``), plain, gzip or zstd (a whole compressed stream, as its native
compression writes; or its older framing, a 4-byte big-endian length before each zstd-compressed
request); and the Python SDK's exporters where their output is OTLP JSON (the JSON file exporter,
the console exporter given an OTLP formatter: several lines per request). Each request goes through
the collector's one export path (the receivers' checks, the WAL, Parquet). Importing is
idempotent: what the store holds already (spans by trace and span id, log records by record id) is
left out and counted. A malformed line is reported with its file and line number; the rest is
imported.

Out (``lightspan export --format otlp-json``): stored spans, back as OTLP/JSON export requests one
per line (``.gz``/``.zst`` compressed by the file's name), which an OTel Collector's ``otlpjsonfile``
receiver, another backend or ``lightspan import`` reads; importing an export gives the same rows
(the attributes each promoted column was read from written in the v0.1.0 names).
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
from google.protobuf import json_format
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from lightspan import store
from lightspan.collector import otlp, otlp_logs
from lightspan.collector.otlp_parse import DecodeError, parse_json_request
from lightspan.tracing import semconv as sc

_GZIP, _ZSTD = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
_BATCH = 256                                # requests checked against the store at once
MAX_REPORTED = 100                          # malformed lines listed in the report (all are counted)


# --- in ------------------------------------------------------------------------------------------

def _decompress(data: bytes) -> bytes:
    for magic, codec in ((_GZIP, "gzip"), (_ZSTD, "zstd")):
        if data.startswith(magic):
            return pa.CompressedInputStream(pa.BufferReader(data), codec).read()
    return data


def documents(path: str | Path) -> Iterator[tuple[str, bytes | None, str | None]]:
    """(where: ``line N`` or ``record N``, one OTLP/JSON document's bytes, or why it is none) for
    each export request of a file."""
    data = _decompress(Path(path).read_bytes())
    if data.lstrip()[:1] not in (b"{", b""):
        yield from _framed(data)
        return
    text = data.decode("utf-8", errors="replace")
    decoder, pos, line = json.JSONDecoder(), 0, 1
    while True:
        start = len(text) - len(text[pos:].lstrip())
        line += text.count("\n", pos, start)
        pos = start
        if pos >= len(text):
            return
        try:
            _, end = decoder.raw_decode(text, pos)
        except ValueError as exc:
            yield f"line {line}", None, f"not JSON: {exc.msg}"
            nxt = text.find("\n{", pos)                      # the next line that opens a document
            nxt = len(text) if nxt < 0 else nxt + 1
            line += text.count("\n", pos, nxt)
            pos = nxt
            continue
        yield f"line {line}", text[pos:end].encode(), None
        line += text.count("\n", pos, end)
        pos = end


def _framed(data: bytes) -> Iterator[tuple[str, bytes | None, str | None]]:
    """The Collector file exporter's older framing: a 4-byte big-endian length before each record."""
    pos, n = 0, 0
    while pos < len(data):
        n += 1
        if pos + 4 > len(data):
            yield f"record {n}", None, "cut short"
            return
        (size,) = struct.unpack(">I", data[pos:pos + 4])
        record = data[pos + 4:pos + 4 + size]
        pos += 4 + size
        if len(record) < size:
            yield f"record {n}", None, "cut short"
            return
        try:
            record = _decompress(record)
        except (OSError, pa.ArrowException) as exc:
            yield f"record {n}", None, f"not zstd: {exc}"
            continue
        if record.lstrip()[:1] != b"{":
            yield f"record {n}", None, "not OTLP/JSON (the exporter's format: proto is not read; use format: json)"
            continue
        yield f"record {n}", record, None


def _signal(doc: bytes) -> str | None:
    head = json.loads(doc)
    if not isinstance(head, dict):
        return None
    for key, signal in (("resourceSpans", "traces"), ("resource_spans", "traces"), ("resourceLogs", "logs"),
                        ("resource_logs", "logs"), ("resourceMetrics", "metrics"), ("resource_metrics", "metrics")):
        if key in head:
            return signal
    return None


def _span_keys(request: ExportTraceServiceRequest) -> set[tuple[str, str]]:
    return {(s.trace_id.hex(), s.span_id.hex()) for rs in request.resource_spans for ss in rs.scope_spans
            for s in ss.spans}


def _record_ids(request: ExportLogsServiceRequest) -> dict[str, tuple]:
    out = {}
    for rl in request.resource_logs:
        digest = otlp_logs.resource_digest(rl)
        for sl in rl.scope_logs:
            for record in sl.log_records:
                out[otlp_logs.record_id(digest, sl.scope.name, record)] = record
    return out


def _stored(data_dir, spans: set[tuple[str, str]], records: set[str]) -> tuple[set, set]:
    def query():
        con = store.connect(data_dir)
        try:
            have_spans = set(con.execute(
                "SELECT trace_id, span_id FROM spans WHERE trace_id IN (SELECT unnest($t::VARCHAR[]))",
                {"t": sorted({t for t, _ in spans})}).fetchall()) if spans else set()
            have_records = {r for (r,) in con.execute(
                "SELECT record_id FROM logs WHERE record_id IN (SELECT unnest($r::VARCHAR[]))",
                {"r": sorted(records)}).fetchall()} if records else set()
            return have_spans & spans, have_records
        finally:
            con.close()

    return store.retry_vanished(query)


def _drop_stored_spans(request: ExportTraceServiceRequest, stored: set) -> int:
    dropped = 0
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            keep = [s for s in ss.spans if (s.trace_id.hex(), s.span_id.hex()) not in stored]
            dropped += len(ss.spans) - len(keep)
            del ss.spans[:]
            ss.spans.extend(keep)
    return dropped


def _drop_stored_records(request: ExportLogsServiceRequest, stored: set) -> int:
    dropped = 0
    for rl in request.resource_logs:
        digest = otlp_logs.resource_digest(rl)
        for sl in rl.scope_logs:
            keep = [r for r in sl.log_records if otlp_logs.record_id(digest, sl.scope.name, r) not in stored]
            dropped += len(sl.log_records) - len(keep)
            del sl.log_records[:]
            sl.log_records.extend(keep)
    return dropped


def import_files(paths: list[str], collector, *, own_rewards: bool = False) -> dict:
    """Every export request of ``paths`` through ``collector.export`` (a started
    :class:`~lightspan.collector.server.Collector`), less what the store holds; returns the report.
    ``own_rewards``: the files are lightspan's own export, whose rewards (spans of the collector's
    reward scope) are taken as the collector's; otherwise they are refused as any sender's."""
    report = {"files": len(paths), "requests": 0, "metrics_requests_skipped": 0, "malformed": [],
              "malformed_total": 0,
              "spans": {"read": 0, "stored": 0, "already_stored": 0, "rejected": 0},
              "log_records": {"read": 0, "stored": 0, "already_stored": 0, "rejected": 0}}

    def malformed(path, where, why):
        report["malformed_total"] += 1
        if len(report["malformed"]) < MAX_REPORTED:
            report["malformed"].append({"file": str(path), "at": where, "error": why})

    def flush(batch):
        spans = set().union(*(_span_keys(r) for s, r, *_ in batch if s == "traces"))
        records = set().union(*(_record_ids(r) for s, r, *_ in batch if s == "logs"))
        have_spans, have_records = _stored(collector.data_dir, spans, set(records))
        for signal, request, path, where in batch:
            noun = "spans" if signal == "traces" else "log_records"
            if signal == "traces":
                report[noun]["read"] += otlp.count_spans(request)
                report[noun]["already_stored"] += _drop_stored_spans(request, have_spans)
                left = otlp.count_spans(request)
            else:
                report[noun]["read"] += otlp_logs.count_log_records(request)
                report[noun]["already_stored"] += _drop_stored_records(request, have_records)
                left = otlp_logs.count_log_records(request)
            if not left:
                continue
            result = collector.export(request.SerializeToString(), "protobuf", signal, own=own_rewards)
            if result.outcome.value != "ok":
                malformed(path, where, f"refused: {result.message}")
                continue
            report[noun]["stored"] += result.accepted
            report[noun]["rejected"] += result.rejected
            if result.rejected:
                malformed(path, where, result.message)

    batch = []
    for path in paths:
        for where, doc, why in documents(path):
            if doc is None:
                malformed(path, where, why)
                continue
            try:
                signal = _signal(doc)
                if signal is None:
                    raise DecodeError("not an OTLP export request: no resourceSpans or resourceLogs (the SDK "
                                      "console exporter's default output is not OTLP JSON: give it an OTLP formatter)")
                if signal == "metrics":
                    report["metrics_requests_skipped"] += 1
                    continue
                request = (parse_json_request(doc) if signal == "traces"
                           else otlp_logs.parse_json_logs_request(doc))
            except (DecodeError, ValueError) as exc:
                malformed(path, where, str(exc))
                continue
            report["requests"] += 1
            batch.append((signal, request, path, where))
            if len(batch) >= _BATCH:
                flush(batch)
                batch = []
    if batch:
        flush(batch)
    new = report["spans"]["stored"] + report["log_records"]["stored"]
    report["summary"] = (f"{report['spans']['stored']} spans and {report['log_records']['stored']} log records stored"
                         if new else "nothing new: every span and log record read is stored already")
    return report


# --- out -----------------------------------------------------------------------------------------

# the attribute a promoted column is written back as: the first name it is read from (v0.1.0's)
_COLUMN_ATTRIBUTE = {}
for _key, _column, _ in otlp._PROMOTED:
    _COLUMN_ATTRIBUTE.setdefault(_column, _key)
_PACKED = {"prompt_token_ids": sc.encode_ids, "completion_token_ids": sc.encode_ids,
           "completion_logprobs": sc.encode_floats}
_KINDS = {name: number for number, name in otlp._KIND.items()}
_STATUS = {name: number for number, name in otlp._STATUS.items()}


def _any(value, out: AnyValue) -> None:
    if isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, int):
        out.int_value = value
    elif isinstance(value, float):
        out.double_value = value
    elif isinstance(value, (bytes, bytearray)):
        out.bytes_value = bytes(value)
    elif isinstance(value, str):
        out.string_value = value
    elif isinstance(value, (list, tuple)):
        out.array_value.SetInParent()
        for item in value:
            _any(item, out.array_value.values.add())
    elif isinstance(value, dict):
        out.kvlist_value.SetInParent()
        for key, item in value.items():
            _any(item, out.kvlist_value.values.add(key=str(key)).value)


def _set_attributes(target, attrs: dict) -> None:
    for key, value in attrs.items():
        _any(value, target.add(key=key).value)


def _decoded(pairs) -> dict:
    return {k: json.loads(v) for k, v in pairs or ()}


def _span_attributes(row: dict) -> dict:
    attrs = _decoded(row["attributes"])
    for key in (sc.COMPLETION_TOKEN_IDS, sc.COMPLETION_LOGPROBS):    # all choices, kept as base64 strings
        if isinstance(attrs.get(key), list) and all(isinstance(v, str) for v in attrs[key]):
            attrs[key] = [base64.b64decode(v) for v in attrs[key]]
    for column, key in _COLUMN_ATTRIBUTE.items():
        value = row.get(column)
        if value is None or (key in attrs and column in _PACKED):
            continue
        attrs[key] = _PACKED[column](value) if column in _PACKED else value
    return attrs


def span_requests(table: pa.Table, max_spans: int = 512) -> Iterator[ExportTraceServiceRequest]:
    """Stored span rows (``SPAN_SCHEMA``) as export requests of at most ``max_spans`` spans, one
    resource per (service, resource attributes) and one scope per scope name."""
    request, count, groups = ExportTraceServiceRequest(), 0, {}
    for row in table.to_pylist():
        resource = _decoded(row["resource_attributes"])
        if row["service_name"] is not None:
            resource[sc.SERVICE_NAME] = row["service_name"]
        rkey = json.dumps(resource, sort_keys=True)
        if rkey not in groups:
            resource_spans = request.resource_spans.add()
            _set_attributes(resource_spans.resource.attributes, resource)
            groups[rkey] = (resource_spans, {})
        resource_spans, scopes = groups[rkey]
        if row["scope_name"] not in scopes:
            scope_spans = resource_spans.scope_spans.add()
            scope_spans.scope.name = row["scope_name"] or ""
            scopes[row["scope_name"]] = scope_spans
        span = scopes[row["scope_name"]].spans.add(
            trace_id=bytes.fromhex(row["trace_id"]), span_id=bytes.fromhex(row["span_id"]), name=row["name"] or "",
            kind=_KINDS.get(row["kind"], 1), start_time_unix_nano=row["start_time_unix_nano"] or 0,
            end_time_unix_nano=row["end_time_unix_nano"] or 0)
        if row["parent_span_id"]:
            span.parent_span_id = bytes.fromhex(row["parent_span_id"])
        span.status.code = _STATUS.get(row["status_code"], 0)
        if row["status_message"]:
            span.status.message = row["status_message"]
        _set_attributes(span.attributes, _span_attributes(row))
        for event in row["events"] or ():
            e = span.events.add(time_unix_nano=event["time_unix_nano"] or 0, name=event["name"] or "")
            _set_attributes(e.attributes, json.loads(event["attributes"] or "{}"))
        for link in row["links"] or ():
            li = span.links.add(trace_id=bytes.fromhex(link["trace_id"]), span_id=bytes.fromhex(link["span_id"]))
            _set_attributes(li.attributes, json.loads(link["attributes"] or "{}"))
        count += 1
        if count >= max_spans:
            yield request
            request, count, groups = ExportTraceServiceRequest(), 0, {}
    if count:
        yield request


def to_json(request) -> str:
    """An export request as the OTLP/JSON the Collector writes: camelCase, ids in hex."""
    doc = json_format.MessageToDict(request)
    for rs in doc.get("resourceSpans", ()):
        for ss in rs.get("scopeSpans", ()):
            for span in ss.get("spans", ()):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
                for link in span.get("links", ()):
                    for key in ("traceId", "spanId"):
                        if key in link:
                            link[key] = base64.b64decode(link[key]).hex()
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


def write_spans(table: pa.Table, out: Path) -> int:
    """Write ``table``'s spans to ``out`` as OTLP/JSON lines (gzip or zstd by its suffix), whole or
    not at all; returns the number of requests written."""
    codec = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}.get(out.suffix.lower())
    tmp = out.with_name(f".{out.name}.tmp")
    lines = 0
    sink = pa.OSFile(str(tmp), "wb")
    stream = pa.CompressedOutputStream(sink, codec) if codec else sink
    try:
        for request in span_requests(table):
            stream.write((to_json(request) + "\n").encode())
            lines += 1
    finally:
        stream.close()
        if codec:
            sink.close()
    tmp.replace(out)
    return lines
