"""``lightspan gateway``: an OpenAI-compatible proxy in front of vLLM for agents we cannot instrument.

A non-Python agent, or one whose client we do not patch, points its OpenAI base URL at the gateway.
For ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming or not) the gateway

1. asks vLLM for ``return_token_ids`` and sampled-token ``logprobs`` (``capture.with_capture``);
2. emits one GenAI span per call through the OTel SDK to the collector, with the same attributes
   as the instrumentor (``lightspan.prompt_token_ids`` … ``lightspan.capture.status``, the policy
   version), parented on the caller's W3C ``traceparent`` header when there is one;
3. takes the rollout from the ``X-Lightspan-Rollout-Id`` header or the URL prefix
   ``/rollouts/{id}/v1/...``, the task from ``X-Lightspan-Task-Id`` or ``/tasks/{id}``, the split
   from ``X-Lightspan-Split`` or ``/splits/{split}`` (prefixes combine, in any order:
   ``/rollouts/r1/tasks/t7/v1/chat/completions``); a header wins over the path;
4. answers with what the caller asked for (``strip_capture_fields``, on by default): the ids and
   logprobs the gateway added are set back to ``null``, exactly as vLLM sends those keys when they
   were not requested, so a strict client sees vLLM's own answer to its own request. Fields the
   caller did ask for (``return_token_ids``, ``logprobs``) are kept.

Everything else under ``/v1/`` (``GET /v1/models``, embeddings, …) passes through untouched and
untraced. Weight updates: ``POST /admin/pause`` refuses new generation requests with 429 and
``Retry-After``, then waits until the in-flight ones have finished (200 ``drained``, or 504 after
``?timeout_s=`` / ``drain_timeout_s``, still paused); ``POST /admin/resume`` (optional JSON body
``{"model_version": N}``) lets them in again. ``GET /admin/status`` and ``GET /health`` report.
The policy version on the spans is the one given at resume, else ``DATA_DIR/policy.json``.

Concurrency is bounded (``max_in_flight``; past it, 429). Bind to loopback, or set
``admin_token``: the admin routes pause training-time inference for everyone.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import requests
import urllib3
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lightspan import store
from lightspan.config import ConfigError, option
from lightspan.store.layout import DATA_DIR_ENV, DEFAULT_DATA_DIR
from lightspan.tracing import semconv
from lightspan.tracing.capture import CHAT, Capture, operation, with_capture

log = logging.getLogger(__name__)

HEADER_ROLLOUT_ID = "x-lightspan-rollout-id"
HEADER_TASK_ID = "x-lightspan-task-id"
HEADER_SPLIT = "x-lightspan-split"
_FORWARDED_HEADERS = ("authorization", "accept", "x-request-id", "user-agent")
_PREFIX = re.compile(r"^((?:/(?:rollouts|tasks|splits)/[^/]+)*)(/v1(?:/.*)?)$")
_PREFIX_KEYS = {"rollouts": semconv.ROLLOUT_ID, "tasks": semconv.TASK_ID, "splits": semconv.SPLIT}
_HEADER_KEYS = {HEADER_ROLLOUT_ID: semconv.ROLLOUT_ID, HEADER_TASK_ID: semconv.TASK_ID, HEADER_SPLIT: semconv.SPLIT}
_PROPAGATOR = TraceContextTextMapPropagator()
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


@dataclass(frozen=True)
class GatewayConfig:
    upstream: str = option("http://127.0.0.1:8000", "Base URL of the vLLM server (without /v1).")
    host: str = option("127.0.0.1", "Bind address. The admin routes are unauthenticated unless admin_token is set.")
    port: int = option(8100, "HTTP port agents call (their OPENAI_BASE_URL is http://HOST:PORT/v1).")
    otlp_endpoint: str = option("http://127.0.0.1:4317", "Collector OTLP/gRPC endpoint the spans go to.")
    service_name: str = option("lightspan-gateway", "service.name of the gateway's spans.")
    data_dir: str = option(DEFAULT_DATA_DIR, "Data directory; its policy.json gives the served policy version.",
                           env=DATA_DIR_ENV)
    strip_capture_fields: bool = option(
        True, "Answer with the fields the caller asked for: token ids and logprobs the gateway added are set "
              "back to null. Off: callers also get them.")
    capture_content: bool = option(True, "Record prompts and completions as gen_ai.input/output.messages.")
    max_in_flight: int = option(256, "Generation requests proxied at once; past it, 429 with Retry-After.")
    retry_after_s: int = option(1, "Retry-After (seconds) of a 429 while paused or full.")
    drain_timeout_s: float = option(120.0, "How long POST /admin/pause waits for in-flight requests.")
    upstream_timeout_s: float = option(600.0, "Read timeout for vLLM's answer (between stream chunks).")
    max_body_bytes: int = option(16 << 20, "Largest request body accepted (413 past it).")
    admin_token: str = option("", "When set, /admin/* needs 'Authorization: Bearer TOKEN'.")

    def __post_init__(self):
        if not urlsplit(self.upstream).scheme.startswith("http"):
            raise ConfigError("gateway", "upstream", f"{self.upstream!r} is not an http(s) URL",
                              "pass --upstream http://HOST:PORT (the vLLM server)")
        for name in ("max_in_flight", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError("gateway", name, "must be at least 1", f"pass --{name.replace('_', '-')} 1 or more")


# --- pure pieces ---------------------------------------------------------------------------------

def route(path: str) -> tuple[dict[str, str], str] | None:
    """(rollout/task/split attributes from the URL prefix, upstream path), or None if not ``/v1``."""
    parts = urlsplit(path)
    m = _PREFIX.match(parts.path)
    if m is None:
        return None
    attrs, segments = {}, m.group(1).strip("/").split("/") if m.group(1) else []
    for key, value in zip(segments[::2], segments[1::2]):
        attrs[_PREFIX_KEYS[key]] = unquote(value)
    return attrs, m.group(2) + (f"?{parts.query}" if parts.query else "")


def call_attributes(path_attrs: dict[str, str], headers) -> dict[str, str]:
    """Rollout, task and split of a call: headers first, then the URL prefix."""
    attrs = dict(path_attrs)
    for header, key in _HEADER_KEYS.items():
        value = headers.get(header)
        if value:
            attrs[key] = value
    return attrs


def input_messages(body: dict, op: str) -> str:
    """``gen_ai.input.messages`` (GenAI semantic conventions: role + parts) of a request."""
    if op != CHAT:
        prompt = body.get("prompt")
        return _dumps([{"role": "user", "parts": [{"type": "text", "content": prompt}]}])
    out = []
    for m in body.get("messages") or ():
        content = m.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "content": content}]
        else:  # OpenAI content parts: text stays text, anything else is kept as it came
            parts = [{"type": "text", "content": p.get("text")} if p.get("type") == "text" else p
                     for p in (content or ())]
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            parts.append({"type": "tool_call", "id": call.get("id"), "name": fn.get("name"),
                          "arguments": fn.get("arguments")})
        out.append({"role": m.get("role"), "parts": parts})
    return _dumps(out)


class _Texts:
    """Completion text per choice, from a response or stream chunks (for gen_ai.output.messages)."""

    def __init__(self, op: str):
        self.op, self.texts, self.reasons = op, {}, {}

    def add(self, payload: dict) -> None:
        for c in payload.get("choices") or ():
            i = c.get("index") or 0
            if self.op == CHAT:
                msg = c.get("message") or c.get("delta") or {}
                text = msg.get("content")
            else:
                text = c.get("text")
            if text:
                self.texts[i] = self.texts.get(i, "") + text
            if c.get("finish_reason"):
                self.reasons[i] = c["finish_reason"]

    def messages(self) -> str:
        return _dumps([{"role": "assistant", "parts": [{"type": "text", "content": self.texts.get(i, "")}],
                        "finish_reason": self.reasons.get(i)}
                       for i in sorted(set(self.texts) | set(self.reasons))])


# --- state shared by the handler threads ---------------------------------------------------------

class _Admission:
    """Pause/drain and the in-flight bound, under one condition variable."""

    def __init__(self, limit: int):
        self.limit, self.in_flight, self.paused = limit, 0, False
        self.cond = threading.Condition()
        self.counts = {"requests": 0, "refused_paused": 0, "refused_full": 0, "upstream_errors": 0}

    def enter(self) -> str | None:
        """None when admitted, else why not (``paused`` or ``full``)."""
        with self.cond:
            if self.paused:
                self.counts["refused_paused"] += 1
                return "paused"
            if self.in_flight >= self.limit:
                self.counts["refused_full"] += 1
                return "full"
            self.in_flight += 1
            self.counts["requests"] += 1
            return None

    def leave(self) -> None:
        with self.cond:
            self.in_flight -= 1
            self.cond.notify_all()

    def pause(self, timeout_s: float) -> bool:
        """Refuse new requests at once; True when the in-flight ones have all finished in time."""
        with self.cond:
            self.paused = True
            return self.cond.wait_for(lambda: self.in_flight == 0, timeout=timeout_s)

    def resume(self) -> None:
        with self.cond:
            self.paused = False


class _PolicyVersion:
    """The served policy version: set at resume, else ``policy.json`` (re-read when it changes)."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.path = store.policy.path(data_dir)
        self.override: int | None = None
        self._cached: tuple[float, int | None] = (-1.0, None)

    def get(self) -> int | None:
        if self.override is not None:
            return self.override
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return 0  # no policy published yet: the initial model
        if mtime != self._cached[0]:
            published = store.policy.read(self.data_dir)
            if published is None:      # unreadable: keep the version last read
                return self._cached[1]
            self._cached = (mtime, published.version)
        return self._cached[1]


