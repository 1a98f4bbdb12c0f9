"""The one HTTP server of every lightspan service: the standard library's, hardened, in one place.

The collector's OTLP/HTTP receiver and API, the gateway and the trainer's metrics page are
handlers served by :class:`Server` (``http.server`` underneath: a thread per connection, keep-alive,
chunked streaming; ``start()`` binds and returns the port, failing fast with ``OSError``; ``stop()``
may be followed by ``start()`` again). uvicorn was measured against it on the collector's ingest
benchmark and was slower on small requests (bench/README.md), so the bounds are built here.
What a server holds is bounded (:class:`Limits`):

- **connections** (and so threads): past ``max_connections`` open connections a new one is
  answered 503 with ``Retry-After`` and closed; past twice that it is closed at once, so file
  descriptors stay free for the WAL, Parquet and compaction;
- **read time**: a request's head and body must arrive within ``read_timeout_s`` of its first
  byte (every read waits only for the time left, so a client dripping bytes gains nothing); past
  it the request is answered 408 and its connection closed; an idle keep-alive connection is
  closed after ``idle_timeout_s``;
- **request bytes**: the bodies being read or handled share one :class:`ByteBudget` (one per
  server, or one shared by several servers and gRPC); a body that does not fit is refused with
  503 + ``Retry-After``; each body is also capped by its route (413);
- **head size** (64 KiB a line, 100 header lines: the standard library's limits) and the **listen
  backlog** (``backlog``).

A handler is ``handler(request: Request) -> Response | None`` (None once it has streamed its own
answer with :meth:`Request.start` and :meth:`Request.write`); raising :class:`HTTPError` answers
``{"error": message}`` with that status.

Cross-site use (:class:`Guard`): a ``Host`` header must name the machine (an IP literal, or
``localhost``) or one of the configured names, so a DNS-rebinding page cannot read or write;
state-changing requests carrying an ``Origin`` must come from the server's own origin or an
allowed one; JSON routes refuse other content types (:meth:`Request.json`), so a cross-site
``text/plain`` form cannot post there without a CORS preflight.
"""

from __future__ import annotations

import hmac
import io
import ipaddress
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import orjson

from lightspan.config import is_loopback

log = logging.getLogger(__name__)

MiB = 1 << 20
DRAIN_LIMIT = 8 * MiB     # a refused body up to this size is read and dropped, so the client reads our answer
_STATE_CHANGING = {"POST", "PUT", "PATCH", "DELETE"}


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


def same_token(given: str | None, token: str) -> bool:
    """Constant-time comparison of a presented secret with the configured one."""
    return hmac.compare_digest((given or "").encode("utf-8", "surrogateescape"), token.encode())


