"""The collector's write-ahead log: an export is acknowledged only once its bytes are here
and fsynced (docs/architecture.md, "Delivery").

``data_dir/wal/`` holds numbered segment files ``<id>.wal``. A record is::

    u32 little-endian payload length | u32 little-endian crc32(payload) | payload

The payload is the serialized ``ExportTraceServiceRequest``. New records go to the active
segment; :meth:`WAL.rotate` closes it (the next write opens a new one) and returns the ids of
the closed segments, which the writer deletes with :meth:`WAL.delete` once their spans are in
Parquet. :meth:`WAL.replay` reads closed segments back after a crash; a torn or corrupt record
ends its segment (a crash can tear only the last write of a segment) and replay goes on with
the next segment.

Group commit: :meth:`WAL.write` appends without syncing and returns the record's end position;
:meth:`WAL.sync` makes everything up to that position durable. Concurrent writers share one
fsync: whoever holds the sync lock syncs all bytes written so far, and the others find their
position already covered. :meth:`WAL.append` does both.

Payloads are opaque here. The collector stores a serialized ``ExportTraceServiceRequest`` as
is and tags other signals with a prefix that starts with a zero byte (``b"\\x00L"`` + an
``ExportLogsServiceRequest``): no protobuf message starts with 0x00 (field number 0 is
invalid), so trace records written before logs existed still replay as traces.

I/O errors (a full disk: ``ENOSPC``, or ``EIO``) never leave a record that could be acknowledged
but lost:

- a failed ``write`` is cut back with ``ftruncate`` to the segment's last whole record and
  raised; if even that fails, the segment is *torn*: the next write closes it (fsynced) and
  opens a new one, so nothing is ever appended after a torn record;
- a failed ``fsync`` raises, and so does every later :meth:`WAL.sync` of a position not yet
  durable in that segment (Linux may drop the dirty pages after reporting the error once, so a
  second fsync that succeeds proves nothing); the next write abandons the segment unsynced and
  starts a new one. Closed or abandoned segments are returned by the next :meth:`WAL.rotate`.

The caller refuses the export with a retryable status; writes succeed again as soon as the
disk does. The tests inject these errors through :meth:`WAL._write_all` and :meth:`WAL._fsync`.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from lightspan.store import fsync_dir

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
_SUFFIX = ".wal"
MAX_RECORD_BYTES = (1 << 32) - 1


class WAL:
    """Append-only, fsynced, segmented log of request payloads. Thread-safe."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._write_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        existing = self.segment_ids()
        self._next_id = (existing[-1] + 1) if existing else 1
        self._fd: int | None = None          # the active segment, opened on the first write
        self._active_id: int | None = None
        self._written = 0                    # logical bytes written since open, all segments
        self._synced = 0                     # logical bytes known durable
        self._segment_bytes = 0              # size of the active segment up to its last whole record
        self._broken: str | None = None      # the active segment saw an I/O error: "torn" or "unsynced"
        self._failed: tuple[tuple[int, int], ...] = ()   # (lo, hi]: positions never durable; replaced, not mutated
        self._abandoned: list[int] = []      # segments closed after an I/O error, for the next rotate()
        self._bytes = sum(self.segment_path(i).stat().st_size for i in existing)
        self._closed = False
        self.fsync_seconds = 0.0             # total time spent in fsync, and how often
        self.fsync_count = 0

    # --- paths --------------------------------------------------------------------------------
    def segment_path(self, segment_id: int) -> Path:
        return self.directory / f"{segment_id:020d}{_SUFFIX}"

    def segment_ids(self) -> list[int]:
        """Ids of all segment files on disk, oldest first (including the active one)."""
        ids = []
        for path in self.directory.glob(f"*{_SUFFIX}"):
            try:
                ids.append(int(path.name[: -len(_SUFFIX)]))
            except ValueError:
                continue
        return sorted(ids)

    def closed_segment_ids(self) -> list[int]:
        with self._write_lock:
            return [i for i in self.segment_ids() if i != self._active_id]

    @property
    def size_bytes(self) -> int:
        """Bytes in segment files on disk."""
        return self._bytes

    # --- writing ------------------------------------------------------------------------------
    def write(self, payload: bytes) -> int:
        """Append one record (not yet durable); returns the position to pass to :meth:`sync`."""
        if len(payload) > MAX_RECORD_BYTES:
            raise ValueError(f"a WAL record holds at most {MAX_RECORD_BYTES} bytes, got {len(payload)}")
        record = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        with self._write_lock:
            if self._closed:
                raise RuntimeError("the WAL is closed")
            if self._broken is not None:
                with self._sync_lock:
                    self._abandon()
            if self._fd is None:
                self._open_segment()
            try:
                self._write_all(self._fd, record)
            except OSError:
                try:   # cut the partial record off, so later records are not stuck behind it
                    os.ftruncate(self._fd, self._segment_bytes)
                except OSError:
                    self._broken = self._broken or "torn"
                raise
            self._segment_bytes += len(record)
            self._written += len(record)
            self._bytes += len(record)
            return self._written

    def sync(self, position: int) -> None:
        """Return once every byte up to ``position`` is on stable storage; raise OSError if it
        never will be (an fsync of its segment failed)."""
        if self._synced >= position and not self._lost(position):
            return
        with self._sync_lock:
            if self._lost(position) or (self._broken == "unsynced" and position > self._synced):
                raise OSError(errno.EIO, "an fsync of this WAL segment failed; the record is not durable")
            if self._synced >= position:   # another writer's fsync covered us
                return
            target = self._written         # the fd cannot change while we hold the sync lock
            if self._fd is None:           # rotate() synced and closed it: nothing left to do
                return
            try:
                self._fsync(self._fd)
            except OSError:
                self._broken = "unsynced"
                raise
            self._synced = max(self._synced, target)

    def append(self, payload: bytes) -> None:
        """Write one record and fsync it before returning."""
        self.sync(self.write(payload))

    def _lost(self, position: int) -> bool:
        return any(lo < position <= hi for lo, hi in self._failed)

    def _write_all(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]

    def _fsync(self, fd: int) -> None:
        start = time.perf_counter()
        os.fsync(fd)
        self.fsync_seconds += time.perf_counter() - start
        self.fsync_count += 1

    def _abandon(self) -> None:
        """Close the active segment after an I/O error. Hold both locks."""
        if self._broken != "unsynced":     # torn: the whole records before the tear can still be synced
            try:
                self._fsync(self._fd)
                self._synced = self._written
            except OSError:
                self._broken = "unsynced"
        if self._broken == "unsynced" and self._written > self._synced:
            self._failed = (self._failed + ((self._synced, self._written),))[-1024:]
        try:
            os.close(self._fd)
        except OSError:
            pass
        log.warning("WAL segment %s abandoned after an I/O error (%s); writing a new one",
                    self.segment_path(self._active_id).name, self._broken)
        self._abandoned.append(self._active_id)
        self._fd = self._active_id = self._broken = None
        self._segment_bytes = 0

    def _open_segment(self) -> None:
        segment_id = self._next_id
        self._next_id += 1
        path = self.segment_path(segment_id)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fsync_dir(self.directory)  # the new file's name must survive a crash too
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._fd, self._active_id, self._segment_bytes = fd, segment_id, 0

    def rotate(self) -> list[int]:
        """Close the active segment (fsynced); returns the ids closed by this call, and those of
        segments abandoned after an I/O error since the last call ([] if none)."""
        with self._write_lock, self._sync_lock:
            if self._fd is not None:
                if self._broken is None:
                    try:
                        self._fsync(self._fd)
                    except OSError:
                        self._broken = "unsynced"
                if self._broken is None:
                    self._synced = self._written
                    os.close(self._fd)
                    self._abandoned.append(self._active_id)
                    self._fd = self._active_id = None
                else:
                    self._abandon()
            closed, self._abandoned = self._abandoned, []
            return closed

    def delete(self, segment_ids: Iterable[int]) -> None:
        """Remove closed segments (their spans are in Parquet)."""
        removed = False
        for segment_id in segment_ids:
            if segment_id == self._active_id:
                raise ValueError(f"segment {segment_id} is active; rotate() it first")
            try:
                self.segment_path(segment_id).unlink()
            except FileNotFoundError:
                continue
            removed = True
        if removed:
            with self._write_lock:   # from the files: a torn tail that could not be cut is counted too
                self._bytes = sum(_size(self.segment_path(i)) for i in self.segment_ids())
            fsync_dir(self.directory)

    def close(self) -> None:
        """Close the active segment (fsynced). Idempotent."""
        self.rotate()
        with self._write_lock:
            self._closed = True

    # --- reading ------------------------------------------------------------------------------
    def replay(self, segment_ids: Iterable[int] | None = None) -> Iterator[bytes]:
        """Payloads of the given segments (default: every closed one), in order."""
        ids = self.closed_segment_ids() if segment_ids is None else list(segment_ids)
        for segment_id in ids:
            yield from read_segment(self.segment_path(segment_id))


def read_segment(path: str | os.PathLike) -> Iterator[bytes]:
    """The records of one segment, stopping cleanly at a torn or corrupt record."""
    path = Path(path)
    size = path.stat().st_size
    offset = 0
    with path.open("rb") as fh:
        while offset < size:
            header = fh.read(_HEADER.size)
            if len(header) < _HEADER.size:
                break
            length, crc = _HEADER.unpack(header)
            if offset + _HEADER.size + length > size:
                break
            payload = fh.read(length)
            if len(payload) < length or zlib.crc32(payload) != crc:
                break
            offset += _HEADER.size + length
            yield payload
    if offset < size:
        log.warning("WAL segment %s: ignoring %d bytes after offset %d (torn or corrupt record)",
                    path, size - offset, offset)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0

