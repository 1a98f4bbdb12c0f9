"""The lightspan collector: OTLP/gRPC and OTLP/HTTP in, WAL, Parquet out (DESIGN.md §3.3).

::

    gRPC :4317 ─┐                                           ┌─ every flush_interval_s or flush():
                ├─ export(bytes) ─ parse ─ flatten ─ admit ─┤  {rotate WAL; drain queue} ─ Parquet
    HTTP :4318 ─┘        {WAL write; enqueue} → fsync → ack └─ then delete the closed segments

One ``export`` handler serves both transports; they only frame bytes and map the result's
:class:`Outcome` to a status with :func:`status_for` (permanent vs retryable, in one place).
An export is acknowledged only after its request bytes are fsynced in the WAL. The queue is
bounded by ``max_queue_bytes`` (Arrow bytes not yet in Parquet); past it, exports are refused
with a retryable status and a retry delay, never dropped or crashed on. After a crash the WAL
replays into Parquet before the receivers serve; a span written twice (Parquet written,
segment not yet deleted) is deduplicated by the ``spans`` view.

The API port answers ``GET /healthz``, ``GET /metrics`` (Prometheus text) and
``POST /v1/flush``.
"""

from __future__ import annotations

import enum
import json
import logging
import signal
import socket
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass
from datetime import date, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import numpy as np
import pyarrow as pa
from google.protobuf import json_format
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from lightspan.collector import store
from lightspan.collector.config import CollectorConfig
from lightspan.collector.otlp import DecodeError, count_spans, flatten, parse_json_request, parse_protobuf_request
from lightspan.collector.wal import WAL

log = logging.getLogger(__name__)

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
EXPORT_METHOD = f"/{TRACE_SERVICE}/Export"
TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
RETRY_INFO_KEY = "google.rpc.retryinfo-bin"   # the Python OTLP exporter reads RetryInfo only here
STATUS_DETAILS_KEY = "grpc-status-details-bin"
_NS_PER_DAY = 86_400 * 10**9
_EPOCH = date(1970, 1, 1)
_REPLAY_BATCH_BYTES = 64 << 20
_HTTP_POLL_S = 0.1            # how fast shutdown() notices; also the idle wake-up rate
_GRPC_GRACE_S = 5.0
_DRAIN_LIMIT = 8 << 20        # bytes of a refused body read and thrown away before hanging up


# --- outcomes and their statuses: classified once --------------------------------------------

class Outcome(enum.Enum):
    """What happened to one export. The value is the ``reason`` label of refused requests."""
    OK = "ok"
    INVALID = "invalid"             # not OTLP: the client's data is wrong, retrying cannot help
    TOO_LARGE = "too_large"         # body over the cap (before or after decompression)
    UNSUPPORTED = "unsupported"     # content type or content encoding we do not speak
    QUEUE_FULL = "queue_full"       # backpressure: Parquet is behind; come back later
    UNAVAILABLE = "unavailable"     # stopping, or the WAL could not be written


@dataclass(frozen=True)
class Status:
    retryable: bool
    grpc_code: grpc.StatusCode
    http_status: int


_STATUS = {
    Outcome.OK: Status(False, grpc.StatusCode.OK, 200),
    Outcome.INVALID: Status(False, grpc.StatusCode.INVALID_ARGUMENT, 400),
    Outcome.TOO_LARGE: Status(False, grpc.StatusCode.INVALID_ARGUMENT, 413),
    Outcome.UNSUPPORTED: Status(False, grpc.StatusCode.UNIMPLEMENTED, 415),
    Outcome.QUEUE_FULL: Status(True, grpc.StatusCode.UNAVAILABLE, 503),
    Outcome.UNAVAILABLE: Status(True, grpc.StatusCode.UNAVAILABLE, 503),
}


def status_for(outcome: Outcome) -> Status:
    """Permanent outcomes map to codes the OTLP exporters drop at once (400/413/415,
    INVALID_ARGUMENT/UNIMPLEMENTED); retryable ones to codes they retry after the delay we
    send (503 + Retry-After, UNAVAILABLE + RetryInfo). Never a 500 for a client's data."""
    return _STATUS[outcome]


