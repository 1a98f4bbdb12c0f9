"""The shared server: the standard library's ``http.server`` with a connection cap, a deadline on
every request's arrival and a byte budget (see :mod:`lightspan.core.web`)."""

from __future__ import annotations

import io
import logging
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from lightspan.core.web.request import (DRAIN_LIMIT, ByteBudget, ClientGone, Handler, HTTPError, Limits, Request, Response,
                                    retry_later)

log = logging.getLogger("lightspan.core.web")


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
        try:
            length = request.content_length or 0
        except HTTPError:              # a Content-Length that is not a number: the body cannot be framed
            length, self.close_connection = 0, True
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
        except (ssl.SSLError, OSError) as exc:   # the client left, a handshake failed, the server stopped
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
