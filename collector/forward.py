"""Forwarding what the collector acknowledges to another OTLP/HTTP endpoint (``[collector.forward]``),
so agents pointed at lightspan still reach the backend the team already uses (docs/architecture.md,
"Files and forwarding").

export ─ ack ─ offer → bounded queue (``queue_bytes``) → one sender thread → POST endpoint/v1/traces|logs

- **Never blocking ingest.** :meth:`Forwarder.offer` only appends to the queue; when the queue is
  full the request is dropped and counted (``forward_dropped_total``): the collector's own store
  has it, and its acknowledgement never waits on the other backend.
- **Retries with backoff.** A connection error, 408, 429, 502, 503 or 504 is retried, after
  ``Retry-After`` when it says, else after an exponential backoff (``backoff_s`` doubling up to
  ``backoff_max_s``), for at most ``max_elapsed_s`` a request; any other answer (400, 413, …) is
  permanent: dropped and counted.
- **What goes out** is what was acknowledged, as OTLP/HTTP protobuf, except the spans of the
  collector's reward scope: lightspan's own rewards (a judge's, a person's, an evaluator's) go out as
  ``gen_ai.evaluation.result`` log records instead (:func:`~lightspan.collector.evaluation_requests.event_records`),
  which other tools show beside the spans they score.
- **Stop** sends what is queued for at most ``drain_s``, then drops the rest, counted.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from lightspan.core.config import ConfigError, from_table, option, redact
from lightspan.store.schema import REWARD_SCOPE

log = logging.getLogger(__name__)
SECTION = "collector.forward"
_PATHS = {"traces": "/v1/traces", "logs": "/v1/logs"}
_RETRYABLE = {408, 429, 502, 503, 504}


@dataclass(frozen=True)
class ForwardConfig:
    endpoint: str = option("", "OTLP/HTTP base URL of the backend to forward to (http://otel-collector:4318): "
                               "traces go to ENDPOINT/v1/traces, logs to ENDPOINT/v1/logs, as protobuf.")
    headers: dict[str, str] | None = option(None, "HTTP headers sent with every request, e.g. "
                                                  "{authorization = \"Bearer …\"}.")
    queue_bytes: int = option(64 << 20, "Bytes of acknowledged requests waiting to be forwarded; past it a request "
                                        "is dropped (counted in forward_dropped_total), never waited for.")
    timeout_s: float = option(10.0, "Time one request may take.")
    backoff_s: float = option(0.5, "First wait after a retryable failure; it doubles, up to backoff_max_s.")
    backoff_max_s: float = option(30.0, "Longest wait between two tries.")
    max_elapsed_s: float = option(300.0, "Time a request is retried for before it is dropped (counted).")
    drain_s: float = option(5.0, "At stop, time spent sending what is queued; the rest is dropped (counted).")

    def __post_init__(self):
        if not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(SECTION, "endpoint", f"{redact(self.endpoint)!r} is not an http(s) URL",
                              "give the OTLP/HTTP base URL, e.g. http://otel-collector:4318")
        for name in ("queue_bytes",):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(SECTION, name, f"{getattr(self, name)!r} is not a positive number of bytes",
                                  "use e.g. 67108864 (64 MiB)")
        for name in ("timeout_s", "backoff_s", "backoff_max_s", "max_elapsed_s", "drain_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(SECTION, name, f"{value!r} is not a number of seconds >= 0", "use e.g. 10")


def parse(table: dict | None) -> ForwardConfig | None:
    """The ``[collector.forward]`` table (the collector config's ``forward`` field) as a
    :class:`ForwardConfig`; None when forwarding is off."""
    if not table:
        return None
    if not isinstance(table, dict):
        raise ConfigError(SECTION, "forward", f"{table!r} is not a table", 'give e.g. {endpoint = "http://host:4318"}')
    return from_table(ForwardConfig, section=SECTION, table=table)


def without_rewards(request: ExportTraceServiceRequest) -> int:
    """Take the collector's own reward spans out of ``request`` (they go out as evaluation events);
    returns how many."""
    taken = 0
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            if ss.scope.name == REWARD_SCOPE and ss.spans:
                taken += len(ss.spans)
                del ss.spans[:]
    return taken


class Forwarder:
    """The bounded queue and its one sender thread (see the module docstring)."""

    def __init__(self, config: ForwardConfig, metrics):
        self.config = config
        self.metrics = metrics
        self._queue: collections.deque[tuple[str, bytes]] = collections.deque()
        self._bytes = 0
        self._lock = threading.Condition()
        self._stopping = False
        self._deadline = float("inf")      # at stop: when to give up what is still queued
        self._thread: threading.Thread | None = None
        self._session = requests.Session()
        self._session.headers.update({"Content-Type": "application/x-protobuf", **(config.headers or {})})

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def start(self) -> "Forwarder":
        self._thread = threading.Thread(target=self._run, name="lightspan-collector-forward", daemon=True)
        self._thread.start()
        return self

    def offer(self, signal: str, payload: bytes) -> bool:
        """Queue one acknowledged request (OTLP protobuf) for the endpoint; False when it was dropped
        (the queue is full, or the forwarder stops). Never waits."""
        with self._lock:
            if self._stopping or self._bytes + len(payload) > self.config.queue_bytes:
                self.metrics.add("forward_dropped_total")
                return False
            self._queue.append((signal, payload))
            self._bytes += len(payload)
            self._lock.notify()
        self.metrics.add("forward_queued_total")
        return True

    def stop(self) -> None:
        """Send what is queued for at most ``drain_s``, drop the rest (counted). Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._deadline = time.monotonic() + self.config.drain_s
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._queue:
                self.metrics.add("forward_dropped_total", len(self._queue))
                log.warning("forward: %d request(s) not sent to %s before stopping", len(self._queue),
                            redact(self.config.endpoint))
            self._queue.clear()
            self._bytes = 0
        self._session.close()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._lock.wait()
                if not self._queue or time.monotonic() >= self._deadline:
                    return
                signal, payload = self._queue[0]
            sent = self._send(signal, payload)
            with self._lock:
                self._queue.popleft()
                self._bytes -= len(payload)
            self.metrics.add("forward_sent_total" if sent else "forward_dropped_total")

    def _send(self, signal: str, payload: bytes) -> bool:
        """One request until it is delivered (True) or given up (False)."""
        cfg, url = self.config, self.config.endpoint.rstrip("/") + _PATHS[signal]
        first, wait = time.monotonic(), cfg.backoff_s
        while True:
            retry_after = None
            try:
                answer = self._session.post(url, data=payload, timeout=cfg.timeout_s)
                if answer.status_code < 300:
                    return True
                if answer.status_code not in _RETRYABLE:
                    log.warning("forward: %s answered %d; request dropped: %s", redact(url), answer.status_code,
                                answer.text[:200])
                    return False
                retry_after = _retry_after(answer.headers.get("Retry-After"))
            except requests.RequestException as exc:
                log.debug("forward: %s: %s", redact(url), exc)
            self.metrics.add("forward_retries_total")
            delay = min(retry_after if retry_after is not None else wait, cfg.backoff_max_s)
            wait = min(wait * 2, cfg.backoff_max_s)
            now = time.monotonic()
            if now + delay - first > cfg.max_elapsed_s or now + delay > self._deadline:
                log.warning("forward: %s unreachable for %.0f s; request dropped", redact(url), now - first)
                return False
            with self._lock:                  # a stop cuts the wait short (and sets the deadline)
                self._lock.wait_for(lambda: self._stopping and time.monotonic() >= self._deadline, timeout=delay)


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None
