"""Every ended span leaves the agent process at once: a spool file per rollout.

The SDK's BatchSpanProcessor holds ended spans for up to 5 s before its exporter sends them, so a
process that dies in that window (a timeout's SIGKILL, the OOM killer) loses the LLM calls it made
last, which are the failures a policy must learn from. When ``LIGHTSPAN_SPOOL`` names a file
(``lightspan rollout`` gives each rollout its own), :class:`Spool`, a span processor beside the
exporter's, appends every span to it as it ends, in one unbuffered ``write``: before ``end()``
returns, so before a call's answer reaches the agent's code. No fsync: the case is the death of the
process, not of the machine (the page cache survives it). After the process is gone, however it
ended, the runner reads the file and exports the spans itself (rollout/spool.py); the collector
deduplicates on (trace_id, span_id), so a span the agent's own exporter delivered too is stored once.

A record is ``MAGIC | length (uint32 LE) | crc32 (uint32 LE) | payload``; the payload is compact JSON
(orjson), not OTLP protobuf: protobuf encoding of a captured chat span cost ~10x as much on the
agent's calling thread (bench/README.md, "Capture overhead", session 9), and the runner, which is
not on the agent's path, encodes it. Each process writes one ``resource`` record when it opens the
file (subprocesses the agent starts under ``opentelemetry-instrument`` append to the same file),
then one record per span naming it by ``key``. A span's record carries all the agent's exporter would
send (the collector keeps the first copy of a span, and the runner ships every 2 s while the
exporter waits up to 5 s, so the spool's copy is usually the one stored): attribute values of every
type the SDK keeps, with what JSON cannot hold tagged, ``{"$b": base64}`` for bytes (token ids),
``{"$f": "nan" | "inf" | "-inf"}`` for a float that is not finite, ``{"$m": {...}}`` for a mapping,
and a value the OTLP encoder would skip (a lone surrogate, an integer beyond 64 bits) left out as it
leaves it out; the dropped attribute, event and link counts; the scope's attributes.
:func:`parse` reads records back, skipping (and counting) a truncated or damaged one, never raising.

An uncaught exception that ends the process is recorded too, as one ``{"end": "exception", "type":
...}`` record (:func:`_at_exit`, at exit, from ``sys.last_value``, which the interpreter sets before
it calls ``sys.excepthook``: an agent that installs a hook of its own is still recorded; a rollout
worker's child sets it as the interpreter does, rollout/zygote.py). The runner takes it from the
process that opened the spool first, the agent's own (rollout/spool.py).
"""

from __future__ import annotations

import atexit
import base64
import logging
import os
import struct
import sys
import threading
import uuid
import weakref
import zlib

from collections.abc import Mapping, Sequence

import orjson
from opentelemetry.sdk.trace import SpanProcessor

from lightspan.tracing import semconv

log = logging.getLogger(__name__)

SPOOL_ENV = semconv.SPOOL_ENV
MAGIC = b"LS"
_HEADER = struct.Struct("<2sII")
HEADER_SIZE = _HEADER.size
_BYTES, _FLOAT, _MAP = "$b", "$f", "$m"


