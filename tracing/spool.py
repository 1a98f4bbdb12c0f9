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
then one record per span naming it by ``key``. Bytes values (token ids) travel as ``{"$b": base64}``.
:func:`parse` reads records back, skipping (and counting) a truncated or damaged one, never raising.
"""

from __future__ import annotations

import base64
import logging
import os
import struct
import threading
import uuid
import weakref
import zlib

import orjson
from opentelemetry.sdk.trace import SpanProcessor

from lightspan.tracing import semconv

log = logging.getLogger(__name__)

SPOOL_ENV = semconv.SPOOL_ENV
MAGIC = b"LS"
_HEADER = struct.Struct("<2sII")
HEADER_SIZE = _HEADER.size
_BYTES = "$b"


def _default(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {_BYTES: base64.b64encode(value).decode()}
    raise TypeError(f"{type(value).__name__} is not an attribute value")


def frame(payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def _attrs(attributes) -> dict:
    return dict(attributes) if attributes else {}


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
        record["s"] = [scope.name, scope.version, scope.schema_url]
    if span.events:
        record["ev"] = [[e.name, e.timestamp, _attrs(e.attributes)] for e in span.events]
    if span.links:
        record["l"] = [[format(link.context.trace_id, "032x"), format(link.context.span_id, "016x"),
                        _attrs(link.attributes), link.context.is_remote, int(link.context.trace_flags)]
                       for link in span.links]
    return record


def dumps(record: dict) -> bytes:
    return orjson.dumps(record, default=_default)


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
        attrs = dict(resource.attributes) if resource is not None else {}
        self._write({"resource": attrs, "schema": getattr(resource, "schema_url", "") or "", "key": self.key})

    def _write(self, record: dict) -> None:
        data = frame(dumps(record))
        while data:   # one write (a short one only on a full disk)
            data = data[os.write(self.fd, data):]

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
        return spool


# --- reading back (the runner, after the process is gone) ------------------------------------------

def _undo(value):
    if isinstance(value, dict):
        return base64.b64decode(value[_BYTES]) if _BYTES in value else None
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
