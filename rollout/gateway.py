"""``lightspan gateway``: an OpenAI- and Anthropic-compatible proxy in front of vLLM for agents we cannot instrument.

A non-Python agent, or one whose client we do not patch, points its OpenAI (or Anthropic) base URL
at the gateway. For the generation paths of :data:`~lightspan.rollout.paths.ENDPOINTS` (``POST
/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` and Anthropic's ``/v1/messages``,
streaming or not; each protocol's row in :data:`lightspan.tracing.protocols.PROTOCOLS` has what it sends
and answers, :mod:`lightspan.rollout.exchanges` the HTTP side) the gateway

1. asks vLLM for the token ids and sampled-token logprobs (for Anthropic Messages: through the
   chat completion vLLM makes of the request, as the instrumentor does);
2. emits one GenAI span per call through the OTel SDK to the collector, with the same attributes
   as the instrumentor (``lightspan.prompt_token_ids`` … ``lightspan.capture.status``, the policy
   version, the messages with their tool calls), parented on the caller's W3C ``traceparent``
   header when there is one;
3. takes the rollout from the ``X-Lightspan-Rollout-Id`` header or the URL prefix
   ``/rollouts/{id}/v1/...``, the task from ``X-Lightspan-Task-Id`` or ``/tasks/{id}``, the split
   from ``X-Lightspan-Split`` or ``/splits/{split}`` (prefixes combine, in any order:
   ``/rollouts/r1/tasks/t7/v1/chat/completions``; a header wins over the path), and the agent's
   name from ``x-lightspan-agent``; with several policies (``policies``) a named agent's call goes
   to the model of the policy that owns it, and a call to a policy's model name records that
   policy and its version (rollout/routing.py);
4. answers with what the caller asked for (``strip_capture_fields``, on by default): the ids and
   logprobs the gateway added are set back to ``null``, exactly as vLLM sends those keys when they
   were not requested; fields the caller did ask for are kept. An Anthropic caller gets the
   message or event stream of vLLM's own ``/v1/messages``; errors come in the caller's protocol's shape.

``POST /rollouts/{id}/reward`` (``{"value": number, "name"?: string}``) is the rollout's reward, posted
to the collector's ``POST /v1/rewards`` as the agent's, under the collector's rules: one value per
key, 409 on another, the same one idempotent (:mod:`lightspan.rollout.rewards`).
The other paths of the table (``GET /v1/models``, embeddings, Anthropic's token count) pass through untouched and
untraced; any other path is 404 and never reaches vLLM, whose dev-mode and LoRA routes are
unauthenticated (see :mod:`lightspan.rollout.paths`). Nothing of one caller reaches another:
the upstream client keeps no cookies (:mod:`lightspan.rollout.upstream`) and the caller gets
vLLM's body and content type only.
Weight updates: ``POST /admin/pause`` refuses new generation requests with 429 and
``Retry-After``, then waits until the in-flight ones have finished (200 ``drained``, or 504 after
``?timeout_s=`` / ``drain_timeout_s``, still paused); ``POST /admin/resume`` (optional JSON body
``{"model_version": N}``) lets them in again. ``GET /admin/status`` and ``GET /health`` report.
The policy version on the spans is the one given at resume, else ``DATA_DIR/policy.json`` (with
several policies, the version of the policy the call's model name is).
With ``[canary] enabled`` a new policy version serves a share of rollouts until a rule promotes or
rolls it back (:mod:`lightspan.rollout.canary`: the call goes to the arm's versioned model name).
With ``upstreams`` (several vLLM replicas) each call goes to the replica of its rollout, so a
rollout's turns share one prefix cache, and no call goes to a replica the trainer's last sync took
out of rotation (:mod:`lightspan.rollout.replicas`); a replica that refuses or resets a connection
is down for ``replica_down_s`` and its rollouts' calls go to the next live replica.

Bounds (:mod:`lightspan.core.web`): connections, read time, request bytes; a call's body is read in
full before it takes one of ``max_in_flight`` slots (past them, 429), so a client that never sends
its body holds no slot. Cross-site use is refused (Host allowlist, Origin, JSON bodies). A
non-loopback bind needs ``admin_token`` (compared in constant time) unless
``allow_no_admin_token`` says otherwise: the admin routes pause training-time inference for everyone.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import requests
import urllib3
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lightspan.core import web
from lightspan.core.config import ConfigError, redact
from lightspan.rollout import paths
from lightspan.rollout.admission import Admission, PolicyVersion, admin
from lightspan.rollout.canary import Canary, CanaryConfig
from lightspan.rollout.gateway_config import GatewayConfig
from lightspan.rollout.exchanges import Exchange, error_body, invalid
from lightspan.rollout.paths import ENDPOINTS, call_attributes, route
from lightspan.rollout.replicas import Upstreams, untraced_key
from lightspan.rollout.rewards import MAX_BODY_BYTES, BadReward, RewardPoster, reward_doc
from lightspan.rollout.routing import served_attributes, served_model
from lightspan.rollout.upstream import Upstream, lines
from lightspan.tracing import messages, semconv
from lightspan.tracing.protocols import Protocol
from lightspan.tracing.protocols.base import dumps, loads

__all__ = ["Gateway", "GatewayConfig", "route", "serve"]

log = logging.getLogger(__name__)

_FORWARDED_HEADERS = ("authorization", "accept", "x-request-id", "user-agent")
_PROPAGATOR = TraceContextTextMapPropagator()


def _error(protocol: Protocol | None, code: int, message: str, headers: dict | None = None,
           param: str | None = None) -> web.Response:
    """An error answer in the shape of the caller's protocol (Anthropic's for ``/v1/messages``)."""
    return web.Response(code, "application/json", error_body(protocol, code, message, param), dict(headers or {}))


class Gateway:
    """The proxy server; ``start()`` binds and serves in a thread, ``stop()`` drains nothing and
    closes (use ``/admin/pause`` first for a graceful stop, as :func:`serve` does)."""

    def __init__(self, cfg: GatewayConfig, tracer_provider=None, canary: CanaryConfig | None = None):
        self.cfg = cfg
        self.upstream = cfg.upstream.rstrip("/").removesuffix("/v1")  # an OPENAI_BASE_URL works too
        self.tracer = trace.get_tracer("lightspan.gateway", tracer_provider=tracer_provider)
        self.admission = Admission(cfg.max_in_flight)
        self.version = PolicyVersion(cfg.data_dir)
        self.replicas = Upstreams(cfg.upstreams, cfg.data_dir, down_s=cfg.replica_down_s) if cfg.upstreams else None
        self.guard = web.Guard(cfg.allowed_hosts, "gateway.allowed_hosts")
        self.client = Upstream(self.upstream, cfg.max_in_flight, cfg.upstream_timeout_s)
        self.rewards = RewardPoster(cfg.collector_api_url, cfg.collector_token, cfg.read_timeout_s, cfg.retry_after_s)
        self.canary = Canary(canary, cfg.data_dir, self.version.published,
                             lambda: self.replicas.candidates() if self.replicas else [self.upstream]) \
            if canary is not None and canary.enabled else None
        self._server: web.Server | None = None

    @property
    def url(self) -> str:
        return self._server.url

    def start(self) -> str:
        if self._server is not None:
            return self.url
        limits = web.Limits(max_connections=self.cfg.max_connections, read_timeout_s=self.cfg.read_timeout_s,
                             retry_after_s=self.cfg.retry_after_s,
                             max_inflight_bytes=max(256 << 20, 4 * self.cfg.max_body_bytes))
        if self.canary is not None:
            self.canary.start()       # the decisions read before the first call is routed
        self._server = web.Server(self.handle, self.cfg.host, self.cfg.port, limits=limits, name="lightspan-gateway")
        self._server.start()
        log.info("gateway on %s -> %s", self.url, redact(", ".join(self.cfg.upstreams) or self.upstream))
        return self.url

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.stop()
        self._server = None
        if self.canary is not None:
            self.canary.stop()

    def status(self) -> dict:
        a = self.admission
        with a.cond:
            doc = {"paused": a.paused, "in_flight": a.in_flight, "model_version": self.version.get(), **a.counts}
        return doc if self.canary is None else {**doc, "canary": self.canary.status()}

    # --- routes ------------------------------------------------------------------------------
    def handle(self, request: web.Request) -> web.Response | None:
        try:
            return self._route(request)
        except web.HTTPError as exc:
            headers = {**exc.headers, **({"Connection": "close"} if exc.close else {})}
            return _error(paths.protocol_of(request.raw_path.decode("latin-1")), exc.status, exc.message, headers)

    def _route(self, request: web.Request) -> web.Response | None:
        self.guard.check(request)
        path, method = request.path, request.method
        if path == "/health" and method == "GET":
            return web.json_response(200, {"status": "ok", "paused": self.admission.paused})
        if path.startswith("/admin/"):
            return self._admin(request)
        raw = request.raw_path.decode("latin-1")
        why = paths.unsafe(raw)
        if why:
            raise web.HTTPError(400, why)
        reward_ids = paths.reward_route(raw)
        if reward_ids is not None:
            return self._reward(request, reward_ids)
        routed = route(raw + (f"?{request.query}" if request.query else ""))
        if routed is None:
            raise web.HTTPError(404, f"no route {path}; the OpenAI API is under /v1")
        path_attrs, upstream = routed
        endpoint = paths.endpoint(upstream)
        if endpoint is None:
            raise web.HTTPError(404, f"{upstream.split('?')[0]} is not served through the gateway; it serves "
                                      f"{', '.join(sorted(ENDPOINTS))}")
        if method not in endpoint.methods:
            raise web.HTTPError(405, f"use {' or '.join(endpoint.methods)} on {upstream.split('?')[0]}",
                                 {"Allow": ", ".join(endpoint.methods)})
        ids = call_attributes(path_attrs, request.header_list)   # a repeated x-lightspan-* header: its first value
        if endpoint.protocol is None:
            return self._passthrough(request, upstream, ids)
        return self._generate(request, endpoint.protocol, upstream, ids)

    def _admin(self, request: web.Request) -> web.Response:
        if not web.bearer(request.headers.get("authorization"), self.cfg.admin_token):
            raise web.HTTPError(401, "admin routes need 'Authorization: Bearer <admin_token>'")
        return admin(request, self.admission, self.version, self.status, self.cfg.drain_timeout_s)

    def _reward(self, request: web.Request, ids: dict) -> web.Response:
        """``POST /rollouts/{id}/reward``: the rollout's reward, to the collector (rollout/rewards.py)."""
        if request.method != "POST":
            raise web.HTTPError(405, "use POST on /rollouts/{id}/reward", {"Allow": "POST"})
        if not ids.get(semconv.ROLLOUT_ID):
            raise web.HTTPError(400, "a session reward's path names its rollout: POST /rollouts/{id}/reward")
        try:
            reward = reward_doc(ids, request.json(MAX_BODY_BYTES))
        except BadReward as e:
            self.admission.count("rewards_refused")
            return web.json_response(400, {"error": str(e), "param": e.field})
        status, answer, headers = self.rewards.post(reward)
        self.admission.count("rewards_posted" if status == 200 else "rewards_refused")
        return web.json_response(status, answer, headers)

    # --- upstream ----------------------------------------------------------------------------
    def _upstream_headers(self, request: web.Request) -> dict[str, str]:
        headers = {k: request.headers[k] for k in _FORWARDED_HEADERS if request.headers.get(k)}
        if "authorization" not in headers and request.headers.get("x-api-key"):
            # an Anthropic client's key, as vLLM's --api-key check reads keys (a bearer token)
            headers["authorization"] = f"Bearer {request.headers['x-api-key']}"
        headers["Content-Type"] = "application/json"
        return headers

    def _send(self, method: str, upstream: str, headers: dict, body: bytes, stream: bool = False, key: str = ""):
        """One request to vLLM (with replicas, the one of rollout ``key``: rollout/replicas.py). A
        replica that refuses or resets the connection is marked down and the next one is tried:
        nothing of the call reached the caller yet, and its body is sent again as it is."""
        if self.replicas is None:
            return self.client.send(method, upstream, headers, body, stream)
        order = self.replicas.order(key)
        if not order:
            raise requests.ConnectionError(redact(f"no vLLM replica behind {', '.join(self.cfg.upstreams)}"))
        for n, replica in enumerate(order):
            try:
                return self.client.send(method, upstream, headers, body, stream,
                                        base=replica.rstrip("/").removesuffix("/v1"))
            except requests.ConnectionError as e:     # refused, reset, no route (not a slow answer)
                self.replicas.down(replica, e)
                if n + 1 == len(order):
                    raise
                self.admission.count("replica_failovers")

    def _passthrough(self, request: web.Request, upstream: str, ids: dict) -> web.Response:
        """A path of the table that is not captured, untouched and untraced (``GET /v1/models``, …);
        with replicas, a rollout's calls still go to its replica."""
        body = request.body(self.cfg.max_body_bytes)
        key = untraced_key(ids.get(semconv.ROLLOUT_ID), request.headers.get("traceparent"))
        try:
            resp = self._send(request.method, upstream, self._upstream_headers(request), body, key=key)
        except requests.RequestException as e:
            return _error(paths.protocol_of(upstream), 502, f"upstream unreachable: {e}")
        return web.Response(resp.status_code, resp.headers.get("content-type", "application/json"), resp.content)

    # --- the traced generation call ------------------------------------------------------------
    def _generate(self, request: web.Request, protocol: Protocol, upstream: str, ids: dict) -> web.Response | None:
        # the whole body first: a client that never sends it holds no slot
        asked = request.json(self.cfg.max_body_bytes)
        if not isinstance(asked, dict):
            raise web.HTTPError(400, "request body is not a JSON object")
        bad = invalid(protocol, asked)       # a field the gateway reads, of the wrong type: the caller's error
        if bad is not None:
            self.admission.count("refused_invalid")
            return _error(protocol, 400, bad[1], param=bad[0])
        refused = self.admission.enter()
        if refused:
            raise web.HTTPError(429, "paused for a weight update" if refused == "paused"
                                 else "too many requests in flight", {"Retry-After": str(self.cfg.retry_after_s)})
        try:
            asked, version = self._routed(asked, ids, request.headers.get("traceparent"))
            ex = Exchange(protocol, asked, upstream, self.cfg.strip_capture_fields, self.cfg.capture_content)
            return self._traced(request, ex, ids, version)
        finally:
            self.admission.leave()

    def _traced(self, request: web.Request, ex: Exchange, ids: dict, version: int | None) -> web.Response | None:
        model = str(ex.asked.get("model", ""))
        op = ex.protocol.operation
        attrs = semconv.genai({semconv.GEN_AI_OPERATION_NAME: op, semconv.GEN_AI_REQUEST_MODEL: model,
                               semconv.GEN_AI_PROVIDER_NAME: ex.protocol.provider, **ids})
        if self.cfg.capture_content:
            try:
                attrs[semconv.GEN_AI_INPUT_MESSAGES] = messages.dumps(ex.inputs())
            except Exception:   # any JSON object is a request; vLLM refuses what it must
                log.debug("gateway: could not read the request's messages", exc_info=True)
        span = self.tracer.start_span(f"{op} {model}".strip(), context=_PROPAGATOR.extract(request.headers),
                                      kind=trace.SpanKind.SERVER, attributes=attrs)
        headers = self._upstream_headers(request)
        _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))  # vLLM's own spans join ours
        complete, tail, answer = False, [], None
        try:
            stream = bool(ex.asked.get("stream"))
            try:
                # one rollout, one replica: its id, else its trace (a rollout without an id is a trace)
                key = str(ids.get(semconv.ROLLOUT_ID) or format(span.get_span_context().trace_id, "032x"))
                resp = self._send("POST", ex.upstream, headers, dumps(ex.body()).encode(), stream, key)
            except requests.RequestException as e:
                self._upstream_failed(span, f"upstream unreachable: {e}")
                return _error(ex.protocol, 502, f"upstream unreachable: {e}")
            if resp.status_code != 200:
                self._upstream_failed(span, f"upstream answered {resp.status_code}", resp.status_code)
                return web.Response(resp.status_code,
                                     *ex.error(resp.headers.get("content-type", "application/json"), resp.content))
            # a stream asked for and a JSON body answered (an upstream that does not stream this
            # request): the body is the answer, not an event stream that never ends
            if stream and resp.headers.get("content-type", "").startswith("text/event-stream"):
                if self._relay(request, resp, ex):
                    tail = ex.end()
            else:
                try:
                    answer = web.Response(200, "application/json", dumps(ex.answer(loads(resp.content))).encode())
                except (ValueError, TypeError, AttributeError, requests.RequestException) as e:
                    self._upstream_failed(span, f"upstream answer unreadable: {e}")
                    return _error(ex.protocol, 502, f"upstream answer unreadable: {e}")
            complete = ex.finished
            if complete:
                served = self.version.get() if version is None else version    # the canary's arm
                span.set_attributes({**ex.attributes(served, self.cfg.capture_content),
                                     **served_attributes(self.version.published(), model)})
            else:
                span.set_attribute(semconv.CAPTURE_STATUS, "stream_incomplete")
        finally:
            # the span ends before the answer's last bytes go out: a caller that has its answer
            # can count on the span having been handed to the exporter
            span.end()
        if answer is None:
            if complete:
                for frame in tail:             # the stream's end ([DONE], message_stop), after the span
                    request.write(frame)
                request.write(b"", end=True)
            else:
                request.abandon()              # unterminated: the caller sees the break
        return answer

    def _routed(self, asked: dict, ids: dict, traceparent: str | None) -> tuple[dict, int | None]:
        """The request with the model of the policy that owns the caller's agent (rollout/routing.py),
        then of its canary arm, and that arm's version (None without a canary)."""
        agent, version = ids.get(semconv.GEN_AI_AGENT_NAME), None
        try:
            model = served_model(self.cfg.policy_configs, agent, asked.get("model"))
        except ConfigError as e:      # two policies' agent_match patterns claim this agent
            raise web.HTTPError(400, f"agent {agent!r} cannot be routed: {e}") from None
        if self.canary is not None:   # one rollout, one arm: its id, else its trace
            model, version = self.canary.route(model, untraced_key(ids.get(semconv.ROLLOUT_ID), traceparent))
        return (asked if model == asked.get("model") else {**asked, "model": model}), version

    def _upstream_failed(self, span, message: str, code: int | None = None) -> None:
        span.set_attribute(semconv.CAPTURE_STATUS, "upstream_error")
        if code is not None:
            span.set_attribute("web.response.status_code", code)
        span.set_status(Status(StatusCode.ERROR, message))
        self.admission.count("upstream_errors")

    def _relay(self, request: web.Request, resp, ex: Exchange) -> bool:
        """Relay vLLM's server-sent events as they arrive, as the caller's protocol has them; True
        when vLLM's stream ended cleanly (its last frames are left to the caller, after the span)."""
        request.start(200, {"Content-Type": resp.headers.get("content-type", "text/event-stream"),
                            "Cache-Control": "no-cache"})
        try:
            for line in lines(resp.raw):
                for frame in ex.frames(line):
                    request.write(frame)
        except web.ClientGone:
            log.info("the caller left mid-stream")
            return False
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError, ValueError) as e:
            log.warning("upstream stream broke off: %s", e)
            return False
        finally:
            resp.close()
        return True


def _tracer_provider(cfg: GatewayConfig):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({semconv.SERVICE_NAME: cfg.service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint, insecure=True)))
    return provider


def serve(cfg: GatewayConfig, canary: CanaryConfig | None = None) -> int:
    """Run in the foreground (``lightspan gateway``). SIGTERM/SIGINT: pause, drain, flush spans, exit."""
    provider = _tracer_provider(cfg)
    gateway = Gateway(cfg, provider, canary)
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