@dataclass(frozen=True)
class ExportResult:
    outcome: Outcome
    message: str = ""
    accepted_spans: int = 0
    rejected_spans: int = 0

    @property
    def status(self) -> Status:
        return status_for(self.outcome)

    def response(self) -> ExportTraceServiceResponse:
        response = ExportTraceServiceResponse()
        if self.rejected_spans:
            response.partial_success.rejected_spans = self.rejected_spans
            response.partial_success.error_message = self.message
        return response

    def rpc_status(self, retry_after_s: int) -> status_pb2.Status:
        """The ``google.rpc.Status`` of a refusal, with RetryInfo when the client should retry."""
        status = status_pb2.Status(code=self.status.grpc_code.value[0], message=self.message)
        if self.status.retryable:
            status.details.add().Pack(_retry_info(retry_after_s))
        return status


def _retry_info(seconds: int) -> error_details_pb2.RetryInfo:
    info = error_details_pb2.RetryInfo()
    info.retry_delay.seconds = seconds
    return info


class CollectorError(RuntimeError):
    """The collector cannot start (a port is taken, the data directory is not writable)."""


# --- self-measurement ------------------------------------------------------------------------

_PREFIX = "lightspan_collector_"
_COUNTERS = {
    "spans_received_total": "Spans in parsed export requests (a refused request retried counts again).",
    "spans_accepted_total": "Spans acknowledged: durable in the WAL, on their way to Parquet.",
    "spans_rejected_total": "Malformed spans dropped from otherwise valid requests (partial_success).",
    "spans_written_total": "Spans written to Parquet, WAL replay included.",
    "spans_replayed_total": "Spans recovered from the WAL at start-up.",
    "flush_errors_total": "Flushes that failed to write Parquet; their data stays queued and in the WAL.",
}


