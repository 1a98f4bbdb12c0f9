"""The runner's side of the span spool (tracing/spool.py): what reached the collector, per rollout.

Every rollout's agent appends each span it ends to the rollout's own spool file
(``LIGHTSPAN_SPOOL=LOGS_DIR/ROLLOUT_ID.spool``). The runner exports those spans itself, with its own
exporter: while the rollout runs, a shipper thread exports what is new every ``interval_s`` (so a
copy the agent's exporter delivered too arrives within the collector's deduplication window, and
a long rollout is visible as it runs); once the process is gone, however it ended, :meth:`Shipper.
finish` exports the rest. The collector acknowledges an export only once it is durable (WAL,
fsync), so its acknowledgement is the receipt: a span is delivered when an acknowledged export
carried it; what is still unacknowledged when the rollout has ended and the exporter gave up is
lost, counted on the rollout's ``lightspan.runner`` span and in the summary (and ``lightspan
rollout`` exits non-zero). Spans the agent's own exporter delivered first are stored once: the
collector keeps the first copy of each (trace_id, span_id).

The spool is written by the agent, which the runner does not trust with its identity: every
shipped span's resource carries the rollout's own ids, whatever the file says. A shipped span is
the one the agent's exporter would send, byte for byte in OTLP (tracing/spool.py says how), since
its copy is usually the one the collector keeps. The spool also says whether an uncaught exception
ended the agent's own process (the first to open the file; a subprocess's does not count):
:attr:`Delivery.exception`, the rollout's end ``exception`` (rollout/outcomes.py).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from lightspan.tracing import semconv
from lightspan.tracing import spool as format_

log = logging.getLogger(__name__)

BATCH = 256   # spans per export: 256 captured chat spans are ≈ 3 MB of OTLP protobuf


@dataclass
class Delivery:
    """A rollout's spans: read from its spool, acknowledged by the collector, lost; damaged
    records (a write the kill cut short) are skipped and counted; ``spool`` is False when the agent
    wrote none (it did not run lightspan's instrumentor: its delivery cannot be checked)."""
    spooled: int = 0
    delivered: int = 0
    lost: int = 0
    damaged: int = 0
    spool: bool = True
    exception: str | None = None   # the uncaught exception's type that ended the agent process, if one did


def exporter(endpoint: str, protocol: str, timeout_s: float):
    """The runner's own OTLP exporter (its result is the receipt)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        return GrpcExporter(endpoint=endpoint, insecure=True, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s)


def _context(trace_hex: str, span_hex: str, remote: bool, flags: int = 1, state: str | None = None) -> SpanContext:
    return SpanContext(int(trace_hex, 16), int(span_hex, 16), remote, TraceFlags(flags),
                       TraceState.from_header([state]) if state else None)


def _attributes(raw: dict | None, dropped: int = 0):
    """A record's attributes, with the count of those the agent's SDK dropped (its limits)."""
    attrs = format_.attributes(raw)
    if not dropped:
        return attrs
    bounded = BoundedAttributes(None, attrs)
    bounded.dropped = dropped
    return bounded


def _bounded(items: list, dropped: int):
    if not dropped:
        return items
    out = BoundedList.from_seq(None, items)
    out.dropped = dropped
    return out


def _scope(raw: list | None, scopes: dict) -> InstrumentationScope | None:
    """One scope object per scope: the encoder groups spans by it (a NaN attribute is unequal to itself)."""
    if not raw:
        return None
    key = repr(raw)
    if key not in scopes:
        attrs = format_.attributes(raw[3]) if len(raw) > 3 else None
        scopes[key] = InstrumentationScope(raw[0], raw[1], raw[2], attrs)
    return scopes[key]


def to_span(record: dict, resource: Resource, scopes: dict | None = None) -> ReadableSpan:
    """The SDK span a spool record describes (the inverse of tracing/spool.py's ``span_record``): its
    OTLP encoding is the one the agent's exporter would send."""
    parent = _context(record["t"], record["p"], bool(record.get("pr"))) if record.get("p") else None
    code, description = record.get("st") or (0, None)
    status_code = StatusCode(code)
    dropped = record.get("d") or (0, 0, 0)
    events = [Event(e[0], _attributes(e[2], e[3] if len(e) > 3 else 0), e[1]) for e in record.get("ev", ())]
    links = [Link(_context(link[0], link[1], bool(link[3]), link[4]),
                  _attributes(link[2], link[5] if len(link) > 5 else 0)) for link in record.get("l", ())]
    return ReadableSpan(
        record["n"], context=_context(record["t"], record["i"], False, record.get("f", 1), record.get("ts")),
        parent=parent, resource=resource, attributes=_attributes(record.get("a"), dropped[0]),
        events=_bounded(events, dropped[1]), links=_bounded(links, dropped[2]),
        kind=SpanKind(record.get("kd", 0)),
        status=Status(status_code, description if status_code is StatusCode.ERROR else None),
        start_time=record.get("b"), end_time=record.get("e"),
        instrumentation_scope=_scope(record.get("s"), {} if scopes is None else scopes))


def runner_span(attributes: dict, start_ns: int, end_ns: int, error: str | None) -> ReadableSpan:
    """The rollout's ``lightspan.runner`` span (its own trace), built here and exported with the spool's
    spans by the runner's exporter: its delivery is checked like theirs."""
    ids = RandomIdGenerator()
    context = SpanContext(ids.generate_trace_id(), ids.generate_span_id(), False, TraceFlags(TraceFlags.SAMPLED))
    return ReadableSpan(
        semconv.SPAN_RUNNER, context=context, resource=Resource.create({semconv.SERVICE_NAME: "lightspan-runner"}),
        attributes=attributes, kind=SpanKind.INTERNAL, start_time=start_ns, end_time=end_ns,
        status=Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET),
        instrumentation_scope=InstrumentationScope("lightspan.runner"))


@dataclass
class Tail:
    """One rollout's spool being shipped: how far it is read, what is read and not yet acknowledged."""
    path: str
    ids: dict                                   # the rollout's resource attributes, forced on every span
    offset: int = 0
    seen: bool = False                          # the spool file existed
    agent_key: str | None = None                # the first process to open it: the agent's own
    resources: dict = field(default_factory=dict)
    scopes: dict = field(default_factory=dict)
    pending: list = field(default_factory=list)
    delivery: Delivery = field(default_factory=Delivery)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, final: bool) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.seen = True
        records, used, damaged = format_.parse(data, final)
        self.offset += used
        self.delivery.damaged += damaged
        for record in records:
            if "resource" in record:
                attrs = {**format_.attributes(record["resource"]), **self.ids}
                self.resources[record.get("key")] = Resource(attrs, record.get("schema") or None)
                self.agent_key = self.agent_key or record.get("key")
                continue
            if "end" in record:   # an uncaught exception ended a process: the rollout's, if the agent's own
                if record.get("end") == "exception" and record.get("key") == self.agent_key:
                    self.delivery.exception = str(record.get("type") or "")[:200] or "Exception"
                continue
            resource = self.resources.get(record.get("k")) or Resource(dict(self.ids))
            try:
                self.pending.append(to_span(record, resource, self.scopes))
                self.delivery.spooled += 1
            except (KeyError, ValueError, TypeError, IndexError):
                self.delivery.damaged += 1


