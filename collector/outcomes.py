"""What happened to one export, and the gRPC/HTTP status it gets: classified once, here.

Every transport (gRPC, OTLP/HTTP, the API's ``POST /v1/rewards``) maps an :class:`Outcome` to
its status with :func:`status_for`, so permanent and retryable refusals cannot drift apart.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse


class Outcome(enum.Enum):
    """What happened to one export. The value is the ``reason`` label of refused requests."""
    OK = "ok"
    INVALID = "invalid"             # not OTLP: the client's data is wrong, retrying cannot help
    TOO_LARGE = "too_large"         # body over the cap (before or after decompression)
    UNSUPPORTED = "unsupported"     # content type or content encoding we do not speak
    UNAUTHENTICATED = "unauthenticated"   # auth_token is set and the request lacks it
    QUEUE_FULL = "queue_full"       # backpressure: Parquet is behind; come back later
    DISK = "disk"                   # the WAL could not be written or fsynced (disk full, I/O error)
    UNAVAILABLE = "unavailable"     # stopping
    BUSY = "busy"                   # too many request bytes, connections or queries in flight
    TIMEOUT = "timeout"             # the request's body did not arrive within read_timeout_s
    FORBIDDEN = "forbidden"         # a cross-site request (Host or Origin not allowed)


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
    Outcome.UNAUTHENTICATED: Status(False, grpc.StatusCode.UNAUTHENTICATED, 401),
    Outcome.QUEUE_FULL: Status(True, grpc.StatusCode.UNAVAILABLE, 503),
    Outcome.DISK: Status(True, grpc.StatusCode.UNAVAILABLE, 503),
    Outcome.UNAVAILABLE: Status(True, grpc.StatusCode.UNAVAILABLE, 503),
    Outcome.BUSY: Status(True, grpc.StatusCode.UNAVAILABLE, 503),
    Outcome.TIMEOUT: Status(False, grpc.StatusCode.DEADLINE_EXCEEDED, 408),
    Outcome.FORBIDDEN: Status(False, grpc.StatusCode.PERMISSION_DENIED, 403),
}
# the HTTP statuses the shared server (lightspan.core.web) answers by itself, as outcomes
BY_HTTP_STATUS = {400: Outcome.INVALID, 403: Outcome.FORBIDDEN, 408: Outcome.TIMEOUT, 411: Outcome.INVALID,
                  413: Outcome.TOO_LARGE, 415: Outcome.UNSUPPORTED, 429: Outcome.BUSY, 503: Outcome.BUSY}


def status_for(outcome: Outcome) -> Status:
    """Permanent outcomes map to codes the OTLP exporters drop at once (400/401/413/415,
    INVALID_ARGUMENT/UNAUTHENTICATED/UNIMPLEMENTED); retryable ones to codes they retry after
    the delay we send (503 + Retry-After, UNAVAILABLE + RetryInfo). Never a 500 for a
    client's data."""
    return _STATUS[outcome]


@dataclass(frozen=True)
class ExportResult:
    outcome: Outcome
    message: str = ""
    accepted: int = 0               # spans or log records
    rejected: int = 0
    signal: str = "traces"          # "traces" or "logs": which OTLP response to answer with

    @property
    def status(self) -> Status:
        return status_for(self.outcome)

    def response(self) -> ExportTraceServiceResponse | ExportLogsServiceResponse:
        # a message with nothing rejected is an OTLP warning (spans stored, but marked unusable)
        if self.signal == "logs":
            response = ExportLogsServiceResponse()
            if self.rejected or self.message:
                response.partial_success.rejected_log_records = self.rejected
                response.partial_success.error_message = self.message
            return response
        response = ExportTraceServiceResponse()
        if self.rejected or self.message:
            response.partial_success.rejected_spans = self.rejected
            response.partial_success.error_message = self.message
        return response

    def rpc_status(self, retry_after_s: int) -> status_pb2.Status:
        """The ``google.rpc.Status`` of a refusal, with RetryInfo when the client should retry."""
        status = status_pb2.Status(code=self.status.grpc_code.value[0], message=self.message)
        if self.status.retryable:
            status.details.add().Pack(retry_info(retry_after_s))
        return status


def retry_info(seconds: int) -> error_details_pb2.RetryInfo:
    info = error_details_pb2.RetryInfo()
    info.retry_delay.seconds = seconds
    return info


class CollectorError(RuntimeError):
    """The collector cannot start (a port is taken, the data directory is not writable)."""
