"""The one HTTP server of every lightspan service: uvicorn (h11) under bounds set by construction.

The collector's OTLP/HTTP receiver and API, the gateway and the trainer's metrics page are ASGI
handlers served by :class:`Server`, which runs a uvicorn server on its own event loop in a daemon
thread (``start()`` binds and returns the port, fails fast with ``OSError``; ``stop()`` drains and
may be followed by ``start()`` again). What a server holds is bounded (:class:`Limits`):

- **connections**: past ``max_connections`` open connections a new one is answered 503 with
  ``Retry-After`` and closed; past twice that it is closed at once (file descriptors stay free
  for the WAL, Parquet and compaction);
- **read time**: a request's head and body must arrive within ``read_timeout_s`` of its first
  byte (a fresh connection must send one within it too); a handler reading a body answers 408
  when the time is up, and the connection is closed a second later in any case, so a client that
  never sends its body holds nothing for long;
- **request bytes**: the bodies being read or handled share one :class:`ByteBudget` (one per
  server, or one shared by several servers and gRPC); a body that does not fit is refused with
  503 + ``Retry-After``; each body is also capped by its route (413);
- **head size** (``max_head_bytes``), **idle keep-alive** (``idle_timeout_s``) and the **listen
  backlog** (``backlog``).

A handler is ``async def handler(request: Request) -> Response | None`` (None once it has
streamed its own answer with :meth:`Request.start` and :meth:`Request.write`); raising
:class:`HTTPError` answers ``{"error": message}`` with that status.

Cross-site use (:class:`Guard`): a ``Host`` header must name the machine (an IP literal, or
``localhost``) or one of the configured names, so a DNS-rebinding page cannot read or write;
state-changing requests carrying an ``Origin`` must come from the server's own origin or an
allowed one; JSON routes refuse other content types (:meth:`Request.json`), so a cross-site
``text/plain`` form cannot post there without a CORS preflight.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import h11
import orjson
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lightspan.config import is_loopback

log = logging.getLogger(__name__)

MiB = 1 << 20
_STATE_CHANGING = {"POST", "PUT", "PATCH", "DELETE"}
_BACKSTOP_S = 1.0     # the protocol closes a request this long after the handler's own deadline


@dataclass(frozen=True)
class Limits:
    """What one server may hold. The defaults suit a service on one machine."""
    max_connections: int = 256          # open connections; past it, 503 + Retry-After and close
    max_inflight_bytes: int = 256 * MiB  # request body bytes held at once (a private budget)
    read_timeout_s: float = 30.0        # a request's head and body, from its first byte
    idle_timeout_s: float = 60.0        # an idle keep-alive connection is closed after this
    backlog: int = 1024                 # connections the kernel queues before accept()
    max_head_bytes: int = 64 << 10      # request line and headers
    retry_after_s: int = 1              # Retry-After of the server's own 503s


class ByteBudget:
    """Bytes held by request handlers, across threads (the event loop, gRPC's workers)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self.refused = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > self.limit and self.held:   # an empty budget admits any one request
                self.refused += 1
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
        headers = {**self.headers, **({"Connection": "close"} if self.close else {})}
        return json_response(self.status, {"error": self.message}, headers)


def retry_later(status: int, message: str, retry_after_s: int) -> HTTPError:
    return HTTPError(status, message, {"Retry-After": str(retry_after_s)}, close=True)


class Request:
    """One request: its method, path, query and headers (lower-case names), and its body."""

    def __init__(self, scope, receive, send, limits: Limits, budget: ByteBudget):
        self.scope, self._receive, self._send = scope, receive, send
        self.limits, self.budget = limits, budget
        self.method: str = scope["method"]
        self.raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        self.path: str = scope["path"]
        self.query: str = scope["query_string"].decode("latin-1")
        self.headers: dict[str, str] = {}
        for name, value in scope["headers"]:   # a repeated header: the values joined, as HTTP allows
            key, text = name.decode("latin-1"), value.decode("latin-1")
            self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text
        self.held = 0                          # budget bytes this request holds
        self.started = False                   # a streamed answer has begun
        self.deadline = asyncio.get_running_loop().time() + limits.read_timeout_s

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("content-length")
        if value is None:
            return None
        if not value.isdigit():
            raise HTTPError(400, f"bad Content-Length {value[:40]!r}", close=True)
        return int(value)

    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip().lower()

    async def body(self, limit: int, *, what: str = "request body") -> bytes:
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
            raise HTTPError(413, f"{what} of {length} bytes exceeds the limit of {limit} bytes", close=True)
        if not self.budget.take(length):
            raise retry_later(503, f"too many request bytes in flight (limit {self.budget.limit}); retry later",
                              self.limits.retry_after_s)
        self.held += length
        chunks, size = [], 0
        try:
            async with asyncio.timeout_at(self.deadline):   # one deadline for the whole body
                while size < length:
                    message = await self._receive()
                    if message["type"] == "http.disconnect":
                        raise HTTPError(400, f"the client left after {size} of {length} bytes", close=True)
                    chunk = message.get("body", b"")
                    chunks.append(chunk)
                    size += len(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise HTTPError(408, f"the body did not arrive within {self.limits.read_timeout_s:g} s "
                                 f"({size} of {length} bytes)", close=True) from None
        if size != length:
            raise HTTPError(400, f"body ended after {size} of {length} bytes", close=True)
        return b"".join(chunks)

    def hold(self, n: int) -> None:
        """Count ``n`` more bytes against the budget (what decoding a body will hold)."""
        if not self.budget.take(n):
            raise retry_later(503, "too many request bytes in flight; retry later", self.limits.retry_after_s)
        self.held += n

    async def json(self, limit: int):
        """The body as JSON (``application/json`` only: 415 otherwise; 400 when it is not JSON)."""
        length = self.content_length
        kind = self.content_type()
        if kind != "application/json" and not kind.endswith("+json"):
            raise HTTPError(415, f"content type {kind or 'none'!r}: send application/json", close=bool(length))
        return decode_json(await self.body(limit))

    def watch_disconnect(self) -> asyncio.Task:
        """A task done when the client goes away (call once the body has been read; cancel it after)."""
        async def wait() -> None:
            while (await self._receive())["type"] != "http.disconnect":
                pass
        return asyncio.ensure_future(wait())

    async def start(self, status: int, headers: dict) -> None:
        """Begin a streamed answer (chunked); then :meth:`write` its parts and ``write(b"", end=True)``."""
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": _encode(headers)})

    async def write(self, data: bytes, *, end: bool = False) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": not end})

    async def answer(self, response: Response) -> None:
        headers = {"content-type": response.content_type, "content-length": str(len(response.body)),
                   **{k.lower(): str(v) for k, v in response.headers.items()}}
        await self._send({"type": "http.response.start", "status": response.status, "headers": _encode(headers)})
        await self._send({"type": "http.response.body", "body": response.body})


def _encode(headers: dict) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in headers.items()]


def decode_json(body: bytes):
    """Strict JSON: UTF-8, no NaN/Infinity literals, no lone surrogates (400 otherwise)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HTTPError(400, f"body is not JSON: {exc}") from None


Handler = Callable[[Request], Awaitable[Response | None]]


def asgi(handler: Handler, limits: Limits, budget: ByteBudget, name: str):
    """The ASGI application of ``handler``: errors answered, the budget given back, never a 500
    for the client's data (a handler's own bug is logged and answered 500)."""

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive, send, limits, budget)
        try:
            try:
                response = await handler(request)
            except HTTPError as exc:
                response = exc.response()
            except Exception as exc:
                log.exception("%s: error answering %s %s", name, request.method, request.path)
                if request.started:
                    raise
                response = HTTPError(500, f"internal error: {type(exc).__name__}", close=True).response()
            if response is not None and not request.started:
                await request.answer(response)
        finally:
            budget.give(request.held)
    return app


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
                                     f"add it to {self.field}", close=True)
        origin = request.headers.get("origin")
        if origin is not None and request.method in _STATE_CHANGING:
            netloc = urlsplit(origin).netloc.lower() if origin != "null" else ""
            name = _host_name(netloc) if netloc else ""
            if not name or not (netloc == (host or "").strip().lower() or is_loopback(name) or self._named(name)):
                raise HTTPError(403, f"cross-site request from Origin {origin[:80]!r} refused; "
                                     f"a browser page may call this server from its own origin or one in {self.field}",
                                close=True)


# --- the server ------------------------------------------------------------------------------------

class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and a deadline on each request's arrival."""

    limits: Limits              # set on the per-server subclass
    refused: list[int]          # [connections refused], shared with the Server

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None         # replaced by the cap below, which sends Retry-After
        self._over_cap = False
        self._timer: asyncio.TimerHandle | None = None
        app = self.app

        async def gated(scope, receive, send):   # this connection's requests, over the cap: 503
            if self._over_cap:
                body = b'{"error": "too many connections; retry later"}'
                await send({"type": "http.response.start", "status": 503, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(self.limits.retry_after_s).encode()), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
            await app(scope, receive, send)
        self.app = gated

    def connection_made(self, transport) -> None:
        open_ = len(self.connections)
        if open_ >= 2 * self.limits.max_connections:   # not even a 503: keep descriptors free
            self.transport = transport
            self.refused[0] += 1
            transport.abort()
            return
        super().connection_made(transport)
        if open_ >= self.limits.max_connections:
            self._over_cap = True
            self.refused[0] += 1
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self._arm()                       # a request has begun to arrive: it has until the deadline
        else:
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self.flow is None:                 # aborted in connection_made
            self.connections.discard(self)
            return
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(self.limits.read_timeout_s + _BACKSTOP_S, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            log.debug("closing a connection whose request did not arrive within %g s", self.limits.read_timeout_s)
            self.transport.close()


class Server:
    """One ASGI ``handler`` on ``host:port`` (0 = any free port), served from a daemon thread."""

    def __init__(self, handler: Handler, host: str, port: int, *, limits: Limits = Limits(),
                 budget: ByteBudget | None = None, tls: ssl.SSLContext | None = None, name: str = "lightspan",
                 on_stop: Callable[[], Awaitable[None]] | None = None):
        """``on_stop``: a coroutine run on the server's event loop once it has stopped serving
        (to close what the handler opened there, e.g. an HTTP client's connections)."""
        self.handler, self.host, self.requested_port = handler, host.strip("[]"), port
        self.on_stop = on_stop
        self.limits, self.tls, self.name = limits, tls, name
        self.budget = budget or ByteBudget(limits.max_inflight_bytes)
        self.port: int | None = None
        self.refused = [0]
        self._thread: threading.Thread | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._socket: socket.socket | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    @property
    def connections(self) -> int:
        return len(self._uvicorn.server_state.connections) if self._uvicorn else 0

    def bind(self) -> int:
        """Open the listening socket (``OSError`` when the address is taken); returns the port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._socket = socket.create_server((self.host, self.requested_port), family=family,
                                            backlog=self.limits.backlog)
        self.port = self._socket.getsockname()[1]
        return self.port

    def start(self) -> int:
        """Bind (unless :meth:`bind` did) and serve; returns the port once it accepts connections."""
        if self._socket is None:
            self.bind()
        protocol = type("Protocol", (_Protocol,), {"limits": self.limits, "refused": self.refused})
        tls = self.tls
        config = uvicorn.Config(
            asgi(self.handler, self.limits, self.budget, self.name), http=protocol, lifespan="off",
            interface="asgi3", log_config=None, access_log=False, proxy_headers=False, server_header=False,
            backlog=self.limits.backlog, timeout_keep_alive=self.limits.idle_timeout_s,
            h11_max_incomplete_event_size=self.limits.max_head_bytes, timeout_graceful_shutdown=5,
            ssl_context_factory=(lambda _config, _default: tls) if tls else None,
            ws="none")
        config.load()
        self._uvicorn = uvicorn.Server(config)
        self._uvicorn.lifespan = config.lifespan_class(config)   # what uvicorn's serve() would set
        ready, failed = threading.Event(), []

        async def main() -> None:
            try:
                await self._uvicorn.startup(sockets=[self._socket])
            except BaseException as exc:   # noqa: BLE001 (reported to start())
                failed.append(exc)
                ready.set()
                return
            ready.set()
            await self._uvicorn.main_loop()
            await self._uvicorn.shutdown(sockets=[self._socket])
            if self.on_stop is not None:
                await self.on_stop()

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), name=f"{self.name}-http", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            self.close()
            raise failed[0]
        return self.port

    def stop(self) -> None:
        """Stop accepting, let the requests in progress finish (5 s at most), close. Idempotent."""
        if self._thread is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=15)
            self._thread = None
        self.close()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
