"""The collector's OTLP/gRPC transport (:4317): raw request bytes in, the export's status out.

Thin, like the HTTP transports (:mod:`lightspan.collector.httpd`): it checks the bearer token,
counts the request's bytes against the byte budget the HTTP ports share (a request that does not
fit is refused with UNAVAILABLE + RetryInfo), calls ``Collector.export`` and maps the result's
:class:`~lightspan.collector.outcomes.Outcome` to a status code and trailers. Retryable refusals
carry RetryInfo both in the status details and in the ``google.rpc.retryinfo-bin`` trailer, the
only place the Python exporter reads it. Past ``MAX_CONCURRENT_RPCS`` calls in progress gRPC itself
answers RESOURCE_EXHAUSTED, which exporters retry.
"""

from __future__ import annotations

from concurrent import futures
from typing import TYPE_CHECKING

import grpc

from lightspan.core import web
from lightspan.collector.outcomes import CollectorError, Outcome, retry_info

if TYPE_CHECKING:
    from lightspan.collector.server import Collector

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
LOGS_SERVICE = "opentelemetry.proto.collector.logs.v1.LogsService"
EXPORT_METHOD = f"/{TRACE_SERVICE}/Export"
LOGS_EXPORT_METHOD = f"/{LOGS_SERVICE}/Export"
RETRY_INFO_KEY = "google.rpc.retryinfo-bin"   # the Python OTLP exporter reads RetryInfo only here
STATUS_DETAILS_KEY = "grpc-status-details-bin"
MAX_CONCURRENT_RPCS = 64
_WORKERS = 4
_GRACE_S = 5.0


def bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class GrpcReceiver:
    """The gRPC server of one collector run: ``bind()`` (fails fast), ``start()``, ``stop()``."""

    def __init__(self, collector: "Collector", budget: web.ByteBudget):
        self.collector, self.budget = collector, budget
        self.port: int | None = None
        cfg = collector.config
        self._executor = futures.ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="lightspan-collector-grpc")
        self._server = grpc.server(
            self._executor,
            handlers=[grpc.method_handlers_generic_handler(service, {
                # raw bytes in and out: the WAL stores exactly what the client sent
                "Export": grpc.unary_unary_rpc_method_handler(self._handler(signal)),
            }) for service, signal in ((TRACE_SERVICE, "traces"), (LOGS_SERVICE, "logs"))],
            options=[("grpc.max_receive_message_length", cfg.grpc_max_receive_bytes),
                     ("grpc.so_reuseport", 0)],   # a second collector on the port must fail, not share it
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,   # beyond it: RESOURCE_EXHAUSTED (retryable)
        )

    def bind(self, host: str, port: int, bind_error) -> int:
        cfg = self.collector.config
        address = f"{bracket(host)}:{port}"
        try:
            if not cfg.tls_cert_file:
                self.port = self._server.add_insecure_port(address)
            else:
                with open(cfg.tls_key_file, "rb") as key, open(cfg.tls_cert_file, "rb") as cert:
                    credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
                self.port = self._server.add_secure_port(address, credentials)
        except RuntimeError:
            raise CollectorError(bind_error("OTLP/gRPC", host, port, "grpc_port")) from None
        return self.port

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        """Let the calls in progress finish (5 s at most), then close."""
        self._server.stop(_GRACE_S).wait()
        self._executor.shutdown(wait=False)

    def close(self) -> None:
        """Unbind without serving (a start that failed)."""
        self._server.stop(None)
        self._executor.shutdown(wait=False)

    def _handler(self, signal: str):
        collector = self.collector

        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            metadata = dict(context.invocation_metadata())
            if not web.bearer(metadata.get("authorization"), collector.config.auth_token):
                result = collector.refuse(Outcome.UNAUTHENTICATED, "missing or wrong bearer token: send metadata "
                                          "'authorization: Bearer <collector.auth_token>'", signal)
            elif not self.budget.take(len(request)):
                result = collector.refuse(Outcome.BUSY, f"too many request bytes in flight "
                                          f"(max_inflight_bytes={self.budget.limit}); retry later", signal)
            else:
                try:
                    result = collector.export(request, "protobuf", signal)
                finally:
                    self.budget.give(len(request))
            status = result.status
            if status.grpc_code is grpc.StatusCode.OK:
                return result.response().SerializeToString()
            retry_after_s = collector.config.retry_after_s
            trailers = [(STATUS_DETAILS_KEY, result.rpc_status(retry_after_s).SerializeToString())]
            if status.retryable:
                trailers.append((RETRY_INFO_KEY, retry_info(retry_after_s).SerializeToString()))
            context.set_trailing_metadata(trailers)
            context.abort(status.grpc_code, result.message)
        return handle