class Gateway:
    """The proxy server; ``start()`` binds and serves in a thread, ``stop()`` drains nothing and
    closes (use ``/admin/pause`` first for a graceful stop, as :func:`serve` does)."""

    def __init__(self, cfg: GatewayConfig, tracer_provider=None):
        self.cfg = cfg
        self.upstream = cfg.upstream.rstrip("/").removesuffix("/v1")  # an OPENAI_BASE_URL works too
        self.tracer = trace.get_tracer("lightspan.gateway", tracer_provider=tracer_provider)
        self.admission = _Admission(cfg.max_in_flight)
        self.version = _PolicyVersion(cfg.data_dir)
        self.session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=cfg.max_in_flight)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> str:
        if self._server is not None:
            return self.url
        handler = type("Handler", (_Handler,), {"gateway": self})
        self._server = _Server((self.cfg.host, self.cfg.port), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="lightspan-gateway", daemon=True)
        self._thread.start()
        log.info("gateway on %s -> %s", self.url, self.upstream)
        return self.url

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._server = self._thread = None

    def status(self) -> dict:
        a = self.admission
        with a.cond:
            return {"paused": a.paused, "in_flight": a.in_flight, "model_version": self.version.get(), **a.counts}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # the stdlib prints tracebacks to stderr
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("connection from %s dropped: %s", client_address, exc)
        else:
            log.exception("gateway: error while serving %s", client_address)


