"""The collector's HTTP transports: OTLP/HTTP (:4318) and the API (:8321), on :mod:`lightspan.core.web`.

Both are thin: they frame bytes, check the bearer token and the cross-site rules, and map the
collector's :class:`~lightspan.collector.outcomes.ExportResult` to a status with ``status_for``.
Each request runs in its connection's thread (the connections are capped): an export's WAL
write and fsync there (concurrent exports share an fsync), OTLP/JSON decodes side by side up to
``max_json_bytes`` of bodies at once (decoding JSON holds several times its size), SQL in worker processes
(:mod:`lightspan.collector.sqlpool`).

OTLP/HTTP: ``POST /v1/traces`` and ``POST /v1/logs``, protobuf or JSON (answered in the
request's content type), optionally gzip/deflate; bodies are capped before and after
decompression (413), JSON ones at ``max_json_bytes``.

API: ``GET /healthz`` (open even with a token), ``GET /metrics``, ``POST /v1/flush``,
``POST /v1/rewards`` (late rewards, see :mod:`lightspan.collector.api`), ``POST
/v1/rollouts/ID/events`` (Agent Lightning's reward events), ``POST /v1/sql``
``{"sql": ...}`` and ``GET /v1/sql?q=...`` (read-only SQL), and the GET routes the composing
process added (:mod:`lightspan.core.web.routes`: the web UI). API answers are JSON; errors are
``{"error": message}`` with 400 for the client's mistakes and never 500 for its data. Queries
(SQL and the web UI's) run ``sql_max_concurrent`` at a time; a few more wait for a turn, the rest
get 429 + Retry-After. Reward posts have turns of their own, so no flood of queries refuses a
score; ``GET /v1/sql`` from a page of another site (``Sec-Fetch-Site``, ``Origin``: an ``<img>``
can send it) is refused with 403.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
import zlib
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from google.protobuf import json_format

from lightspan.core import web
from lightspan.collector import api, sqlpool
from lightspan.core.web import routes
from lightspan.collector.outcomes import BY_HTTP_STATUS, CollectorError, ExportResult, Outcome
from lightspan.core.config import redact

if TYPE_CHECKING:
    from lightspan.collector.server import Collector

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
LOGS_PATH = "/v1/logs"
_SIGNALS = {TRACES_PATH: "traces", LOGS_PATH: "logs"}
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_API_ROUTES = ("GET /healthz, GET /metrics, POST /v1/flush, POST /v1/rewards, POST /v1/rollouts/ID/events, "
               "POST or GET /v1/sql")
_GET, _POST = ("/healthz", "/metrics", "/v1/sql"), ("/v1/flush", "/v1/rewards", "/v1/sql")
_COUNTED = (403, 408, 411, 413, 415, 429, 503)
_QUERIES_WAITING = 8          # queries that may wait for a turn beyond the ones running
_REWARDS_WAITING = 32         # reward posts that may wait for theirs (their own turns, not the queries')


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise CollectorError(f"cannot load the TLS certificate {cert_file!r} / key {key_file!r}: {exc}; "
                             "fix collector.tls_cert_file and collector.tls_key_file") from None
    return context


def bind_error(what: str, host: str, port: int, field: str) -> str:
    return (f"cannot listen for {what} on {host}:{port}: the address is in use or not available "
            f"(another collector running?); set collector.{field} (LIGHTSPAN_COLLECTOR_{field.upper()}) "
            f"to a free port, or 0 for any")


def _server(handler, collector: "Collector", port: int, what: str, field: str, tls) -> web.Server:
    cfg = collector.config
    limits = web.Limits(max_connections=cfg.max_connections, max_inflight_bytes=cfg.max_inflight_bytes,
                         read_timeout_s=cfg.read_timeout_s, retry_after_s=cfg.retry_after_s)
    server = web.Server(handler, cfg.host, port, limits=limits, budget=collector.budget, tls=tls,
                         name=f"lightspan-collector-{field.removesuffix('_port')}")
    try:
        server.bind()
    except OSError as exc:
        raise CollectorError(f"{bind_error(what, cfg.host, port, field)} ({exc.strerror or exc})") from None
    return server


def otlp_server(collector: "Collector", tls) -> web.Server:
    return _server(OTLP(collector).handle, collector, collector.config.http_port, "OTLP/HTTP", "http_port", tls)


def api_server(collector: "Collector", tls) -> web.Server:
    return _server(API(collector).handle, collector, collector.config.api_port, "API", "api_port", tls)


class _Transport:
    def __init__(self, collector: "Collector"):
        self.collector = collector
        self.config = collector.config
        self.guard = web.Guard(self.config.allowed_hosts, "collector.allowed_hosts")

    def check_auth(self, request: web.Request) -> ExportResult | None:
        """A refusal when the bearer token is required and missing or wrong."""
        if web.bearer(request.headers.get("authorization"), self.config.auth_token):
            return None
        return self.collector.refuse(Outcome.UNAUTHENTICATED, "missing or wrong bearer token: send "
                                     "'authorization: Bearer <collector.auth_token>'")

    def retry_headers(self, result: ExportResult) -> dict:
        headers = {}
        if result.status.retryable:
            headers["Retry-After"] = str(self.config.retry_after_s)
        if result.outcome is Outcome.UNAUTHENTICATED:
            headers["WWW-Authenticate"] = 'Bearer realm="lightspan-collector"'
        return headers


class OTLP(_Transport):
    """``POST /v1/traces`` and ``POST /v1/logs``: OTLP/HTTP, protobuf or JSON, optionally gzip/deflate."""

    def handle(self, request: web.Request) -> web.Response:
        signal = _SIGNALS.get(request.path)
        if signal is None:
            return web.Response(404, "text/plain; charset=utf-8",
                                 f"not found: POST OTLP to {TRACES_PATH} or {LOGS_PATH}\n".encode())
        if request.method != "POST":
            return web.Response(405, "text/plain; charset=utf-8",
                                 f"method {request.method} not allowed on {request.path}; use POST\n".encode(),
                                 {"Allow": "POST"})
        encoding = {PROTOBUF: "protobuf", JSON: "json"}.get(request.content_type())
        close = False
        try:
            self.guard.check(request)
            result = self.check_auth(request)
            if result is None and encoding is None:
                result = self.collector.refuse(Outcome.UNSUPPORTED, f"content type {request.content_type()!r}: "
                                               f"send {PROTOBUF} or {JSON}")
            if result is None:
                result = self._export(request, encoding, signal)
        except web.HTTPError as exc:
            close = exc.close
            result = self.collector.refuse(BY_HTTP_STATUS.get(exc.status, Outcome.INVALID), exc.message, signal)
        return self.answer(result, encoding or "json", close)

    def _export(self, request: web.Request, encoding: str, signal: str) -> ExportResult:
        cap = self.config.max_http_body_bytes
        body = request.body(cap)
        content_encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if content_encoding != "identity":
            wbits = {"gzip": 31, "deflate": 15}.get(content_encoding)   # 31: gzip header; 15: zlib
            if wbits is None:
                return self.collector.refuse(Outcome.UNSUPPORTED, f"content encoding {content_encoding!r}: "
                                             "use gzip, deflate or none")
            inflated = _decompress(body, wbits, cap if encoding == "protobuf" else self.config.max_json_bytes)
            if isinstance(inflated, tuple):
                return self.collector.refuse(*inflated)
            request.hold(len(inflated))       # the inflated copy counts too
            body = inflated
        if encoding == "json":
            if len(body) > self.config.max_json_bytes:
                return self.collector.refuse(Outcome.TOO_LARGE, f"OTLP/JSON body of {len(body)} bytes exceeds "
                                             f"max_json_bytes={self.config.max_json_bytes}")
        return self.collector.export(body, encoding, signal)

    def answer(self, result: ExportResult, encoding: str, close: bool) -> web.Response:
        message = result.response() if result.status.http_status == 200 else result.rpc_status(self.config.retry_after_s)
        if encoding == "json":
            body, content_type = json_format.MessageToJson(message, indent=None).encode(), JSON
        else:
            body, content_type = message.SerializeToString(), PROTOBUF
        headers = self.retry_headers(result)
        if close:
            headers["Connection"] = "close"
        return web.Response(result.status.http_status, content_type, body, headers)


def _decompress(body: bytes, wbits: int, cap: int) -> bytes | tuple[Outcome, str]:
    decompressor = zlib.decompressobj(wbits)
    try:
        data = decompressor.decompress(body, cap + 1)   # never inflate more than the cap (zip bombs)
    except zlib.error as exc:
        return Outcome.INVALID, f"body does not decompress: {exc}"
    if len(data) > cap:
        return Outcome.TOO_LARGE, f"decompressed body exceeds the limit of {cap} bytes"
    if not decompressor.eof:
        return Outcome.INVALID, "compressed body is truncated"
    return data


class API(_Transport):
    """The API port: health, metrics, flush, late rewards, read-only SQL, the web UI."""

    def __init__(self, collector: "Collector"):
        super().__init__(collector)
        cfg = self.config
        # reward posts never wait behind queries: a flood of GET /v1/sql must not refuse a score
        self.queries = web.Turns(cfg.sql_max_concurrent, _QUERIES_WAITING, cfg.sql_timeout_s, cfg.retry_after_s,
                                  f"queries (sql_max_concurrent={cfg.sql_max_concurrent})")
        self.reward_posts = web.Turns(1, _REWARDS_WAITING, cfg.sql_timeout_s, cfg.retry_after_s, "reward posts")

    def handle(self, request: web.Request) -> web.Response:
        try:
            return self._route(request)
        except web.HTTPError as exc:
            if exc.status in _COUNTED:     # the server's own refusals (401s are counted where they happen)
                self.collector.metrics.refused(BY_HTTP_STATUS[exc.status])
            raise

    def _route(self, request: web.Request) -> web.Response:
        self.guard.check(request)
        path, method = request.path, request.method
        if path == "/healthz" and method in ("GET", "HEAD"):   # open without the token: probes call it
            ok = self.collector.running
            return web.json_response(200 if ok else 503, {"status": "ok" if ok else "stopping"})
        added = routes.find(self.collector.routes, path)
        if added is not None:
            if method not in ("GET", "HEAD"):
                raise web.HTTPError(405, f"use GET on {path}", {"Allow": "GET"})
            if not added.open:
                self.authorize(request)
                with self.queries.take():
                    return added.handler(path, request.query, self.collector)
            return added.handler(path, request.query, self.collector)
        # the id is matched in the path as sent, decoded once (request.path is decoded already:
        # a%252Fb would become a/b, and a%2Fb a path of its own)
        rollout_id = api.event_rollout(request.raw_path.decode("latin-1"))
        if rollout_id is not None:          # Agent Lightning's AGL_EVENT_URL
            if method != "POST":
                raise web.HTTPError(405, f"use POST on {path}", {"Allow": "POST"})
            self.authorize(request)
            return self.event(rollout_id, request.json(self.config.max_json_bytes))
        allowed = [m for m, paths in (("GET", _GET), ("POST", _POST)) if path in paths]
        if not allowed:
            raise web.HTTPError(404, f"not found: {self.routes_text()}")
        if method not in allowed and not (method == "HEAD" and "GET" in allowed):
            raise web.HTTPError(405, f"use {' or '.join(allowed)} on {path}", {"Allow": ", ".join(allowed)})
        self.authorize(request)
        if path == "/metrics":
            return web.Response(200, "text/plain; version=0.0.4; charset=utf-8",
                                 self.collector.render_metrics().encode())
        if path == "/v1/flush":
            return self.flush()
        if path == "/v1/rewards":
            return self.rewards(request.json(self.config.max_json_bytes), trusted=self.rewarder(request))
        if method == "POST":
            doc = request.json(self.config.max_json_bytes)
            return self.sql(doc.get("sql") if isinstance(doc, dict) else None)
        self.guard.same_origin(request)     # an <img> on any page can send a GET: not to query
        return self.sql((parse_qs(request.query).get("q") or [""])[0])

    def routes_text(self) -> str:
        added = [f"GET {r.prefix or r.paths[0]}" for r in self.collector.routes]
        return ", ".join([_API_ROUTES, *added])

    def authorize(self, request: web.Request) -> None:
        refused = self.check_auth(request)
        if refused is not None:
            raise web.HTTPError(401, refused.message, self.retry_headers(refused))

    def flush(self) -> web.Response:
        try:
            flushed = self.collector.flush_counts()
        except Exception as exc:  # our own failure (disk), not the client's data: retry later
            log.exception("flush requested over the API failed")
            return web.json_response(503, {"error": f"flush failed: {exc}"},
                                      {"Retry-After": str(self.config.retry_after_s)})
        return web.json_response(200, {"flushed_spans": flushed["spans"], "flushed_log_records": flushed["logs"]})

    def event(self, rollout_id: str, doc) -> web.Response:
        """``POST /v1/rollouts/ID/events``: an Agent Lightning reward event is a reward of rollout ID."""
        try:
            reward = api.event_reward(rollout_id, doc, time.time_ns())
        except api.BadRequest as exc:
            self.collector.refuse(Outcome.INVALID, str(exc))
            return web.json_response(400, {"error": str(exc)})
        if reward is None:
            self.collector.metrics.add("events_ignored_total")
            return web.json_response(200, {"accepted": 0, "ignored": doc["event_type"]})
        return self.rewards(reward)

    def check_auth(self, request: web.Request) -> ExportResult | None:
        """The API opens to ``auth_token`` and to ``reward_token`` (the web UI and the judge carry it)."""
        if self.config.reward_token and self.rewarder(request):
            return None
        return super().check_auth(request)

    def rewarder(self, request: web.Request) -> bool:
        """Whether ``request`` may post a reward of any source: it carries ``reward_token``, or none is set."""
        token = self.config.reward_token
        return not token or web.bearer(request.headers.get("authorization"), token)

    def rewards(self, doc, trusted: bool = False) -> web.Response:
        """Store posted rewards; one that is not the agent's own needs ``trusted`` (the reward token)."""
        try:
            request, recorded = api.reward_request(doc, time.time_ns(), self.collector.reward_key)
        except api.BadRequest as exc:
            self.collector.refuse(Outcome.INVALID, str(exc))
            return web.json_response(400, {"error": str(exc)})
        claimed = sorted({r["source"] for r in recorded} - {"agent"})
        if claimed and not trusted:
            message = (f"a reward of source {', '.join(map(repr, claimed))} needs collector.reward_token "
                       "('Authorization: Bearer <reward_token>'); with auth_token a reward is the agent's own: "
                       "send \"source\": \"agent\"")
            self.collector.metrics.add("reward_source_refusals_total")
            self.collector.refuse(Outcome.UNAUTHENTICATED, message)
            return web.json_response(403, {"error": message})
        export = lambda req: self.collector.export(req.SerializeToString(), "protobuf", own=True)   # noqa: E731
        try:
            with self.reward_posts.take():   # one at a time (the re-post rule reads the store), never behind queries
                result = self.collector.rewards.post(request, recorded, export)
        except api.Conflict as exc:
            return web.json_response(409, {"error": str(exc), "conflicts": exc.conflicts})
        except OSError as exc:   # the re-post rule reads the store: a bucket that does not answer
            log.warning("a reward post could not read the store: %s", exc)
            return web.json_response(503, {"error": redact(f"the store cannot be reached: {exc}; retry later")},
                                      {"Retry-After": str(self.config.retry_after_s)})
        if result is not None and (result.outcome is not Outcome.OK or result.rejected):
            code = result.status.http_status if result.outcome is not Outcome.OK else 400
            return web.json_response(code, {"error": result.message}, self.retry_headers(result))
        stored = sum(r["status"] == "stored" for r in recorded)
        self.collector.metrics.add("rewards_accepted_total", stored)
        return web.json_response(200, {"accepted": len(recorded), "stored": stored, "rewards": recorded})

    def sql(self, sql) -> web.Response:
        try:
            with self.queries.take():
                answer = self.collector.queries.run(sql)
        except api.BadRequest as exc:
            self.collector.metrics.add("sql_errors_total")
            return web.json_response(400, {"error": str(exc)})
        except sqlpool.Unreachable as exc:     # not the query's fault: retry once the bucket answers
            self.collector.metrics.add("sql_errors_total")
            return web.json_response(503, {"error": str(exc)}, {"Retry-After": str(self.config.retry_after_s)})
        self.collector.metrics.add("sql_queries_total")
        return web.Response(200, JSON, json.dumps(answer, allow_nan=False).encode())
