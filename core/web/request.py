"""Requests and answers of the shared server: the limits, the byte budget, a request's body read
under its deadline and budget, errors answered as JSON (see :mod:`lightspan.core.web`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

import orjson

if TYPE_CHECKING:
    from lightspan.core.web.server import _Handler

MiB = 1 << 20
DRAIN_LIMIT = 8 * MiB     # a refused body up to this size is read and dropped, so the client reads our answer
STATE_CHANGING = {"POST", "PUT", "PATCH", "DELETE"}


@dataclass(frozen=True)
class Limits:
    """What one server may hold. The defaults suit a service on one machine."""
    max_connections: int = 256          # open connections (one thread each); past it, 503 and close
    max_inflight_bytes: int = 256 * MiB  # request body bytes held at once (a private budget)
    read_timeout_s: float = 30.0        # a request's head and body, from its first byte
    idle_timeout_s: float = 60.0        # an idle keep-alive connection is closed after this
    backlog: int = 1024                 # connections the kernel queues before accept()
    retry_after_s: int = 1              # Retry-After of the server's own 503s


class ByteBudget:
    """Bytes held by request handlers, across threads (every connection, gRPC's workers)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > self.limit and self.held:   # an empty budget admits any one request
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


@dataclass
class Response:
    status: int
    content_type: str
    body: bytes
    headers: dict = field(default_factory=dict)


def json_response(status: int, doc, headers: dict | None = None) -> Response:
    return Response(status, "application/json", json.dumps(doc, allow_nan=False).encode(), dict(headers or {}))


class HTTPError(Exception):
    """Answer ``{"error": message}`` with ``status`` (and ``headers``); ``close`` ends the connection."""

    def __init__(self, status: int, message: str, headers: dict | None = None, *, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.headers, self.close = status, message, dict(headers or {}), close

    def response(self) -> Response:
        return json_response(self.status, {"error": self.message}, self.headers)


def retry_later(status: int, message: str, retry_after_s: int, *, close: bool = False) -> HTTPError:
    return HTTPError(status, message, {"Retry-After": str(retry_after_s)}, close=close)


class ClientGone(Exception):
    """The client closed its connection while a streamed answer was being written."""


def decode_json(body: bytes):
    """Strict JSON: UTF-8, no NaN/Infinity literals, no lone surrogates (400 otherwise)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HTTPError(400, f"body is not JSON: {exc}") from None


class Request:
    """One request: its method, path, query and headers (lower-case names), and its body."""

    def __init__(self, handler: "_Handler"):
        self._handler = handler
        self.limits: Limits = handler.server.limits
        self.budget: ByteBudget = handler.server.budget
        self.method: str = handler.command
        target = urlsplit(handler.path)
        self.raw_path: bytes = target.path.encode("latin-1")
        self.path: str = unquote(target.path)
        self.query: str = target.query
        self.headers: dict[str, str] = {}
        # every header as it came, repeats kept (lower-case names): where the first of a repeated
        # header wins rather than the values joined (the gateway's x-lightspan-* headers)
        self.header_list: list[tuple[str, str]] = [(name.lower(), value) for name, value in handler.headers.items()]
        for key, value in self.header_list:   # a repeated header: the values joined, as HTTP allows
            self.headers[key] = f"{self.headers[key]}, {value}" if key in self.headers else value
        self.held = 0              # budget bytes this request holds
        self.started = False       # a streamed answer has begun
        self.body_read = False

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("content-length")
        if value is None:
            return None
        if not value.strip().isdigit():
            raise HTTPError(400, f"bad Content-Length {value[:40]!r}", close=True)
        return int(value)

    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip().lower()

    def body(self, limit: int, *, what: str = "request body") -> bytes:
        """The whole body, at most ``limit`` bytes (413 past it), within the read deadline (408),
        within the server's byte budget (503 + Retry-After)."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            raise HTTPError(411, "chunked bodies are not accepted: send Content-Length", close=True)
        length = self.content_length
        if length is None:
            if self.method in STATE_CHANGING:
                raise HTTPError(411, "a Content-Length header is required", close=True)
            length = 0
        if length > limit:
            self._drain(length)
            raise HTTPError(413, f"{what} of {length} bytes exceeds the limit of {limit} bytes",
                            close=length > DRAIN_LIMIT)
        if not self.budget.take(length):
            self._drain(length)
            raise retry_later(503, f"too many request bytes in flight (limit {self.budget.limit}); retry later",
                              self.limits.retry_after_s, close=length > DRAIN_LIMIT)
        self.held += length
        self.body_read = True
        try:
            data = self._handler.rfile.read(length) if length else b""
        except TimeoutError:
            raise HTTPError(408, f"the request did not arrive within read_timeout_s={self.limits.read_timeout_s:g}",
                            close=True) from None
        except OSError as exc:
            raise HTTPError(400, f"the connection failed while reading the body: {exc}", close=True) from None
        if len(data) != length:
            raise HTTPError(400, f"body ended after {len(data)} of {length} bytes", close=True)
        return data

    def _drain(self, length: int) -> None:
        """Read and drop a body we will not use (small ones only), so the client reads our answer."""
        self.body_read = True
        if length > DRAIN_LIMIT:
            return
        try:
            while length > 0:
                chunk = self._handler.rfile.read(min(length, 1 << 16))
                if not chunk:
                    break
                length -= len(chunk)
        except OSError:
            self._handler.close_connection = True

    def hold(self, n: int) -> None:
        """Count ``n`` more bytes against the budget (what decoding a body will hold)."""
        if not self.budget.take(n):
            raise retry_later(503, "too many request bytes in flight; retry later", self.limits.retry_after_s)
        self.held += n

    def json(self, limit: int):
        """The body as JSON (``application/json`` only: 415 otherwise; 400 when it is not JSON)."""
        kind = self.content_type()
        if kind != "application/json" and not kind.endswith("+json"):
            self._drain(self.content_length or 0)
            raise HTTPError(415, f"content type {kind or 'none'!r}: send application/json")
        return decode_json(self.body(limit))

    def start(self, status: int, headers: dict) -> None:
        """Begin a streamed (chunked) answer; then :meth:`write` its parts and ``write(b"", end=True)``."""
        h = self._handler
        self.started = True
        h.connection.settimeout(self.limits.idle_timeout_s)   # a client that stops reading is dropped
        h.send_response(status)
        for name, value in headers.items():
            h.send_header(name, str(value))
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

    def write(self, data: bytes, *, end: bool = False) -> None:
        """One part of a streamed answer (raises :class:`ClientGone` when the client has left)."""
        frame = (b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + (b"0\r\n\r\n" if end else b"")
        try:
            self._handler.wfile.write(frame)
            self._handler.wfile.flush()
        except OSError as exc:
            self._handler.close_connection = True
            raise ClientGone() from exc

    def abandon(self) -> None:
        """End a streamed answer without its terminator: the client sees the stream broke off."""
        self._handler.close_connection = True


Handler = Callable[[Request], Response | None]
