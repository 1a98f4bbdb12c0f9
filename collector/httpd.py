"""The collector's HTTP transports: OTLP/HTTP (:4318) and the API (:8321).

Both are thin: they frame bytes, check the bearer token, and map the collector's
:class:`~lightspan.collector.outcomes.ExportResult` to a status with ``status_for``.

OTLP/HTTP: ``POST /v1/traces`` and ``POST /v1/logs``, protobuf or JSON (answered in the
request's content type), optionally gzip/deflate; bodies are capped before and after
decompression (413).

API: ``GET /healthz`` (open even with a token), ``GET /metrics``, ``POST /v1/flush``,
``POST /v1/rewards`` (late rewards, see :mod:`lightspan.collector.api`), ``POST
/v1/rollouts/ID/events`` (Agent Lightning's reward events), ``POST /v1/sql``
``{"sql": ...}`` and ``GET /v1/sql?q=...`` (read-only SQL), and the GET routes the composing
process added (:mod:`lightspan.collector.routes`: the web UI). API answers are JSON; errors are
``{"error": message}`` with 400 for the client's mistakes and never 500 for its data.

With ``tls_cert_file``/``tls_key_file`` both servers speak HTTPS; the TLS handshake runs in the
connection's own thread, so a slow client cannot stall the accept loop.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import ssl
import sys
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

from google.protobuf import json_format

from lightspan.collector import api, routes
from lightspan.collector.outcomes import CollectorError, ExportResult, Outcome

if TYPE_CHECKING:
    from lightspan.collector.server import Collector

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
LOGS_PATH = "/v1/logs"
_SIGNALS = {TRACES_PATH: "traces", LOGS_PATH: "logs"}
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
DRAIN_LIMIT = 8 << 20         # bytes of a refused body read and thrown away before hanging up
_API_ROUTES = ("GET /healthz, GET /metrics, POST /v1/flush, POST /v1/rewards, POST /v1/rollouts/ID/events, "
               "POST or GET /v1/sql")


class HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, handler, collector: "Collector", tls: ssl.SSLContext | None = None):
        self.collector = collector
        self.tls = tls
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def finish_request(self, request, client_address) -> None:
        if self.tls is None:
            return super().finish_request(request, client_address)
        request.settimeout(BaseHandler.timeout)   # the handshake runs here, in the connection's thread
        try:
            tls_request = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            log.debug("TLS handshake with %s failed: %s", client_address, exc)
            return
        try:
            super().finish_request(tls_request, client_address)
        finally:
            self.shutdown_request(tls_request)    # the caller closes the plain socket, now detached

    def handle_error(self, request, client_address) -> None:  # the stdlib prints to stderr
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):   # the client left mid-answer
            log.debug("%s closed the connection before the answer was written", client_address)
            return
        log.exception("unexpected error serving %s", client_address)


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise CollectorError(f"cannot load the TLS certificate {cert_file!r} / key {key_file!r}: {exc}; "
                             "fix collector.tls_cert_file and collector.tls_key_file") from None
    return context


def bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bind_error(what: str, host: str, port: int, field: str) -> str:
    return (f"cannot listen for {what} on {host}:{port}: the address is in use or not available "
            f"(another collector running?); set collector.{field} (LIGHTSPAN_COLLECTOR_{field.upper()}) "
            f"to a free port, or 0 for any")


def listen(host: str, port: int, handler, collector: "Collector", what: str, field: str,
           tls: ssl.SSLContext | None) -> HTTPServer:
    try:
        return HTTPServer((host.strip("[]"), port), handler, collector, tls)
    except OSError as exc:
        raise CollectorError(f"{bind_error(what, host, port, field)} ({exc.strerror or exc})") from None


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``authorization`` value carries ``token`` (always true when no token is set)."""
    if not token:
        return True
    scheme, _, value = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


class BaseHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive: the exporters reuse their connection
    # TCP_NODELAY: the headers and the body go out in two writes; with Nagle the second waits for
    # the client's delayed ACK (40 ms a request on Linux loopback)
    disable_nagle_algorithm = True
    server_version = "lightspan-collector"
    timeout = 60                    # an idle keep-alive connection is closed after this

    @property
    def collector(self) -> "Collector":
        return self.server.collector

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

    def send_json(self, code: int, doc, headers: dict | None = None) -> None:
        self.send(code, json.dumps(doc, allow_nan=False).encode(), JSON, headers)

    def not_allowed(self, allow: str) -> None:
        self.discard_body()
        self.send_text(405, f"method {self.command} not allowed on {self.path}; use {allow}\n", {"Allow": allow})

    def check_auth(self) -> ExportResult | None:
        """A refusal when the bearer token is required and missing or wrong (the body is dropped)."""
        if authorized(self.headers.get("Authorization"), self.collector.config.auth_token):
            return None
        self.discard_body()
        return self.collector.refuse(Outcome.UNAUTHENTICATED, "missing or wrong bearer token: send "
                                     "'authorization: Bearer <collector.auth_token>'")

    def discard_body(self) -> None:
        """Read and drop a body we will not use, so the client reads our answer, not a reset."""
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > DRAIN_LIMIT:
            self.close_connection = True
            return
        while length > 0:
            chunk = self.rfile.read(min(length, 1 << 16))
            if not chunk:
                break
            length -= len(chunk)

    def read_body(self) -> bytes | ExportResult:
        """The request body, decompressed, within ``max_http_body_bytes``; or the refusal."""
        collector = self.collector
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

    def retry_headers(self, result: ExportResult) -> dict:
        headers = {}
        if result.status.retryable:
            headers["Retry-After"] = str(self.collector.config.retry_after_s)
        if result.outcome is Outcome.UNAUTHENTICATED:
            headers["WWW-Authenticate"] = 'Bearer realm="lightspan-collector"'
        return headers


class OTLPHandler(BaseHandler):
    """``POST /v1/traces`` and ``POST /v1/logs``: OTLP/HTTP, protobuf or JSON, optionally gzip/deflate."""

    def do_POST(self) -> None:
        signal = _SIGNALS.get(urlsplit(self.path).path)
        if signal is None:
            self.discard_body()
            return self.send_text(404, f"not found: POST OTLP to {TRACES_PATH} or {LOGS_PATH}\n")
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        encoding = {PROTOBUF: "protobuf", JSON: "json"}.get(content_type)
        refused = self.check_auth()
        if refused is not None:
            return self.answer(refused, encoding or "json")
        if encoding is None:
            self.discard_body()
            return self.answer(self.collector.refuse(
                Outcome.UNSUPPORTED, f"content type {content_type!r}: send {PROTOBUF} or {JSON}"), "json")
        body = self.read_body()
        if isinstance(body, ExportResult):
            return self.answer(body, encoding)
        self.answer(self.collector.export(body, encoding, signal), encoding)

    def answer(self, result: ExportResult, encoding: str) -> None:
        if result.status.http_status == 200:
            message = result.response()
        else:
            message = result.rpc_status(self.collector.config.retry_after_s)
        if encoding == "json":
            body, content_type = json_format.MessageToJson(message, indent=None).encode(), JSON
        else:
            body, content_type = message.SerializeToString(), PROTOBUF
        self.send(result.status.http_status, body, content_type, self.retry_headers(result))

    def do_GET(self) -> None:
        if urlsplit(self.path).path in _SIGNALS:
            return self.not_allowed("POST")
        self.discard_body()
        self.send_text(404, f"not found: POST OTLP to {TRACES_PATH} or {LOGS_PATH}\n")

    do_PUT = do_DELETE = do_PATCH = do_GET


def _decompress(body: bytes, wbits: int, cap: int, collector: "Collector") -> bytes | ExportResult:
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