class Metrics:
    """Counters and summaries of one collector, rendered in the Prometheus text format."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._refused = {o.value: 0 for o in Outcome if o is not Outcome.OK}
        self._flush_sum = 0.0
        self._flush_count = 0

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def refused(self, outcome: Outcome) -> None:
        with self._lock:
            self._refused[outcome.value] += 1

    def observe_flush(self, seconds: float) -> None:
        with self._lock:
            self._flush_sum += seconds
            self._flush_count += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {**self._counters, "requests_refused_total": dict(self._refused),
                    "flush_seconds_sum": self._flush_sum, "flush_seconds_count": self._flush_count}

    def render(self, *, queue_bytes: int, wal_bytes: int, fsync_sum: float, fsync_count: int) -> str:
        snap = self.snapshot()
        lines = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP {_PREFIX}{name} {help_}")
            lines.append(f"# TYPE {_PREFIX}{name} {kind}")
            lines.extend(f"{_PREFIX}{sample} {value}" for sample, value in samples)

        for name, help_ in _COUNTERS.items():
            metric(name, "counter", help_, [(name, snap[name])])
        metric("requests_refused_total", "counter", "Export requests answered with an error, by reason.",
               [(f'requests_refused_total{{reason="{r}"}}', n) for r, n in snap["requests_refused_total"].items()])
        metric("queue_bytes", "gauge", "Arrow bytes accepted but not yet in Parquet (bounded by max_queue_bytes).",
               [("queue_bytes", queue_bytes)])
        metric("wal_bytes", "gauge", "Bytes in WAL segment files.", [("wal_bytes", wal_bytes)])
        metric("flush_seconds", "summary", "Time to write queued spans to Parquet, per flush with data.",
               [("flush_seconds_sum", snap["flush_seconds_sum"]), ("flush_seconds_count", snap["flush_seconds_count"])])
        metric("fsync_seconds", "summary", "Time in WAL fsync (one fsync may cover several exports).",
               [("fsync_seconds_sum", fsync_sum), ("fsync_seconds_count", fsync_count)])
        return "\n".join(lines) + "\n"


# --- the collector ---------------------------------------------------------------------------

class Collector:
    """Receivers → WAL → bounded queue → Parquet writer. ``start()``, ``flush()``, ``stop()``."""

    def __init__(self, config: CollectorConfig):
        self.config = config
        self.data_dir = Path(config.data_dir)
        self.metrics = Metrics()
        self._state_lock = threading.Lock()
        self._state = "new"           # new → running → stopped (→ running again)
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()          # the handoff: {WAL write; enqueue} vs {rotate; drain}
        self._flush_lock = threading.Lock()    # one flush at a time
        self._queue: list[tuple[pa.Table, int]] = []
        self._queue_bytes = 0                  # queued + drained but not yet in Parquet
        self._pending: tuple[list[tuple[pa.Table, int]], list[int]] | None = None  # a failed flush
        self._accepting = False
        self._wal: WAL | None = None
        self._grpc: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self._http: _HTTPServer | None = None
        self._api: _HTTPServer | None = None
        self._grpc_port = self._http_port = self._api_port = None
        self._stop_event = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- ports ---
    @property
    def grpc_port(self) -> int:
        return self._grpc_port

    @property
    def http_port(self) -> int:
        return self._http_port

    @property
    def api_port(self) -> int:
        return self._api_port

    @property
    def queue_bytes(self) -> int:
        return self._queue_bytes

    # --- lifecycle ---
    def start(self) -> "Collector":
        """Bind every port (fail fast), replay the WAL into Parquet, then serve."""
        with self._state_lock:
            if self._state == "running":
                raise CollectorError("the collector is already running")
            self._reset()
            self._bind()
            try:
                self._wal = WAL(self.data_dir / "wal")
                self._replay()
            except BaseException:
                self._unbind()
                raise
            self._accepting = True
            self._grpc.start()
            for name, target in (("http", self._http.serve_forever), ("api", self._api.serve_forever)):
                kwargs = {"poll_interval": _HTTP_POLL_S}
                self._threads.append(threading.Thread(target=target, kwargs=kwargs,
                                                      name=f"lightspan-collector-{name}", daemon=True))
            self._threads.append(threading.Thread(target=self._writer_loop, name="lightspan-collector-writer",
                                                  daemon=True))
            for thread in self._threads:
                thread.start()
            self._state = "running"
        return self

    def stop(self) -> None:
        """Stop the receivers, then write everything accepted to Parquet. Idempotent."""
        with self._state_lock:
            if self._state != "running":
                return
            self._grpc.stop(_GRPC_GRACE_S).wait()       # in-flight RPCs finish first
            self._executor.shutdown(wait=False)
            self._http.shutdown()
            self._http.server_close()
            with self._lock:
                self._accepting = False                 # a late HTTP export now gets 503
            self._stop_event.set()
            for thread in self._threads:
                if thread.name.endswith("writer"):
                    thread.join()
            try:
                self.flush()
            except Exception:
                log.exception("final flush failed; the spans stay in the WAL and replay at the next start")
            self._wal.close()
            self._api.shutdown()
            self._api.server_close()
            self._state = "stopped"
            log.info("collector stopped")

    def __enter__(self) -> "Collector":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _bind(self) -> None:
        host, cfg = self.config.host, self.config
        try:
            self._executor = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="lightspan-collector-grpc")
            self._grpc = grpc.server(
                self._executor,
                handlers=[grpc.method_handlers_generic_handler(TRACE_SERVICE, {
                    # raw bytes in and out: the WAL stores exactly what the client sent
                    "Export": grpc.unary_unary_rpc_method_handler(self._grpc_export),
                })],
                options=[("grpc.max_receive_message_length", cfg.grpc_max_receive_bytes),
                         ("grpc.so_reuseport", 0)],   # a second collector on the port must fail, not share it
                maximum_concurrent_rpcs=64,          # beyond it gRPC answers RESOURCE_EXHAUSTED (retryable)
            )
            try:
                self._grpc_port = self._grpc.add_insecure_port(f"{_bracket(host)}:{cfg.grpc_port}")
            except RuntimeError:
                raise CollectorError(_bind_error("OTLP/gRPC", host, cfg.grpc_port, "grpc_port")) from None
            self._http = _listen(host, cfg.http_port, _OTLPHandler, self, "OTLP/HTTP", "http_port")
            self._http_port = self._http.server_address[1]
            self._api = _listen(host, cfg.api_port, _APIHandler, self, "API", "api_port")
            self._api_port = self._api.server_address[1]
        except BaseException:
            self._unbind()
            raise

    def _unbind(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(None)
            self._executor.shutdown(wait=False)
        for server in (self._http, self._api):
            if server is not None:
                server.server_close()

    # --- the one export handler ---
    def export(self, payload: bytes, encoding: str = "protobuf") -> ExportResult:
        """Parse, validate, admit, make durable, enqueue. ``encoding``: "protobuf" or "json"."""
        try:
            if encoding == "json":
                request = parse_json_request(payload)
                payload = request.SerializeToString()  # the WAL holds protobuf only
            else:
                request = parse_protobuf_request(payload)
        except DecodeError as exc:
            return self.refuse(Outcome.INVALID, str(exc))
        total = count_spans(request)
        self.metrics.add("spans_received_total", total)
        table, rejected, first_error = flatten(request, time.time_ns())
        message = f"{rejected} of {total} spans rejected; first: {first_error}" if rejected else ""
        if table.num_rows:
            size = table.nbytes
            with self._lock:
                if not self._accepting:
                    return self.refuse(Outcome.UNAVAILABLE, "the collector is stopping")
                if self._queue_bytes and self._queue_bytes + size > self.config.max_queue_bytes:
                    return self.refuse(Outcome.QUEUE_FULL,
                                       f"queue full: {self._queue_bytes} bytes waiting for Parquet "
                                       f"(max_queue_bytes={self.config.max_queue_bytes})")
                try:
                    position = self._wal.write(payload)
                except OSError as exc:
                    log.error("WAL write failed: %s", exc)
                    return self.refuse(Outcome.UNAVAILABLE, f"WAL write failed: {exc.strerror or exc}")
                self._queue.append((table, size))
                self._queue_bytes += size
            try:
                self._wal.sync(position)   # outside the lock: concurrent exports share an fsync
            except OSError as exc:
                log.error("WAL fsync failed: %s", exc)
                return self.refuse(Outcome.UNAVAILABLE, f"WAL fsync failed: {exc.strerror or exc}")
            self.metrics.add("spans_accepted_total", table.num_rows)
        if rejected:
            self.metrics.add("spans_rejected_total", rejected)
            log.debug("export: %s", message)
        return ExportResult(Outcome.OK, message, table.num_rows, rejected)

    def refuse(self, outcome: Outcome, message: str) -> ExportResult:
        """Count a refused request and describe it (transports use this for their own checks)."""
        self.metrics.refused(outcome)
        log.debug("export refused (%s): %s", outcome.value, message)
        return ExportResult(outcome, message)

    # --- Parquet ---
    def flush(self) -> int:
        """Write everything accepted so far to Parquet; returns the number of spans written."""
        with self._flush_lock:
            if self._wal is None:
                return 0
            start = time.perf_counter()
            with self._lock:
                closed = self._wal.rotate()
                items, self._queue = self._queue, []
            if self._pending is not None:   # retry what a failed flush left behind, oldest first
                items, closed = self._pending[0] + items, self._pending[1] + closed
                self._pending = None
            if not items and not closed:
                return 0
            try:
                written = self._write([table for table, _ in items])
            except Exception:
                self._pending = (items, closed)
                self.metrics.add("flush_errors_total")
                raise
            try:
                self._wal.delete(closed)
            except OSError:
                log.exception("could not delete WAL segments %s; they will replay (duplicates are harmless)", closed)
            with self._lock:
                self._queue_bytes -= sum(size for _, size in items)
            self.metrics.add("spans_written_total", written)
            self.metrics.observe_flush(time.perf_counter() - start)
            return written

    def _write(self, tables: list[pa.Table]) -> int:
        """One Parquet file per UTC start date, sorted by rollout and start time."""
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return 0
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        days = table.column("start_time_unix_nano").to_numpy() // _NS_PER_DAY
        unique_days = np.unique(days)
        for day in unique_days:
            part = table if len(unique_days) == 1 else table.filter(pa.array(days == day))
            part = part.sort_by([("rollout_id", "ascending"), ("start_time_unix_nano", "ascending")])
            partition = f"date={(_EPOCH + timedelta(days=int(day))).isoformat()}"
            store.write_table(self.data_dir, "spans", part, partition=partition)
        return table.num_rows

    def _replay(self) -> None:
        """Segments left by a previous run → Parquet, before anything new is accepted."""
        segments = self._wal.closed_segment_ids()
        if not segments:
            return
        tables, batch_bytes, spans = [], 0, 0
        for payload in self._wal.replay(segments):
            try:
                request = parse_protobuf_request(payload)
            except DecodeError as exc:   # a CRC-valid record that is not a request: keep going
                log.warning("WAL replay: skipping an undecodable record: %s", exc)
                continue
            table, _, _ = flatten(request, time.time_ns())
            tables.append(table)
            batch_bytes += table.nbytes
            if batch_bytes >= _REPLAY_BATCH_BYTES:
                spans += self._write(tables)
                tables, batch_bytes = [], 0
        spans += self._write(tables)
        self._wal.delete(segments)
        self.metrics.add("spans_replayed_total", spans)
        self.metrics.add("spans_written_total", spans)
        log.info("replayed %d spans from %d WAL segments into Parquet", spans, len(segments))

    def _writer_loop(self) -> None:
        interval = min(self.config.flush_interval_s, threading.TIMEOUT_MAX)
        while not self._stop_event.wait(interval):
            try:
                self.flush()
            except Exception:
                log.exception("flush to Parquet failed; retrying at the next interval")

    # --- transports ---
    def _grpc_export(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        result = self.export(request, "protobuf")
        status = result.status
        if status.grpc_code is grpc.StatusCode.OK:
            return result.response().SerializeToString()
        trailers = [(STATUS_DETAILS_KEY, result.rpc_status(self.config.retry_after_s).SerializeToString())]
        if status.retryable:
            trailers.append((RETRY_INFO_KEY, _retry_info(self.config.retry_after_s).SerializeToString()))
        context.set_trailing_metadata(trailers)
        context.abort(status.grpc_code, result.message)

    def render_metrics(self) -> str:
        wal = self._wal
        return self.metrics.render(queue_bytes=self._queue_bytes, wal_bytes=wal.size_bytes if wal else 0,
                                   fsync_sum=wal.fsync_seconds if wal else 0.0,
                                   fsync_count=wal.fsync_count if wal else 0)

    @property
    def running(self) -> bool:
        return self._state == "running"


# --- HTTP ------------------------------------------------------------------------------------

class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, handler, collector: Collector):
        self.collector = collector
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def handle_error(self, request, client_address) -> None:  # the stdlib prints to stderr
        log.exception("unexpected error serving %s", client_address)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _bind_error(what: str, host: str, port: int, field: str) -> str:
    return (f"cannot listen for {what} on {host}:{port}: the address is in use or not available "
            f"(another collector running?); set collector.{field} (LIGHTSPAN_COLLECTOR_{field.upper()}) "
            f"to a free port, or 0 for any")


def _listen(host: str, port: int, handler, collector: Collector, what: str, field: str) -> _HTTPServer:
    try:
        return _HTTPServer((host.strip("[]"), port), handler, collector)
    except OSError as exc:
        raise CollectorError(f"{_bind_error(what, host, port, field)} ({exc.strerror or exc})") from None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive: the exporters reuse their connection
    server_version = "lightspan-collector"
    timeout = 60                    # an idle keep-alive connection is closed after this

    def log_message(self, format, *args) -> None:  # noqa: A002 (the stdlib's name)
        log.debug("%s %s", self.address_string(), format % args)

    def send(self, code: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def send_text(self, code: int, text: str, headers: dict | None = None) -> None:
        self.send(code, text.encode(), "text/plain; charset=utf-8", headers)

    def not_allowed(self, allow: str) -> None:
        self.discard_body()
        self.send_text(405, f"method {self.command} not allowed on {self.path}; use {allow}\n", {"Allow": allow})

    def discard_body(self) -> None:
        """Read and drop a body we will not use, so the client reads our answer, not a reset."""
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > _DRAIN_LIMIT:
            self.close_connection = True
            return
        while length > 0:
            chunk = self.rfile.read(min(length, 1 << 16))
            if not chunk:
                break
            length -= len(chunk)


class _OTLPHandler(_Handler):
    """``POST /v1/traces``: OTLP/HTTP, protobuf or JSON, optionally gzip/deflate."""

    def do_POST(self) -> None:
        if urlsplit(self.path).path != TRACES_PATH:
            self.discard_body()
            return self.send_text(404, f"not found: POST OTLP traces to {TRACES_PATH}\n")
        collector: Collector = self.server.collector
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        encoding = {PROTOBUF: "protobuf", JSON: "json"}.get(content_type)
        if encoding is None:
            self.discard_body()
            return self.answer(collector.refuse(
                Outcome.UNSUPPORTED, f"content type {content_type!r}: send {PROTOBUF} or {JSON}"), "json")
        body = self.read_body(collector)
        if isinstance(body, ExportResult):
            return self.answer(body, encoding)
        self.answer(collector.export(body, encoding), encoding)

    def read_body(self, collector: Collector) -> bytes | ExportResult:
        cap = collector.config.max_http_body_bytes
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self.close_connection = True
            return collector.refuse(Outcome.UNSUPPORTED, "chunked bodies are not supported: send Content-Length")
        try:
            length = int(self.headers.get("Content-Length") or "")
            if length < 0:
                raise ValueError(length)
        except ValueError:
            self.close_connection = True
            return collector.refuse(Outcome.INVALID, "a valid Content-Length header is required")
        if length > cap:
            self.discard_body()
            return collector.refuse(Outcome.TOO_LARGE, f"body of {length} bytes exceeds max_http_body_bytes={cap}")
        body = self.rfile.read(length)
        if len(body) < length:
            self.close_connection = True
            return collector.refuse(Outcome.INVALID, f"body ended after {len(body)} of {length} bytes")
        content_encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        if content_encoding == "identity":
            return body
        wbits = {"gzip": 31, "deflate": 15}.get(content_encoding)   # 31: gzip header; 15: zlib
        if wbits is None:
            return collector.refuse(Outcome.UNSUPPORTED, f"content encoding {content_encoding!r}: use gzip, deflate or none")
        return _decompress(body, wbits, cap, collector)

    def answer(self, result: ExportResult, encoding: str) -> None:
        status = result.status
        headers = {"Retry-After": str(self.server.collector.config.retry_after_s)} if status.retryable else None
        if status.http_status == 200:
            message = result.response()
        else:
            message = result.rpc_status(self.server.collector.config.retry_after_s)
        if encoding == "json":
            body, content_type = json_format.MessageToJson(message, indent=None).encode(), JSON
        else:
            body, content_type = message.SerializeToString(), PROTOBUF
        self.send(status.http_status, body, content_type, headers)

    def do_GET(self) -> None:
        if urlsplit(self.path).path == TRACES_PATH:
            return self.not_allowed("POST")
        self.discard_body()
        self.send_text(404, f"not found: POST OTLP traces to {TRACES_PATH}\n")

    do_PUT = do_DELETE = do_PATCH = do_GET


def _decompress(body: bytes, wbits: int, cap: int, collector: Collector) -> bytes | ExportResult:
    decompressor = zlib.decompressobj(wbits)
    try:
        data = decompressor.decompress(body, cap + 1)   # never inflate more than the cap (zip bombs)
    except zlib.error as exc:
        return collector.refuse(Outcome.INVALID, f"body does not decompress: {exc}")
    if len(data) > cap:
        return collector.refuse(Outcome.TOO_LARGE, f"decompressed body exceeds max_http_body_bytes={cap}")
    if not decompressor.eof:
        return collector.refuse(Outcome.INVALID, "compressed body is truncated")
    return data


class _APIHandler(_Handler):
    """``GET /healthz``, ``GET /metrics``, ``POST /v1/flush``."""

    def do_GET(self) -> None:
        collector: Collector = self.server.collector
        path = urlsplit(self.path).path
        if path == "/healthz":
            ok = collector.running
            return self.send(200 if ok else 503, json.dumps({"status": "ok" if ok else "stopping"}).encode(), JSON)
        if path == "/metrics":
            return self.send(200, collector.render_metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
        if path == "/v1/flush":
            return self.not_allowed("POST")
        self.send_text(404, "not found: GET /healthz, GET /metrics, POST /v1/flush\n")

    def do_POST(self) -> None:
        self.discard_body()
        path = urlsplit(self.path).path
        if path in ("/healthz", "/metrics"):
            return self.send_text(405, f"use GET on {path}\n", {"Allow": "GET"})
        if path != "/v1/flush":
            return self.send_text(404, "not found: GET /healthz, GET /metrics, POST /v1/flush\n")
        try:
            flushed = self.server.collector.flush()
        except Exception as exc:  # our own failure (disk), not the client's data
            log.exception("flush requested over the API failed")
            return self.send(500, json.dumps({"error": str(exc)}).encode(), JSON)
        self.send(200, json.dumps({"flushed_spans": flushed}).encode(), JSON)


# --- the service -----------------------------------------------------------------------------

def serve(config: CollectorConfig) -> int:
    """Run a collector until SIGINT or SIGTERM; returns the process exit code."""
    done = threading.Event()

    def on_signal(signum, _frame) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        done.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():   # installed before the ports open
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    collector = Collector(config)
    try:
        try:
            collector.start()
        except CollectorError as exc:
            log.error("%s", exc)
            return 1
        host = _bracket(config.host)
        log.info("lightspan collector: OTLP/gRPC %s:%d, OTLP/HTTP http://%s:%d%s, API http://%s:%d, data in %s",
                 host, collector.grpc_port, host, collector.http_port, TRACES_PATH, host, collector.api_port,
                 collector.data_dir)
        while not done.wait(3600):
            pass
        return 0
    finally:
        collector.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