class _ClientGone(Exception):
    pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    gateway: Gateway  # set on the per-server subclass

    def log_message(self, fmt, *args):  # the stdlib logs every request to stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    # --- plumbing --------------------------------------------------------------------------
    def _send(self, code: int, body: bytes, content_type: str = "application/json", headers=()) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, code: int, obj, headers=()) -> None:
        self._send(code, _dumps(obj).encode(), headers=headers)

    def _error(self, code: int, message: str, headers=()) -> None:
        self._json(code, {"error": {"message": message, "type": HTTPStatus(code).phrase, "code": code}}, headers)

    def _refuse(self, code: int, message: str) -> None:
        """Refuse without reading the body: close the connection so it cannot be misread."""
        self.close_connection = True
        self._error(code, message, [("Retry-After", str(self.gateway.cfg.retry_after_s)), ("Connection", "close")])

    def _body(self) -> bytes | None:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._error(411, "a Content-Length is required")
            return None
        if int(length) > self.gateway.cfg.max_body_bytes:
            self.close_connection = True
            self._error(413, f"request body over {self.gateway.cfg.max_body_bytes} bytes")
            return None
        return self.rfile.read(int(length))

    def _chunk(self, data: bytes) -> None:
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        except OSError as e:  # the caller went away mid-stream
            raise _ClientGone() from e

    def _upstream_headers(self) -> dict[str, str]:
        headers = {k: self.headers[k] for k in _FORWARDED_HEADERS if self.headers.get(k)}
        headers["Content-Type"] = "application/json"
        return headers

    # --- routes ------------------------------------------------------------------------------
    def do_GET(self):
        path = urlsplit(self.path).path
        if path == "/health":
            return self._json(200, {"status": "ok", "paused": self.gateway.admission.paused})
        if path == "/admin/status":
            return self._admin(lambda: self._json(200, self.gateway.status()))
        self._passthrough(None)

    def do_POST(self):
        path = urlsplit(self.path).path
        if path in ("/admin/pause", "/admin/resume"):
            return self._admin(lambda: self._pause() if path == "/admin/pause" else self._resume())
        routed = route(self.path)
        if routed is None:
            return self._error(404, f"no route {path}; the OpenAI API is under /v1")
        path_attrs, upstream_path = routed
        op = operation(upstream_path)
        if op is None:
            body = self._body()
            return None if body is None else self._passthrough(body, upstream_path)
        refused = self.gateway.admission.enter()
        if refused:
            return self._refuse(429, "paused for a weight update" if refused == "paused"
                                else "too many requests in flight")
        try:
            self._generate(op, upstream_path, call_attributes(path_attrs, self.headers))
        finally:
            self.gateway.admission.leave()

    def _admin(self, action) -> None:
        token = self.gateway.cfg.admin_token
        if token and self.headers.get("Authorization") != f"Bearer {token}":
            return self._error(401, "admin routes need 'Authorization: Bearer <admin_token>'")
        action()

    def _pause(self) -> None:
        query = parse_qs(urlsplit(self.path).query)
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        timeout = float(query.get("timeout_s", [self.gateway.cfg.drain_timeout_s])[0])
        drained = self.gateway.admission.pause(timeout)
        self._json(200 if drained else 504, {"drained": drained, **self.gateway.status()})

    def _resume(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            version = (json.loads(raw) or {}).get("model_version") if raw.strip() else None
            if version is not None:
                self.gateway.version.override = int(version)
        except (ValueError, TypeError, AttributeError):
            return self._error(400, 'body must be JSON like {"model_version": 3}')
        self.gateway.admission.resume()
        self._json(200, self.gateway.status())

    def _passthrough(self, body: bytes | None, upstream_path: str | None = None) -> None:
        """Any other /v1 route, untouched and untraced (``GET /v1/models``, embeddings, …)."""
        if upstream_path is None:
            routed = route(self.path)
            if routed is None:
                return self._error(404, f"no route {urlsplit(self.path).path}")
            upstream_path = routed[1]
        try:
            resp = self.gateway.session.request(self.command, self.gateway.upstream + upstream_path, data=body,
                                                headers=self._upstream_headers(),
                                                timeout=(5, self.gateway.cfg.upstream_timeout_s))
        except requests.RequestException as e:
            return self._error(502, f"upstream unreachable: {e}")
        self._send(resp.status_code, resp.content, resp.headers.get("Content-Type", "application/json"))

    # --- the traced generation call -------------------------------------------------------------
    def _generate(self, op: str, upstream_path: str, ids: dict[str, str]) -> None:
        gw = self.gateway
        raw = self._body()
        if raw is None:
            return
        try:
            asked = json.loads(raw)
            if not isinstance(asked, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return self._error(400, f"request body is not a JSON object: {e}")
        model = str(asked.get("model", ""))
        parent = _PROPAGATOR.extract({k.lower(): v for k, v in self.headers.items()})
        attrs = {semconv.GEN_AI_OPERATION_NAME: op, semconv.GEN_AI_REQUEST_MODEL: model, **ids}
        if gw.cfg.capture_content:
            attrs[semconv.GEN_AI_INPUT_MESSAGES] = input_messages(asked, op)
        span = gw.tracer.start_span(f"{op} {model}".strip(), context=parent, kind=trace.SpanKind.SERVER,
                                    attributes=attrs)
        answer = None
        try:
            answer = self._call(op, upstream_path, asked, span)
        except _ClientGone:
            span.set_attribute(semconv.CAPTURE_STATUS, "stream_incomplete")
            self.close_connection = True
        finally:
            # the span ends before the answer's last bytes go out: a caller that has its answer
            # can count on the span having been handed to the exporter
            span.end()
        if answer is _END_OF_STREAM:
            try:
                self._chunk(b"")  # the last chunk of a chunked body
            except _ClientGone:
                self.close_connection = True
        elif answer is not None:
            self._send(*answer)

    def _call(self, op: str, upstream_path: str, asked: dict, span):
        """Call vLLM and record on ``span``; returns what is left to send: (status, body,
        content type), or ``_END_OF_STREAM`` once a stream's events have all been relayed."""
        gw = self.gateway
        headers = self._upstream_headers()
        _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))  # vLLM's own spans join ours
        stream = bool(asked.get("stream"))
        try:
            resp = gw.session.post(gw.upstream + upstream_path, data=_dumps(with_capture(asked, op)).encode(),
                                   headers=headers, stream=stream, timeout=(5, gw.cfg.upstream_timeout_s))
        except requests.RequestException as e:
            self._upstream_failed(span, f"upstream unreachable: {e}")
            body = {"error": {"message": f"upstream unreachable: {e}", "type": "Bad Gateway", "code": 502}}
            return 502, _dumps(body).encode(), "application/json"
        if resp.status_code != 200:
            self._upstream_failed(span, f"upstream answered {resp.status_code}", resp.status_code)
            return resp.status_code, resp.content, resp.headers.get("Content-Type", "application/json")
        cap, texts = Capture.for_request(asked, op), _Texts(op)
        if stream:
            complete = self._relay_stream(resp, cap, texts)
            answer = _END_OF_STREAM if complete else None
            self.close_connection = self.close_connection or not complete
        else:
            payload = resp.json()
            cap.add(payload, hide=gw.cfg.strip_capture_fields)  # the fields only the gateway asked for: null
            texts.add(payload)
            answer = complete = (200, _dumps(payload).encode(), "application/json")
        if complete:
            span.set_attributes({**cap.attributes(gw.version.get()), **cap.genai_attributes()})
            if gw.cfg.capture_content:
                span.set_attribute(semconv.GEN_AI_OUTPUT_MESSAGES, texts.messages())
        else:
            span.set_attribute(semconv.CAPTURE_STATUS, "stream_incomplete")
        return answer

    def _upstream_failed(self, span, message: str, code: int | None = None) -> None:
        span.set_attribute(semconv.CAPTURE_STATUS, "upstream_error")
        if code is not None:
            span.set_attribute("http.response.status_code", code)
        span.set_status(Status(StatusCode.ERROR, message))
        with self.gateway.admission.cond:
            self.gateway.admission.counts["upstream_errors"] += 1

    def _relay_stream(self, resp, cap: Capture, texts: _Texts) -> bool:
        """Relay vLLM's server-sent events chunk by chunk; True when ``[DONE]`` was seen (the
        chunked body's terminator is left to the caller, after the span has ended)."""
        strip = self.gateway.cfg.strip_capture_fields
        self.send_response(200)
        self.send_header("Content-Type", resp.headers.get("Content-Type", "text/event-stream"))
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        done = False
        try:
            for line in _lines(resp.raw):
                if not line.startswith(b"data:"):
                    if line:  # event:, id:, comments: as they came
                        self._chunk(line + b"\n")
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                elif data.startswith(b"{"):
                    chunk = json.loads(data)
                    cap.add(chunk, hide=strip)
                    texts.add(chunk)
                    if strip:
                        data = _dumps(chunk).encode()
                self._chunk(b"data: " + data + b"\n\n")
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError, ValueError) as e:
            log.warning("upstream stream broke off: %s", e)
            self.close_connection = True  # the body stays unterminated: the caller sees the break
            return False
        finally:
            resp.close()
        return done


_END_OF_STREAM = object()


def _lines(raw):
    """Lines of a streamed body as soon as they arrive, chunked or not (``iter_lines`` would wait
    for a full read of a body that is not chunk-encoded)."""
    pending = b""
    while data := raw.read1(65536, decode_content=True):
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if pending:
        yield pending.rstrip(b"\r")


def _tracer_provider(cfg: GatewayConfig):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({semconv.SERVICE_NAME: cfg.service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint, insecure=True)))
    return provider


def serve(cfg: GatewayConfig) -> int:
    """Run in the foreground (``lightspan gateway``). SIGTERM/SIGINT: pause, drain, flush spans, exit."""
    provider = _tracer_provider(cfg)
    gateway = Gateway(cfg, provider)
    gateway.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    t0 = time.monotonic()
    drained = gateway.admission.pause(cfg.drain_timeout_s)
    log.info("gateway stopping: drained=%s in %.1f s", drained, time.monotonic() - t0)
    gateway.stop()
    provider.shutdown()
    return 0