class APIHandler(BaseHandler):
    """The API port: health, metrics, flush, late rewards, read-only SQL, the web UI."""

    _GET = ("/healthz", "/metrics", "/v1/sql")
    _POST = ("/v1/flush", "/v1/rewards", "/v1/sql")

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/healthz":   # open without the token: load balancers and probes call it
            ok = self.collector.running
            return self.send_json(200 if ok else 503, {"status": "ok" if ok else "stopping"})
        added = routes.find(self.collector.routes, url.path)
        if added is not None:
            if added.open or self.allowed():
                self.send_response_of(added.handler(url.path, url.query, self.collector))
            return
        if url.path not in self._GET:
            if url.path in self._POST:
                return self.not_allowed("POST")
            return self.send_text(404, f"not found: {self.routes_text()}\n")
        if not self.allowed():
            return
        if url.path == "/metrics":
            return self.send(200, self.collector.render_metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
        queries = parse_qs(url.query).get("q")
        self.sql(queries[0] if queries else "")

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if api.event_rollout(path) is not None:
            return self.event(api.event_rollout(path))
        if path not in self._POST:
            self.discard_body()
            if path in self._GET:
                return self.send_text(405, f"use GET on {path}\n", {"Allow": "GET"})
            return self.send_text(404, f"not found: {self.routes_text()}\n")
        if not self.allowed():
            return
        if path == "/v1/flush":
            self.discard_body()
            return self.flush()
        doc = self.read_json()
        if doc is None:
            return
        if path == "/v1/rewards":
            return self.rewards(doc)
        self.sql(doc.get("sql") if isinstance(doc, dict) else None)

    def routes_text(self) -> str:
        added = [f"GET {r.prefix or r.paths[0]}" for r in self.collector.routes]
        return ", ".join([_API_ROUTES, *added])

    def send_response_of(self, response: routes.Response) -> None:
        self.send(response.status, response.body, response.content_type, response.headers)

    def allowed(self) -> bool:
        refused = self.check_auth()
        if refused is not None:
            self.send_json(401, {"error": refused.message}, self.retry_headers(refused))
        return refused is None

    def read_json(self):
        """The JSON body, or None after answering the error."""
        body = self.read_body()
        if isinstance(body, ExportResult):
            self.send_json(body.status.http_status, {"error": body.message}, self.retry_headers(body))
            return None
        try:
            return json.loads(body)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            self.send_json(400, {"error": f"body is not JSON: {exc}"})
            return None

    def flush(self) -> None:
        try:
            flushed = self.collector.flush_counts()
        except Exception as exc:  # our own failure (disk), not the client's data: retry later
            log.exception("flush requested over the API failed")
            return self.send_json(503, {"error": f"flush failed: {exc}"},
                                  {"Retry-After": str(self.collector.config.retry_after_s)})
        self.send_json(200, {"flushed_spans": flushed["spans"], "flushed_log_records": flushed["logs"]})

    def event(self, rollout_id: str) -> None:
        """``POST /v1/rollouts/ID/events``: an Agent Lightning reward event is a reward of rollout ID."""
        if not self.allowed():
            return
        doc = self.read_json()
        if doc is None:
            return
        try:
            reward = api.event_reward(rollout_id, doc, time.time_ns())
        except api.BadRequest as exc:
            self.collector.refuse(Outcome.INVALID, str(exc))
            return self.send_json(400, {"error": str(exc)})
        if reward is None:
            self.collector.metrics.add("events_ignored_total")
            return self.send_json(200, {"accepted": 0, "ignored": doc["event_type"]})
        self.rewards(reward)

    def rewards(self, doc) -> None:
        try:
            request, recorded = api.reward_request(doc, time.time_ns())
        except api.BadRequest as exc:
            self.collector.refuse(Outcome.INVALID, str(exc))
            return self.send_json(400, {"error": str(exc)})
        result = self.collector.export(request.SerializeToString(), "protobuf")
        if result.outcome is not Outcome.OK or result.rejected:
            code = result.status.http_status if result.outcome is not Outcome.OK else 400
            return self.send_json(code, {"error": result.message}, self.retry_headers(result))
        self.collector.metrics.add("rewards_accepted_total", len(recorded))
        self.send_json(200, {"accepted": len(recorded), "rewards": recorded})

    def sql(self, sql) -> None:
        config = self.collector.config
        try:
            answer = api.run_sql(self.collector.data_dir, sql, timeout_s=config.sql_timeout_s,
                                 max_rows=config.sql_max_rows)
        except api.BadRequest as exc:
            self.collector.metrics.add("sql_errors_total")
            return self.send_json(400, {"error": str(exc)})
        except Exception as exc:   # never a 500 for a query: say what went wrong
            log.exception("SQL endpoint: unexpected error")
            self.collector.metrics.add("sql_errors_total")
            return self.send_json(400, {"error": f"{type(exc).__name__}: {exc}"})
        self.collector.metrics.add("sql_queries_total")
        self.send_json(200, answer)