class Shipper:
    """Ships the spools of the rollouts in flight (module docstring); one exporter per thread."""

    def __init__(self, endpoint: str, protocol: str, timeout_s: float = 10.0, interval_s: float = 2.0):
        self.endpoint, self.protocol, self.timeout_s, self.interval_s = endpoint, protocol, timeout_s, interval_s
        self._local = threading.local()
        self._tails: dict[str, Tail] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lightspan-spool-shipper", daemon=True)
        self._thread.start()

    def export(self, spans: list) -> bool:
        """Export ``spans`` with this thread's exporter; True when the collector acknowledged them."""
        if not spans:
            return True
        exp = getattr(self._local, "exporter", None)
        if exp is None:
            exp = self._local.exporter = exporter(self.endpoint, self.protocol, self.timeout_s)
        try:
            return exp.export(spans) is SpanExportResult.SUCCESS
        except Exception as e:  # noqa: BLE001 (an exporter that raises delivered nothing)
            log.warning("span export to %s failed: %s: %s", self.endpoint, type(e).__name__, e)
            return False

    def start(self, rollout_id: str, path: str, ids: dict) -> Tail:
        if os.path.exists(path):
            os.unlink(path)   # a retried rollout never reuses an id; a stale file is nobody's
        tail = Tail(path, ids)
        with self._lock:
            self._tails[rollout_id] = tail
        return tail

    def _ship(self, tail: Tail, final: bool) -> None:
        tail.read(final)
        while tail.pending:
            batch = tail.pending[:BATCH]
            if not self.export(batch):
                return
            del tail.pending[:len(batch)]
            tail.delivery.delivered += len(batch)

    def finish(self, rollout_id: str) -> Delivery:
        """After the rollout's process is gone: read and export the rest; what is left is lost."""
        with self._lock:
            tail = self._tails.pop(rollout_id)
        with tail.lock:
            self._ship(tail, final=True)
            tail.delivery.lost = len(tail.pending)
            tail.delivery.spool = tail.seen
            tail.pending = []
        delivery = tail.delivery
        if delivery.damaged:
            log.warning("rollout %s: %d damaged spool record(s) skipped (a write cut short by the process's end)",
                        rollout_id, delivery.damaged)
        if delivery.lost:   # the file stays, for a look at what was lost
            log.error("rollout %s: %d of %d span(s) did not reach the collector at %s; they are kept in %s",
                      rollout_id, delivery.lost, delivery.spooled, self.endpoint, tail.path)
        elif tail.seen:
            try:
                os.unlink(tail.path)
            except OSError:
                pass
        return delivery

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                tails = list(self._tails.values())
            for tail in tails:
                if tail.lock.acquire(blocking=False):   # finish() holds it at the end
                    try:
                        self._ship(tail, final=False)
                    except Exception:  # noqa: BLE001 (finish() tries again and counts)
                        log.debug("spool shipping failed", exc_info=True)
                    finally:
                        tail.lock.release()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + self.interval_s)
