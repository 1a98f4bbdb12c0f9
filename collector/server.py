"""The lightspan collector: OTLP/gRPC and OTLP/HTTP in, WAL, Parquet out (docs/architecture.md).

::

    gRPC :4317 ─┐                                         (lightspan.collector.grpcd)
                ├─ export(bytes) ─ parse ─ check ─ admit ─ writer: WAL, fsync, ack; Parquet later
    HTTP :4318 ─┘                                         (lightspan.collector.httpd, .writer)
    API  :8321 ─ /healthz /metrics /v1/flush /v1/rewards /v1/sql, the web UI's routes

One ``export`` handler serves every transport and both signals (traces and logs); the
transports only frame bytes and map the result's :class:`Outcome` to a status with
:func:`status_for` (permanent vs retryable, in one place). An export is acknowledged only after
its request bytes are fsynced in the WAL (:class:`~lightspan.collector.writer.Writer`); the queue
is bounded, and past it exports are refused with a retryable status, never dropped or crashed on.

This module is the lifecycle: ``start()`` binds every port (fail fast), replays the WAL, then
serves; ``stop()`` stops the receivers, writes everything accepted to Parquet, then closes the
API; a stopped collector may start again. The HTTP ports are :mod:`lightspan.core.web` servers; the
request bytes they and gRPC hold share one budget (``max_inflight_bytes``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time

from lightspan import store
from lightspan.core import web
from lightspan.collector import evaluation_requests, evaluations, forward, httpd, jsonlog, reward_integrity, sqlpool
from lightspan.collector.api import RewardBook
from lightspan.collector.config import CollectorConfig
from lightspan.collector.grpcd import (EXPORT_METHOD, LOGS_EXPORT_METHOD, RETRY_INFO_KEY, GrpcReceiver,
                                       bracket)
from lightspan.collector.httpd import LOGS_PATH, TRACES_PATH
from lightspan.collector.metrics import Metrics
from lightspan.collector.otlp import check
from lightspan.collector.otlp_parse import DecodeError
from lightspan.collector.outcomes import CollectorError, ExportResult, Outcome, Status, status_for
from lightspan.collector.signals import LOGS_TAG, SIGNALS
from lightspan.core.web.routes import Route
from lightspan.collector.writer import COMPACT_GRACE_S, Writer

__all__ = ["Collector", "CollectorError", "ExportResult", "Outcome", "Status", "status_for", "serve",
           "EXPORT_METHOD", "LOGS_EXPORT_METHOD", "RETRY_INFO_KEY", "TRACES_PATH", "LOGS_PATH"]

log = logging.getLogger(__name__)


class Collector:
    """Receivers → WAL → bounded queue → Parquet writer. ``start()``, ``flush()``, ``stop()``."""

    def __init__(self, config: CollectorConfig, routes: tuple[Route, ...] = ()):
        """``routes``: GET routes added to the API port by the process that composes the services
        (the web UI, :mod:`lightspan.core.web.routes`)."""
        self.config = config
        self.routes = tuple(routes)
        self.data_dir = store.data_dir(config.data_dir)     # a Path, or an s3:// URL
        self.metrics = Metrics()
        self.rewards = RewardBook(self.data_dir, config.dedup_max_keys)
        # one value per evaluation: a logs request's evaluation events are checked before the WAL
        self.evaluation_book = evaluation_requests.Book(self.data_dir, config.evaluation_label_values, config.dedup_max_keys)
        self.reward_key = b""        # keys the ids of posted rewards (reward_integrity.load_key), set by start()
        self._state_lock = threading.Lock()
        self._state = "new"           # new → running → stopped (→ running again)
        self._refusal_log = jsonlog.RateLimit(config.log_refusals_every_s)
        self._reset()

    def _reset(self) -> None:
        self.writer = Writer(self.config, self.metrics)
        self.budget = web.ByteBudget(self.config.max_inflight_bytes)   # both HTTP ports and gRPC
        self.queries: sqlpool.QueryPool | None = None
        self.forwarder: forward.Forwarder | None = None
        self._grpc: GrpcReceiver | None = None
        self._http: web.Server | None = None
        self._api: web.Server | None = None
        # OTLP/JSON bodies being decoded (which holds several times a body's size): at most
        # max_json_bytes of them at once, as when they were decoded one at a time, yet a small body
        # is decoded beside a big one instead of waiting for it
        self.json_decoding = web.Allowance(self.config.max_json_bytes)

    # --- ports ---
    @property
    def grpc_port(self) -> int:
        return self._grpc.port if self._grpc else None

    @property
    def http_port(self) -> int:
        return self._http.port if self._http else None

    @property
    def api_port(self) -> int:
        return self._api.port if self._api else None

    @property
    def queue_bytes(self) -> int:
        return self.writer.queue_bytes

    @property
    def evaluations_waiting(self) -> int:
        """Evaluation events waiting for the span they evaluate (collector/evaluations.py)."""
        return len(self.writer.evaluations.pending) if self.writer.evaluations else 0

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def _wal(self):
        return self.writer.wal

    @property
    def sql_timeout_s(self) -> float:
        return self.config.sql_timeout_s

    # --- lifecycle ---
    def start(self) -> "Collector":
        """Bind every port (fail fast), replay the WAL into Parquet, then serve."""
        with self._state_lock:
            if self._state == "running":
                raise CollectorError("the collector is already running")
            self._reset()
            self._bind()
            try:
                self.writer.open()
                self.reward_key = reward_integrity.load_key(self.data_dir)
            except BaseException:
                self._unbind()
                raise
            self.queries = sqlpool.QueryPool(self.config)
            forwarding = forward.parse(self.config.forward)
            if forwarding is not None:
                self.forwarder = forward.Forwarder(forwarding, self.metrics).start()
            self.writer.start()
            self._grpc.start()
            self._http.start()
            self._api.start()
            self._state = "running"
        if self.config.auth_token and not self.config.tls_cert_file and not web.is_loopback(self.config.host):
            log.warning("auth_token is set without TLS on %s: the token crosses the network in clear text",
                        self.config.host)
        return self

    def stop(self) -> None:
        """Stop the receivers, then write everything accepted to Parquet. Idempotent."""
        with self._state_lock:
            if self._state != "running":
                return
            self._grpc.stop()                 # in-flight RPCs finish first
            self._http.stop()
            self.writer.stop()                # a late export is refused; the rest goes to Parquet
            if self.forwarder is not None:
                self.forwarder.stop()         # what is queued, for at most drain_s
            self._api.stop()
            self.queries.close()
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
            self._grpc = GrpcReceiver(self, self.budget)
            self._grpc.bind(host, cfg.grpc_port, httpd.bind_error)
            self._http = httpd.otlp_server(self, tls)
            self._api = httpd.api_server(self, tls)
        except BaseException:
            self._unbind()
            raise

    def _unbind(self) -> None:
        if self._grpc is not None:
            self._grpc.close()
        for server in (self._http, self._api):
            if server is not None:
                server.close()

    # --- the one export handler ---
    def export(self, payload: bytes, encoding: str = "protobuf", signal: str = "traces", *,
               own: bool = False) -> ExportResult:
        """Parse, validate, admit, make durable, enqueue. ``encoding``: "protobuf" or "json";
        ``signal``: "traces" or "logs"; ``own``: the API's rewards, the one request that may hold
        spans of the reward scope (:mod:`~lightspan.collector.reward_integrity`)."""
        kind = SIGNALS[signal]
        json_bytes = len(payload) if encoding == "json" else 0
        if json_bytes and not self.json_decoding.take(json_bytes, self.config.read_timeout_s):
            return self.refuse(Outcome.BUSY, f"OTLP/JSON bodies of max_json_bytes={self.config.max_json_bytes} are "
                                             "being decoded; retry later", signal)
        try:
            request = kind[encoding](payload)
        except DecodeError as exc:
            return self.refuse(Outcome.INVALID, str(exc), signal)
        finally:
            if json_bytes:
                self.json_decoding.give(json_bytes)
        forged, forged_error = (0, None) if own or signal != "traces" else reward_integrity.drop_reserved(request)
        if encoding == "json" or forged:
            payload = request.SerializeToString()      # the WAL holds protobuf only, and no forged reward
        if signal == "logs":
            payload = LOGS_TAG + payload
        total = kind["count"](request) + forged
        noun = kind["metric"]
        self.metrics.add(f"{noun}_received_total", total)
        received = time.time_ns()
        if signal == "traces":   # checked here, flattened by the writer, off the request path
            accepted, rejected, first_error, unusable, claims = check(request)
            data, size = payload, len(payload)
            rejected, first_error = rejected + forged, forged_error or first_error
        else:                    # log records are few: flattened here
            data, rejected, first_error = kind["flatten"](request, received)
            accepted, size, unusable, claims = data.num_rows, data.nbytes, None, 0
        book = self.evaluation_book if signal == "logs" and evaluations.has_events(data) else None
        with book.lock if book else contextlib.nullcontext():   # one evaluation's key at a time
            keys = {}
            if book:
                out, keys, why = book.conflicts(data, self.reward_key)
                if out:      # another value for a stored evaluation: taken out before the WAL
                    data, dropped = evaluation_requests.drop_records(request, data, out)
                    payload = LOGS_TAG + request.SerializeToString()
                    accepted, size, rejected = data.num_rows, data.nbytes, rejected + dropped
                    first_error = first_error or why
                    self.metrics.add("evaluations_conflicting_total", dropped)
            message = f"{rejected} of {total} {noun.replace('_', ' ')} rejected; first: {first_error}" if rejected else ""
            if unusable:   # stored, but marked: an OTLP warning (rejected 0, a message)
                message = "; ".join(m for m in (message, unusable) if m)
            if accepted:
                refused = self.writer.enqueue(signal, payload, data, received, rejected, size)
                if refused is not None:
                    return self.refuse(*refused, signal)
                self.metrics.add(f"{noun}_accepted_total", accepted)
                if book:
                    book.remember(keys)
                if self.forwarder is not None:
                    self._forward(signal, payload, request, own)
        if rejected:
            self.metrics.add(f"{noun}_rejected_total", rejected)
            log.debug("export: %s", message)
        if forged or claims:     # what an agent sent to set its own reward: counted, logged now and then
            self.metrics.add("reward_forgeries_total", forged)
            self.metrics.add("reward_claims_total", claims)
            suppressed = self._refusal_log.check("reward_claims")
            if suppressed is not None:
                log.warning("export: %d span(s) in the collector's reward scope rejected, %d reward source "
                            "claim(s) stored as the agent's", forged, claims,
                            extra={"forged": forged, "claims": claims, "suppressed": suppressed})
        return ExportResult(Outcome.OK, message, accepted, rejected, signal)

    def _forward(self, signal: str, payload: bytes, request, own: bool) -> None:
        """Hand an acknowledged request to the forwarder (collector/forward.py); the API's rewards go
        as gen_ai.evaluation.result events, parented to the call they score when it is stored."""
        if signal == "logs":
            self.forwarder.offer("logs", payload[len(LOGS_TAG):])
        elif not own:
            self.forwarder.offer("traces", payload)       # no span of the reward scope: drop_reserved
        else:
            self.forwarder.offer("logs", evaluation_requests.event_records(
                evaluation_requests.rewards_of(request, self.data_dir)).SerializeToString())

    def refuse(self, outcome: Outcome, message: str, signal: str = "traces") -> ExportResult:
        """Count a refused request and describe it (transports use this for their own checks)."""
        self.metrics.refused(outcome)
        suppressed = self._refusal_log.check(outcome.value)
        if suppressed is not None:   # one line per reason and interval: a retry loop must not flood the log
            log.warning("export refused (%s): %s", outcome.value, message,
                        extra={"reason": outcome.value, "signal": signal, "suppressed": suppressed})
        return ExportResult(outcome, message, signal=signal)

    # --- the writer's operations ---
    def flush(self) -> int:
        """Write everything accepted so far to Parquet; returns the number of spans written."""
        return self.flush_counts()["spans"]

    def flush_counts(self) -> dict[str, int]:
        """Like :meth:`flush`; returns ``{"spans": n, "logs": m}`` rows written."""
        return self.writer.flush_counts()

    def compact(self, min_files: int = 2, grace_s: float = COMPACT_GRACE_S) -> int:
        """Merge the small Parquet files of each date partition with at least ``min_files`` of them
        (see :meth:`Writer.compact`); returns the number of files merged away."""
        return self.writer.compact(min_files, grace_s)

    def expire(self) -> list[str]:
        """Delete date partitions older than ``retention_days`` (0 keeps all); returns their paths."""
        return self.writer.expire()

    def health(self) -> dict:
        """The collector's numbers: every counter, refusals by reason, queue and WAL bytes, flush and
        fsync sums and counts, request bytes and connections held, whether it runs, and its limits
        (the web UI's health page)."""
        wal = self.writer.wal
        servers = [s for s in (self._http, self._api) if s is not None]
        return {**self.metrics.snapshot(), "queue_bytes": self.writer.queue_bytes,
                "wal_bytes": wal.size_bytes if wal else 0,
                "fsync_seconds_sum": wal.fsync_seconds if wal else 0.0,
                "fsync_seconds_count": wal.fsync_count if wal else 0,
                "inflight_bytes": self.budget.held,
                "connections": sum(s.connections for s in servers),
                "connections_refused_total": sum(s.refused for s in servers),
                "running": self.running,
                "limits": {"max_queue_bytes": self.config.max_queue_bytes,
                           "max_inflight_bytes": self.config.max_inflight_bytes}}

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
        host = bracket(config.host)
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