def _default(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {_BYTES: base64.b64encode(value).decode()}
    raise TypeError(f"{type(value).__name__} is not an attribute value")


def frame(payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def _value(v):
    """An attribute value that is not a plain str, int, bool or bytes, as JSON keeps it (module docstring)."""
    if v is None:
        return None
    if isinstance(v, float):
        v = float(v)                   # a subclass (numpy.float64) as the float the encoder sends
        return v if v - v == 0 else {_FLOAT: repr(v)}
    if isinstance(v, (str, int, bytes)):
        return v
    if isinstance(v, Mapping):
        return {_MAP: {k: _value(x) for k, x in v.items()}}
    if isinstance(v, Sequence):
        return [_value(x) for x in v]
    return v


def _attrs(attributes) -> dict:
    if not attributes:
        return {}
    out = {}
    for k, v in attributes.items():
        t = type(v)       # the usual values, as they are: one type check each on the agent's thread
        out[k] = v if t is str or t is int or t is bool or t is bytes else _value(v)
    return out


def _encodable(attributes: dict) -> dict:
    """The attributes the OTLP encoder would send: it skips a value it cannot encode (a lone surrogate,
    an integer beyond 64 bits), key by key; so does the spool (the slow path, after orjson refused one).
    An integer orjson takes and the encoder does not (2**63 to 2**64 - 1) is kept: the runner's encoder
    skips it as the agent's does."""
    out = {}
    for k, v in attributes.items():
        try:
            orjson.dumps(v, default=_default)
        except TypeError:
            continue
        out[k] = v
    return out


def span_record(span, key: str) -> dict:
    """One ended SDK span as a spool record (the inverse is rollout/spool.py's)."""
    ctx, parent, scope = span.context, span.parent, span.instrumentation_scope
    record = {"k": key, "t": format(ctx.trace_id, "032x"), "i": format(ctx.span_id, "016x"),
              "f": int(ctx.trace_flags), "n": span.name, "kd": span.kind.value,
              "b": span.start_time, "e": span.end_time, "a": _attrs(span.attributes),
              "st": [span.status.status_code.value, span.status.description]}
    if parent is not None:
        record["p"], record["pr"] = format(parent.span_id, "016x"), parent.is_remote
    if ctx.trace_state:
        record["ts"] = ctx.trace_state.to_header()
    if scope is not None:
        record["s"] = [scope.name, scope.version, scope.schema_url, _attrs(getattr(scope, "attributes", None))]
    if span.events:
        record["ev"] = [[e.name, e.timestamp, _attrs(e.attributes), e.dropped_attributes] for e in span.events]
    if span.links:
        record["l"] = [[format(link.context.trace_id, "032x"), format(link.context.span_id, "016x"),
                        _attrs(link.attributes), link.context.is_remote, int(link.context.trace_flags),
                        link.dropped_attributes] for link in span.links]
    dropped = [span.dropped_attributes, span.dropped_events, span.dropped_links]
    if any(dropped):
        record["d"] = dropped
    return record


def dumps(record: dict) -> bytes:
    try:
        return orjson.dumps(record, default=_default)
    except TypeError:   # a value the encoder skips too: leave it out, key by key (_encodable)
        if "a" not in record:
            raise
        fixed = {**record, "a": _encodable(record["a"])}
        if "ev" in record:
            fixed["ev"] = [[e[0], e[1], _encodable(e[2]), *e[3:]] for e in record["ev"]]
        if "l" in record:
            fixed["l"] = [[*link[:2], _encodable(link[2]), *link[3:]] for link in record["l"]]
        return orjson.dumps(fixed, default=_default)


def exception_type(exc: BaseException) -> str:
    """OTel's ``exception.type`` of ``exc`` (semconv.ROLLOUT_EXCEPTION_TYPE)."""
    t = type(exc)
    return t.__qualname__ if t.__module__ in ("builtins", "__main__") else f"{t.__module__}.{t.__qualname__}"


class Spool(SpanProcessor):
    """Appends each ended span to the spool file (module docstring); an error is logged once and
    never reaches the agent."""

    def __init__(self, path: str, resource=None):
        self.path = path
        self.pid = os.getpid()
        self.key = f"{self.pid}-{uuid.uuid4().hex[:8]}"
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.active = True     # (the capture benchmark switches it per call)
        self.failed = 0
        attrs = _attrs(resource.attributes) if resource is not None else {}
        self._write({"resource": attrs, "schema": getattr(resource, "schema_url", "") or "", "key": self.key})

    def _write(self, record: dict, fd: int | None = None) -> None:
        data = frame(dumps(record))
        while data:   # one write (a short one only on a full disk)
            data = data[os.write(self.fd if fd is None else fd, data):]

    def ended_by(self, exc: BaseException) -> None:
        """Record that an uncaught ``exc`` ends this process (module docstring)."""
        record = {"end": "exception", "type": exception_type(exc), "key": self.key}
        try:
            if self.fd >= 0:
                self._write(record)
                return
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)   # shut down already
            try:
                self._write(record, fd)
            finally:
                os.close(fd)
        except Exception as e:  # noqa: BLE001 (the process is ending; its end shows as an exit)
            log.warning("lightspan: could not record the exception in %s: %s", self.path, e)

    def on_end(self, span) -> None:
        if not self.active:
            return
        try:
            self._write(span_record(span, self.key))
        except Exception as e:  # noqa: BLE001 (telemetry never breaks the agent)
            self.failed += 1
            if self.failed == 1:
                log.warning("lightspan: could not spool a span to %s: %s: %s", self.path, type(e).__name__, e)

    def shutdown(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        self.active = False

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_AT_EXIT_PID: list[int] = []   # the process whose atexit has _at_exit


def _at_exit() -> None:
    """At exit: the uncaught exception that ends this process, if one does, into its spools."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is None:
        return
    for spool in list(_ATTACHED.values()):
        if spool.pid == os.getpid():
            spool.ended_by(exc)


def attach(provider) -> Spool | None:
    """Put a :class:`Spool` on an SDK tracer provider when ``LIGHTSPAN_SPOOL`` names a file, read now
    (a rollout worker's child calls this after its environment became the rollout's,
    rollout/zygote.py); once per provider and path."""
    path = os.environ.get(SPOOL_ENV, "").strip()
    if not path or not hasattr(provider, "add_span_processor"):
        return None
    with _LOCK:
        spool = _ATTACHED.get(provider)
        if spool is not None and spool.path == path and spool.pid == os.getpid():
            return spool
        try:
            spool = Spool(path, getattr(provider, "resource", None))
        except OSError as e:
            log.warning("lightspan: cannot open the span spool %s (%s): spans of a process that dies may be lost",
                        path, e)
            return None
        provider.add_span_processor(spool)
        _ATTACHED[provider] = spool
        if _AT_EXIT_PID != [os.getpid()]:   # after the provider's own: ours runs first (LIFO)
            atexit.register(_at_exit)
            _AT_EXIT_PID[:] = [os.getpid()]
        return spool


# --- reading back (the runner, after the process is gone) ------------------------------------------

def _undo(value):
    if isinstance(value, dict):
        if _BYTES in value:
            return base64.b64decode(value[_BYTES])
        if _FLOAT in value:
            return float(value[_FLOAT])
        if _MAP in value:
            return {k: _undo(v) for k, v in value[_MAP].items()}
        return None
    if isinstance(value, list):
        return tuple(_undo(v) for v in value)
    return value


def attributes(raw: dict | None) -> dict:
    """A record's attribute dict as the SDK had it: bytes back, sequences as tuples."""
    return {k: _undo(v) for k, v in (raw or {}).items()}


def parse(data: bytes, final: bool) -> tuple[list[dict], int, int]:
    """``(records, bytes consumed, damaged records skipped)`` of spool bytes. A record cut off at the
    end is left unconsumed when ``final`` is false (its writer may still be writing it) and counted as
    damaged when true (the process was killed mid-write); a record with a bad header or checksum
    followed by more data is skipped to the next record that checks."""
    records: list[dict] = []
    pos = damaged = 0
    size = len(data)
    while pos < size:
        if size - pos < HEADER_SIZE:
            break
        magic, length, crc = _HEADER.unpack_from(data, pos)
        end = pos + HEADER_SIZE + length
        if magic == MAGIC and end <= size:
            payload = data[pos + HEADER_SIZE:end]
            if zlib.crc32(payload) == crc:
                try:
                    records.append(orjson.loads(payload))
                except orjson.JSONDecodeError:
                    damaged += 1
                pos = end
                continue
        elif magic == MAGIC:
            break   # incomplete: the last record
        # damaged: resynchronise at the next magic that starts a record which checks
        nxt = data.find(MAGIC, pos + 1)
        while nxt != -1 and not _checks(data, nxt):
            nxt = data.find(MAGIC, nxt + 1)
        if nxt == -1:
            break
        damaged += 1
        pos = nxt
    if final and pos < size:
        damaged += 1
        pos = size
    return records, pos, damaged


def _checks(data: bytes, pos: int) -> bool:
    if len(data) - pos < HEADER_SIZE:
        return False
    magic, length, crc = _HEADER.unpack_from(data, pos)
    end = pos + HEADER_SIZE + length
    return magic == MAGIC and end <= len(data) and zlib.crc32(data[pos + HEADER_SIZE:end]) == crc
