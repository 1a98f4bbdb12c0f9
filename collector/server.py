"""The lightspan collector: OTLP/gRPC and OTLP/HTTP in, WAL, Parquet out (DESIGN.md §3.3).

::

    gRPC :4317 ─┐                                          ┌─ every flush_interval_s or flush():
                ├─ export(bytes) ─ parse ─ check ─ admit ──┤  {rotate WAL; drain queue} ─ flatten ─
    HTTP :4318 ─┘       {WAL write; enqueue} → fsync → ack │  dedup ─ Parquet; then delete the closed
    API  :8321 ─ POST /v1/rewards ─┘                       └─ segments, compact, expire old partitions

One ``export`` handler serves every transport and both signals (traces and logs); the
transports only frame bytes and map the result's :class:`Outcome` to a status with
:func:`status_for` (permanent vs retryable, in one place). An export is acknowledged only
after its request bytes are fsynced in the WAL; when the WAL cannot be written (disk full),
the export is refused with a retryable status and counted as ``reason="disk"``, and the next
export tries again. The queue is bounded by ``max_queue_bytes`` (bytes accepted, not yet in
Parquet); past it, exports are refused with a retryable status and a retry delay, never dropped
or crashed on. After a crash the WAL replays into Parquet before the receivers serve.

The store is deduplicated at write time (:mod:`lightspan.collector.dedup`): the writer drops a
span (or log record) it wrote within ``dedup_window_s``, a replayed row already in Parquet, and a
repeat within one flush, so the views need no deduplicating window.

The HTTP transports and the API live in :mod:`lightspan.collector.httpd`; compaction and
retention in :mod:`lightspan.collector.compact`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from concurrent import futures
from datetime import date, timedelta
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from lightspan.collector import compact as compaction
from lightspan import store
from lightspan.collector import dedup, httpd, jsonlog
from lightspan.collector.config import CollectorConfig
from lightspan.collector.httpd import LOGS_PATH, TRACES_PATH
from lightspan.collector.metrics import Metrics
from lightspan.collector.otlp import (DecodeError, check, count_log_records, count_spans, flatten, flatten_logs,
                                      parse_json_logs_request, parse_json_request, parse_protobuf_request)
from lightspan.collector.outcomes import CollectorError, ExportResult, Outcome, Status, retry_info, status_for
from lightspan.collector.routes import Route
from lightspan.collector.wal import WAL

__all__ = ["Collector", "CollectorError", "ExportResult", "Outcome", "Status", "status_for", "serve",
           "EXPORT_METHOD", "LOGS_EXPORT_METHOD", "TRACES_PATH", "LOGS_PATH"]

log = logging.getLogger(__name__)

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
LOGS_SERVICE = "opentelemetry.proto.collector.logs.v1.LogsService"
EXPORT_METHOD = f"/{TRACE_SERVICE}/Export"
LOGS_EXPORT_METHOD = f"/{LOGS_SERVICE}/Export"
RETRY_INFO_KEY = "google.rpc.retryinfo-bin"   # the Python OTLP exporter reads RetryInfo only here
STATUS_DETAILS_KEY = "grpc-status-details-bin"
LOGS_TAG = b"\x00L"    # WAL records of logs; untagged records are trace requests (see wal.py)
_NS_PER_DAY = 86_400 * 10**9
_EPOCH = date(1970, 1, 1)
_REPLAY_BATCH_BYTES = 64 << 20
_FLUSH_CHUNK_BYTES = 16 << 20   # queued bytes flattened and written per Parquet file (per date) at a time
_HTTP_POLL_S = 0.1            # how fast shutdown() notices; also the idle wake-up rate
_GRPC_GRACE_S = 5.0
COMPACT_GRACE_S = 30.0        # files a merged one replaces stay this long, for queries that listed them
# per signal: the request parsers, the row builder, the counter prefix, the partition time column
_SIGNALS = {
    "traces": dict(protobuf=parse_protobuf_request, json=parse_json_request, count=count_spans,
                   flatten=flatten, metric="spans", time="start_time_unix_nano", table="spans",
                   sort=[("rollout_id", "ascending"), ("start_time_unix_nano", "ascending")]),
    "logs": dict(protobuf=lambda body: parse_protobuf_request(body, ExportLogsServiceRequest),
                 json=parse_json_logs_request, count=count_log_records, flatten=flatten_logs,
                 metric="log_records", time="time_unix_nano", table="logs",
                 sort=[("rollout_id", "ascending"), ("time_unix_nano", "ascending")]),
}


class Collector:
    """Receivers → WAL → bounded queue → Parquet writer. ``start()``, ``flush()``, ``stop()``."""

    def __init__(self, config: CollectorConfig, routes: tuple[Route, ...] = ()):
        """``routes``: GET routes added to the API port by the process that composes the services
        (the web UI, :mod:`lightspan.collector.routes`)."""
        self.config = config
        self.routes = tuple(routes)
        self.data_dir = Path(config.data_dir)
        self.metrics = Metrics()
        self._state_lock = threading.Lock()
        self._state = "new"           # new → running → stopped (→ running again)
        self._compact_lock = threading.Lock()
        self._refusal_log = jsonlog.RateLimit(config.log_refusals_every_s)
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()          # the handoff: {WAL write; enqueue} vs {rotate; drain}
        self._flush_lock = threading.Lock()    # one flush at a time
        # (signal, request bytes (traces) or rows (logs), received_unix_nano, rejected, bytes)
        self._queue: list[tuple[str, bytes | pa.Table, int, int, int]] = []
        self._queue_bytes = 0                  # queued + drained but not yet in Parquet
        self._pending: tuple[list, list[int]] | None = None  # what a failed flush left behind
        self._accepting = False
        self._wal: WAL | None = None
        self._grpc: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self._http: httpd.HTTPServer | None = None
        self._api: httpd.HTTPServer | None = None
        self._grpc_port = self._http_port = self._api_port = None
        self._stop_event = threading.Event()
        self._threads: list[threading.Thread] = []
        # per partitioned table: the keys written recently (the writer's, under _flush_lock)
        self._recent = {name: dedup.RecentKeys(self.config.dedup_max_keys, self.config.dedup_window_s)
                        for name in store.PARTITIONED}

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

    @property
    def running(self) -> bool:
        return self._state == "running"

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
                self._seed_recent()
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
        if self.config.auth_token and not self.config.tls_cert_file and self.config.host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("auth_token is set without TLS on %s: the token crosses the network in clear text",
                        self.config.host)
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
                log.exception("final flush failed; the data stays in the WAL and replays at the next start")
            self._wal.close()
            try:
                self._sweep(0.0)
            except OSError:
                log.exception("could not remove compacted-away files; the next sweep removes them")
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
        tls = httpd.tls_context(cfg.tls_cert_file, cfg.tls_key_file) if cfg.tls_cert_file else None
        try:
            self._executor = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="lightspan-collector-grpc")
            self._grpc = grpc.server(
                self._executor,
                handlers=[grpc.method_handlers_generic_handler(service, {
                    # raw bytes in and out: the WAL stores exactly what the client sent
                    "Export": grpc.unary_unary_rpc_method_handler(self._grpc_handler(signal_)),
                }) for service, signal_ in ((TRACE_SERVICE, "traces"), (LOGS_SERVICE, "logs"))],
                options=[("grpc.max_receive_message_length", cfg.grpc_max_receive_bytes),
                         ("grpc.so_reuseport", 0)],   # a second collector on the port must fail, not share it
                maximum_concurrent_rpcs=64,          # beyond it gRPC answers RESOURCE_EXHAUSTED (retryable)
            )
            address = f"{httpd.bracket(host)}:{cfg.grpc_port}"
            try:
                if tls is None:
                    self._grpc_port = self._grpc.add_insecure_port(address)
                else:
                    with open(cfg.tls_key_file, "rb") as key, open(cfg.tls_cert_file, "rb") as cert:
                        credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
                    self._grpc_port = self._grpc.add_secure_port(address, credentials)
            except RuntimeError:
                raise CollectorError(httpd.bind_error("OTLP/gRPC", host, cfg.grpc_port, "grpc_port")) from None
            self._http = httpd.listen(host, cfg.http_port, httpd.OTLPHandler, self, "OTLP/HTTP", "http_port", tls)
            self._http_port = self._http.server_address[1]
            self._api = httpd.listen(host, cfg.api_port, httpd.APIHandler, self, "API", "api_port", tls)
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
    def export(self, payload: bytes, encoding: str = "protobuf", signal: str = "traces") -> ExportResult:
        """Parse, validate, admit, make durable, enqueue. ``encoding``: "protobuf" or "json";
        ``signal``: "traces" or "logs"."""
        kind = _SIGNALS[signal]
        try:
            request = kind[encoding](payload)
        except DecodeError as exc:
            return self.refuse(Outcome.INVALID, str(exc), signal)
        if encoding == "json":
            payload = request.SerializeToString()      # the WAL holds protobuf only
        if signal == "logs":
            payload = LOGS_TAG + payload
        total = kind["count"](request)
        noun = kind["metric"]
        self.metrics.add(f"{noun}_received_total", total)
        received = time.time_ns()
        if signal == "traces":   # checked here, flattened by the writer, off the request path
            accepted, rejected, first_error = check(request)
            data, size = payload, len(payload)
        else:                    # log records are few: flattened here
            data, rejected, first_error = kind["flatten"](request, received)
            accepted, size = data.num_rows, data.nbytes
        message = f"{rejected} of {total} {noun.replace('_', ' ')} rejected; first: {first_error}" if rejected else ""
        if accepted:
            with self._lock:
                if not self._accepting:
                    return self.refuse(Outcome.UNAVAILABLE, "the collector is stopping", signal)
                if self._queue_bytes and self._queue_bytes + size > self.config.max_queue_bytes:
                    return self.refuse(Outcome.QUEUE_FULL,
                                       f"queue full: {self._queue_bytes} bytes waiting for Parquet "
                                       f"(max_queue_bytes={self.config.max_queue_bytes})", signal)
                try:
                    position = self._wal.write(payload)
                except OSError as exc:   # disk full or I/O error: nothing was acknowledged; retry later
                    log.error("WAL write failed: %s", exc)
                    return self.refuse(Outcome.DISK, f"WAL write failed: {exc.strerror or exc}", signal)
                self._queue.append((signal, data, received, rejected, size))
                self._queue_bytes += size
            try:
                self._wal.sync(position)   # outside the lock: concurrent exports share an fsync
            except OSError as exc:
                # not acknowledged; the rows stay queued (the writer stores a retry's copy once)
                log.error("WAL fsync failed: %s", exc)
                return self.refuse(Outcome.DISK, f"WAL fsync failed: {exc.strerror or exc}", signal)
            self.metrics.add(f"{noun}_accepted_total", accepted)
        if rejected:
            self.metrics.add(f"{noun}_rejected_total", rejected)
            log.debug("export: %s", message)
        return ExportResult(Outcome.OK, message, accepted, rejected, signal)

    def refuse(self, outcome: Outcome, message: str, signal: str = "traces") -> ExportResult:
        """Count a refused request and describe it (transports use this for their own checks)."""
        self.metrics.refused(outcome)
        suppressed = self._refusal_log.check(outcome.value)
        if suppressed is not None:   # one line per reason and interval: a retry loop must not flood the log
            log.warning("export refused (%s): %s", outcome.value, message,
                        extra={"reason": outcome.value, "signal": signal, "suppressed": suppressed})
        return ExportResult(outcome, message, signal=signal)

    # --- Parquet ---
    def flush(self) -> int:
        """Write everything accepted so far to Parquet; returns the number of spans written."""
        return self.flush_counts()["spans"]

    def flush_counts(self) -> dict[str, int]:
        """Like :meth:`flush`; returns ``{"spans": n, "logs": m}`` rows written."""
        with self._flush_lock:
            written = {"spans": 0, "logs": 0}
            if self._wal is None:
                return written
            start = time.perf_counter()
            with self._lock:
                closed = self._wal.rotate()
                items, self._queue = self._queue, []
            if self._pending is not None:   # retry what a failed flush left behind, oldest first
                items, closed = self._pending[0] + items, self._pending[1] + closed
                self._pending = None
            if not items and not closed:
                return written
            # in chunks, each releasing its bytes from the queue once in Parquet: a writer that is
            # behind makes room for the receivers as it goes, not once per (long) flush
            done = 0
            try:
                while done < len(items):
                    end, size = done, 0
                    while end < len(items) and (end == done or size + items[end][-1] <= _FLUSH_CHUNK_BYTES):
                        size += items[end][-1]
                        end += 1
                    for signal_, kind in _SIGNALS.items():
                        tables = [self._rows(data, received, rejected)
                                  for s, data, received, rejected, _ in items[done:end] if s == signal_]
                        written[kind["table"]] += self._write(signal_, tables)
                    with self._lock:
                        self._queue_bytes -= size
                    done = end
            except Exception:
                # the rest again at the next flush; rows of a chunk that failed half-way are not
                # written twice (the writer's recent keys); the segments stay until all are in
                self._pending = (items[done:], closed)
                self.metrics.add("flush_errors_total")
                raise
            try:
                self._wal.delete(closed)
            except OSError:
                log.exception("could not delete WAL segments %s; they will replay (what is in Parquet is skipped)", closed)
            self.metrics.add("spans_written_total", written["spans"])
            self.metrics.add("log_records_written_total", written["logs"])
            seconds = time.perf_counter() - start
            self.metrics.observe_flush(seconds)
            log.info("flushed %d spans and %d log records to Parquet", written["spans"], written["logs"],
                     extra={"spans": written["spans"], "log_records": written["logs"], "wal_segments": len(closed),
                            "seconds": round(seconds, 4)})
            return written

    def _rows(self, data: bytes | pa.Table, received: int, rejected: int) -> pa.Table:
        """The rows of a queued export: a trace request's bytes are flattened here (the receivers
        checked them with :func:`otlp.check`, so every span they counted as accepted converts)."""
        if isinstance(data, pa.Table):
            return data
        table, flattened_rejected, first_error = flatten(parse_protobuf_request(data), received)
        if flattened_rejected != rejected:   # check() and flatten() disagree: a bug, and loud
            log.error("an acknowledged request flattened with %d spans rejected, %d when checked; first: %s",
                      flattened_rejected, rejected, first_error)
        return table

    def _write(self, signal: str, tables: list[pa.Table]) -> int:
        """One Parquet file per UTC date, sorted by rollout and time, without the rows whose key
        was written recently or repeats in ``tables`` (the first received wins)."""
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return 0
        kind = _SIGNALS[signal]
        name = kind["table"]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        recent = self._recent[name]
        keys = dedup.row_keys(name, table)
        keep = recent.new_rows(keys)
        if keep is not None:
            self.metrics.add(f"{kind['metric']}_deduplicated_total", keep.count(False))
            table = table.filter(pa.array(keep, pa.bool_()))
            keys = [key for key, kept in zip(keys, keep) if kept]
            if not table.num_rows:
                return 0
        days = table.column(kind["time"]).to_numpy() // _NS_PER_DAY
        unique_days = np.unique(days)
        for day in unique_days:
            if len(unique_days) == 1:
                part, part_keys = table, keys
            else:
                rows = days == day
                part = table.filter(pa.array(rows))
                part_keys = [key for key, chosen in zip(keys, rows.tolist()) if chosen]
            part = part.sort_by(kind["sort"])
            partition = f"date={(_EPOCH + timedelta(days=int(day))).isoformat()}"
            store.write_table(self.data_dir, name, part, partition=partition)
            recent.add(part_keys)          # committed: a retried flush leaves this part out
        return table.num_rows

    def _seed_recent(self) -> None:
        """Remember the keys written within the dedup window before this start (an exporter may
        retry across a restart)."""
        now = time.time()
        for name, recent in self._recent.items():
            files = dedup.recent_files(self.data_dir, name, now - self.config.dedup_window_s)
            keys = dedup.load_keys(name, files, received_since_ns=int((now - self.config.dedup_window_s) * 1e9),
                                   limit=max(self.config.dedup_max_keys // 2, 1))
            recent.add(keys)
            if keys:
                log.info("remembered %d %s keys written in the last %g s", len(keys), name,
                         self.config.dedup_window_s, extra={"table": name, "keys": len(keys), "files": len(files)})

    def _replay(self) -> None:
        """Segments left by a previous run → Parquet, before anything new is accepted."""
        segments = self._wal.closed_segment_ids()
        if not segments:
            return
        start, skipped = time.perf_counter(), 0
        # the Parquet that these segments may have produced before the crash: written after the
        # oldest segment's last write
        since = dedup.replay_since([self._wal.segment_path(i) for i in segments])
        stored = {kind["table"]: dedup.recent_files(self.data_dir, kind["table"], since) for kind in _SIGNALS.values()}
        tables = {signal_: [] for signal_ in _SIGNALS}
        batch_bytes, counts = 0, dict.fromkeys(_SIGNALS, 0)
        for payload in self._wal.replay(segments):
            signal_ = "logs" if payload.startswith(LOGS_TAG) else "traces"
            kind = _SIGNALS[signal_]
            try:
                request = kind["protobuf"](payload[len(LOGS_TAG):] if signal_ == "logs" else payload)
            except DecodeError as exc:   # a CRC-valid record that is not a request: keep going
                log.warning("WAL replay: skipping an undecodable record: %s", exc)
                skipped += 1
                continue
            table, _, _ = kind["flatten"](request, time.time_ns())
            tables[signal_].append(table)
            batch_bytes += table.nbytes
            if batch_bytes >= _REPLAY_BATCH_BYTES:
                for name in _SIGNALS:
                    counts[name] += self._write_replayed(name, tables[name], stored)
                    tables[name] = []
                batch_bytes = 0
        for name in _SIGNALS:
            counts[name] += self._write_replayed(name, tables[name], stored)
        self._wal.delete(segments)
        self.metrics.add("spans_replayed_total", counts["traces"])
        self.metrics.add("spans_written_total", counts["traces"])
        self.metrics.add("log_records_written_total", counts["logs"])
        log.info("replayed %d spans and %d log records from %d WAL segments into Parquet",
                 counts["traces"], counts["logs"], len(segments),
                 extra={"spans": counts["traces"], "log_records": counts["logs"], "wal_segments": len(segments),
                        "skipped_records": skipped, "seconds": round(time.perf_counter() - start, 4)})

    def _write_replayed(self, signal: str, tables: list[pa.Table], stored: dict[str, list[Path]]) -> int:
        """:meth:`_write` for replayed rows, less those already in the files in ``stored``."""
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return 0
        name = _SIGNALS[signal]["table"]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        fresh = dedup.drop_stored(name, table, stored[name])
        if fresh.num_rows < table.num_rows:
            self.metrics.add(f"{_SIGNALS[signal]['metric']}_deduplicated_total", table.num_rows - fresh.num_rows)
        return self._write(signal, [fresh])

    def _writer_loop(self) -> None:
        interval = min(self.config.flush_interval_s, threading.TIMEOUT_MAX)
        while not self._stop_event.wait(interval):
            try:
                self.flush()
            except Exception:
                log.exception("flush to Parquet failed; retrying at the next interval")
                continue
            try:
                if self.config.compact_min_files:
                    self.compact(min_files=self.config.compact_min_files + 1)
                self._sweep()
                self.expire()
            except Exception:
                self.metrics.add("maintenance_errors_total")
                log.exception("compaction or retention failed; retrying at the next interval")

    # --- compaction and retention ---
    def compact(self, min_files: int = 2, grace_s: float = COMPACT_GRACE_S) -> int:
        """Merge the small Parquet files of every date partition (spans and logs) that has at
        least ``min_files`` of them into one file; returns the number of files merged away.

        Readers switch to the merged file at once; the files it replaces are removed ``grace_s``
        seconds later (by the writer, or at stop), so queries that listed them still read them."""
        merged = 0
        with self._compact_lock:
            for table in store.PARTITIONED:
                for partition, files in compaction.small_files(self.data_dir, table).items():
                    if len(files) < max(min_files, 2):
                        continue
                    compaction.compact_partition(table, partition, files)
                    merged += len(files)
                    self.metrics.add("compactions_total")
                    self.metrics.add("files_compacted_total", len(files))
                    log.info("compacted %d files of %s/%s", len(files), table, partition.name,
                             extra={"table": table, "partition": partition.name, "files": len(files)})
        self._sweep(grace_s)
        return merged

    def _sweep(self, grace_s: float = COMPACT_GRACE_S) -> None:
        """Remove the files merged files replaced ``grace_s`` seconds ago or more."""
        with self._compact_lock:
            for table in store.PARTITIONED:
                compaction.sweep(self.data_dir, table, grace_s)

    def expire(self) -> list[str]:
        """Delete date partitions older than ``retention_days`` (0 keeps all); returns their paths."""
        removed = []
        with self._compact_lock:
            for table in store.PARTITIONED:
                names = compaction.expire_partitions(self.data_dir, table, self.config.retention_days)
                removed += [f"{table}/{name}" for name in names]
        if removed:
            self.metrics.add("partitions_expired_total", len(removed))
            log.info("retention (%d days) removed %s", self.config.retention_days, ", ".join(removed),
                     extra={"retention_days": self.config.retention_days, "partitions": removed})
        return removed

    # --- gRPC transport ---
    def _grpc_handler(self, signal: str):
        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            metadata = dict(context.invocation_metadata())
            if not httpd.authorized(metadata.get("authorization"), self.config.auth_token):
                result = self.refuse(Outcome.UNAUTHENTICATED, "missing or wrong bearer token: send metadata "
                                     "'authorization: Bearer <collector.auth_token>'", signal)
            else:
                result = self.export(request, "protobuf", signal)
            status = result.status
            if status.grpc_code is grpc.StatusCode.OK:
                return result.response().SerializeToString()
            trailers = [(STATUS_DETAILS_KEY, result.rpc_status(self.config.retry_after_s).SerializeToString())]
            if status.retryable:
                trailers.append((RETRY_INFO_KEY, retry_info(self.config.retry_after_s).SerializeToString()))
            context.set_trailing_metadata(trailers)
            context.abort(status.grpc_code, result.message)
        return handle

    @property
    def sql_timeout_s(self) -> float:
        return self.config.sql_timeout_s

    def health(self) -> dict:
        """The collector's numbers: every counter, refusals by reason, queue and WAL bytes, flush and
        fsync sums and counts, whether it runs, and its queue limit (the web UI's health page)."""
        wal = self._wal
        return {**self.metrics.snapshot(), "queue_bytes": self._queue_bytes,
                "wal_bytes": wal.size_bytes if wal else 0,
                "fsync_seconds_sum": wal.fsync_seconds if wal else 0.0,
                "fsync_seconds_count": wal.fsync_count if wal else 0,
                "running": self.running, "limits": {"max_queue_bytes": self.config.max_queue_bytes}}

    def render_metrics(self) -> str:
        """``GET /metrics``: :meth:`health`'s numbers in the Prometheus text format."""
        return self.metrics.render(self.health())


# --- the service -----------------------------------------------------------------------------

def config_summary(config: CollectorConfig) -> dict:
    """Every config field, for the start-up log line; secrets are only said to be set."""
    summary = dataclasses.asdict(config)
    summary["auth_token"] = "<set>" if config.auth_token else ""
    return summary


def serve(config: CollectorConfig, routes: tuple[Route, ...] = ()) -> int:
    """Run a collector (with ``routes`` added to its API port) until SIGINT or SIGTERM; returns the
    process exit code.

    The process's log lines are formatted by ``config.log_format`` (JSON lines by default)."""
    jsonlog.configure(config.log_format)
    done = threading.Event()

    def on_signal(signum, _frame) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        done.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():   # installed before the ports open
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    collector = Collector(config, routes)
    try:
        try:
            collector.start()
        except CollectorError as exc:
            log.error("%s", exc)
            return 1
        host = httpd.bracket(config.host)
        scheme = "https" if config.tls_cert_file else "http"
        log.info("lightspan collector: OTLP/gRPC %s:%d%s, OTLP/HTTP %s://%s:%d%s and %s, API %s://%s:%d, "
                 "data in %s%s", host, collector.grpc_port, " (TLS)" if config.tls_cert_file else "",
                 scheme, host, collector.http_port, TRACES_PATH, LOGS_PATH, scheme, host, collector.api_port,
                 collector.data_dir, ", bearer token required" if config.auth_token else "",
                 extra={"event": "started", "grpc_port": collector.grpc_port, "http_port": collector.http_port,
                        "api_port": collector.api_port, "pid": os.getpid(), "config": config_summary(config)})
        while not done.wait(3600):
            pass
        return 0
    finally:
        collector.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