def bearer(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` value carries ``token`` (always true when no token is set)."""
    if not token:
        return True
    scheme, _, value = (header or "").partition(" ")
    return scheme.lower() == "bearer" and same_token(value.strip(), token)


# --- requests and answers ------------------------------------------------------------------------

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
        for name, value in handler.headers.items():   # a repeated header: the values joined, as HTTP allows
            key = name.lower()
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
            if self.method in _STATE_CHANGING:
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


# --- cross-site use --------------------------------------------------------------------------------

def _host_name(value: str) -> str:
    """The name of a ``Host`` header or an Origin's netloc, without port and brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class Guard:
    """The cross-site checks of one server. ``allowed_hosts``: names besides IP literals and
    ``localhost`` that the ``Host`` header may carry (``*`` allows any); ``field`` names the
    config field that sets them, for the error message."""
    allowed_hosts: tuple[str, ...] = ()
    field: str = "allowed_hosts"

    def _named(self, name: str) -> bool:
        return "*" in self.allowed_hosts or name in {h.lower() for h in self.allowed_hosts}

    def check(self, request: Request) -> None:
        """Raise 403 for a request from another site (see the module docstring)."""
        host = request.headers.get("host")
        if host is not None:
            name = _host_name(host)
            # an IP literal cannot be a rebinding attack: the attacker's page would have its own name
            if not (_is_ip(name) or is_loopback(name) or self._named(name)):
                raise HTTPError(403, f"Host {host[:80]!r} is not served here (DNS-rebinding guard): "
                                     f"add it to {self.field}")
        origin = request.headers.get("origin")
        if origin is not None and request.method in _STATE_CHANGING:
            netloc = urlsplit(origin).netloc.lower() if origin != "null" else ""
            name = _host_name(netloc) if netloc else ""
            if not name or not (netloc == (host or "").strip().lower() or is_loopback(name) or self._named(name)):
                raise HTTPError(403, f"cross-site request from Origin {origin[:80]!r} refused; a browser page may "
                                     f"call this server from its own origin or one in {self.field}")


# --- the server ------------------------------------------------------------------------------------

class _DeadlineIO(io.RawIOBase):
    """A connection's socket, read under the current request's deadline: a new connection's first
    byte may wait ``read_timeout_s``, a kept-alive one's next request ``idle_timeout_s``; from a
    request's first byte on, every read waits only for what is left of ``read_timeout_s``."""

    def __init__(self, sock: socket.socket, limits: Limits):
        self.sock, self.limits = sock, limits
        self.deadline: float | None = None    # None: between requests
        self.idle_s = limits.read_timeout_s   # until a first request has been answered

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.deadline is None:
            self.sock.settimeout(self.idle_s)
        else:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("read_timeout_s")
            self.sock.settimeout(left)
        n = self.sock.recv_into(buffer)
        if self.deadline is None and n:
            self.deadline = time.monotonic() + self.limits.read_timeout_s
        return n


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive: exporters and agents reuse their connection
    # TCP_NODELAY: the headers and the body go out in two writes; with Nagle the second waits for
    # the client's delayed ACK (40 ms a request on Linux loopback)
    disable_nagle_algorithm = True
    server: "_HTTPServer"

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.reader = _DeadlineIO(self.connection, self.server.limits)
        self.rfile = io.BufferedReader(self.reader, 1 << 16)

    def handle_one_request(self) -> None:
        if self.reader.deadline is not None:     # a request was answered: the next may wait longer
            self.reader.idle_s = self.server.limits.idle_timeout_s
        self.reader.deadline = None
        self.server.mark(self.connection, idle=True)
        super().handle_one_request()

    def parse_request(self) -> bool:
        self.server.mark(self.connection, idle=False)    # a request has arrived: not idle until answered
        return super().parse_request()

    def log_message(self, format, *args) -> None:  # noqa: A002 (the stdlib's name)
        log.debug("%s %s", self.address_string(), format % args)

    def _dispatch(self) -> None:
        server = self.server
        request = Request(self)
        try:
            if server.over_cap():
                self.close_connection = True
                response = retry_later(503, "too many connections; retry later", server.limits.retry_after_s).response()
            else:
                response = self._run(request)
            if response is not None and not request.started:
                self._answer(response, request)
        finally:
            server.budget.give(request.held)

    def _run(self, request: Request) -> Response | None:
        try:
            return self.server.app(request)
        except HTTPError as exc:
            if exc.close:
                self.close_connection = True
            return exc.response()
        except ClientGone:
            return None
        except Exception as exc:
            log.exception("%s: error answering %s %s", self.server.name, request.method, request.path)
            self.close_connection = True
            return None if request.started else HTTPError(500, f"internal error: {type(exc).__name__}").response()

    def _answer(self, response: Response, request: Request) -> None:
        length = request.content_length if "content-length" in request.headers else 0
        if not request.body_read and length:
            request._drain(length)    # an unread body: drop it so the connection stays usable
            if length > DRAIN_LIMIT:
                self.close_connection = True
        self.connection.settimeout(self.server.limits.idle_timeout_s)
        self.send_response(response.status)
        headers = {"Content-Type": response.content_type, "Content-Length": str(len(response.body)),
                   **response.headers}
        if self.close_connection:
            headers["Connection"] = "close"
        for name, value in headers.items():
            self.send_header(name, str(value))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _dispatch


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, app: Handler, limits: Limits, budget: ByteBudget, tls, name: str):
        self.app, self.limits, self.budget, self.tls, self.name = app, limits, budget, tls, name
        self.request_queue_size = limits.backlog
        self.open: dict[socket.socket, bool] = {}     # connection -> idle (waiting for a request)
        self.refused = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:
        with self._lock:
            count = len(self.open)
            if count >= self.limits.max_connections:
                self.refused += 1
            if count >= 2 * self.limits.max_connections:   # not even a 503: keep descriptors free
                request.close()
                return
            self.open[request] = False
        threading.Thread(target=self._connection, args=(request, client_address, count >= self.limits.max_connections),
                         name=f"{self.name}-connection", daemon=True).start()

    def _connection(self, sock: socket.socket, client_address, over_cap: bool) -> None:
        conn = sock
        try:
            if self.tls is not None:
                sock.settimeout(self.limits.read_timeout_s)   # the handshake runs here, in the connection's thread
                conn = self.tls.wrap_socket(sock, server_side=True)
                with self._lock:
                    self.open.pop(sock, None)
                    self.open[conn] = False
            self._local.over_cap = over_cap
            self.RequestHandlerClass(conn, client_address, self)
        except (ssl.SSLError, ConnectionError, TimeoutError) as exc:
            log.debug("connection from %s dropped: %s", client_address, exc)
        except Exception:
            log.exception("%s: unexpected error serving %s", self.name, client_address)
        finally:
            with self._lock:
                self.open.pop(conn, None)
                self.open.pop(sock, None)
            _shut(conn)
            conn.close()

    def over_cap(self) -> bool:
        return getattr(self._local, "over_cap", False)

    def mark(self, conn: socket.socket, *, idle: bool) -> None:
        with self._lock:
            if conn in self.open:
                self.open[conn] = idle


class Server:
    """One ``handler`` on ``host:port`` (0 = any free port), served from a daemon thread."""

    def __init__(self, handler: Handler, host: str, port: int, *, limits: Limits = Limits(),
                 budget: ByteBudget | None = None, tls: ssl.SSLContext | None = None, name: str = "lightspan"):
        self.handler, self.host, self.requested_port = handler, host.strip("[]"), port
        self.limits, self.tls, self.name = limits, tls, name
        self.budget = budget or ByteBudget(limits.max_inflight_bytes)
        self.port: int | None = None
        self._server: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    @property
    def connections(self) -> int:
        return len(self._server.open) if self._server else 0

    @property
    def refused(self) -> int:
        """Connections refused because ``max_connections`` were open."""
        return self._server.refused if self._server else 0

    def bind(self) -> int:
        """Open the listening socket (``OSError`` when the address is taken); returns the port."""
        self._server = _HTTPServer((self.host, self.requested_port), self.handler, self.limits, self.budget,
                                   self.tls, self.name)
        self.port = self._server.server_address[1]
        return self.port

    def start(self) -> int:
        """Bind (unless :meth:`bind` did) and serve; returns the port."""
        if self._server is None:
            self.bind()
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"{self.name}-http", daemon=True)
        self._thread.start()
        return self.port

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting, give the requests in progress ``grace_s``, close every connection. Idempotent."""
        if self._server is None:
            return
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        deadline = time.monotonic() + grace_s
        while self._server.open and time.monotonic() < deadline:
            for sock, idle in list(self._server.open.items()):   # idle keep-alive connections: end them now
                if idle:
                    _shut_reading(sock)
            time.sleep(0.02)
        for sock in list(self._server.open):
            _shut(sock)
        self.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.server_close()
            self._server = None


def _shut_reading(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
