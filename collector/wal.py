"""The collector's write-ahead log: an export is acknowledged only once its bytes are here
and fsynced (DESIGN.md §3.3).

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
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

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
        self._bytes = sum(self._path(i).stat().st_size for i in existing)
        self._closed = False
        self.fsync_seconds = 0.0             # total time spent in fsync, and how often
        self.fsync_count = 0

    # --- paths --------------------------------------------------------------------------------
    def _path(self, segment_id: int) -> Path:
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
            if self._fd is None:
                self._open_segment()
            view = memoryview(record)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            self._written += len(record)
            self._bytes += len(record)
            return self._written

    def sync(self, position: int) -> None:
        """Return once every byte up to ``position`` is on stable storage."""
        if self._synced >= position:
            return
        with self._sync_lock:
            if self._synced >= position:   # another writer's fsync covered us
                return
            target = self._written         # the fd cannot change while we hold the sync lock
            if self._fd is None:           # rotate() synced and closed it: nothing left to do
                return
            self._fsync(self._fd)
            self._synced = max(self._synced, target)

    def append(self, payload: bytes) -> None:
        """Write one record and fsync it before returning."""
        self.sync(self.write(payload))

    def _fsync(self, fd: int) -> None:
        start = time.perf_counter()
        os.fsync(fd)
        self.fsync_seconds += time.perf_counter() - start
        self.fsync_count += 1

    def _open_segment(self) -> None:
        self._active_id = self._next_id
        self._next_id += 1
        self._fd = os.open(self._path(self._active_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        _fsync_dir(self.directory)  # the new file's name must survive a crash too

    def rotate(self) -> list[int]:
        """Close the active segment (fsynced); returns the ids closed by this call ([] if none)."""
        with self._write_lock:
            if self._fd is None:
                return []
            with self._sync_lock:
                self._fsync(self._fd)
                self._synced = self._written
                os.close(self._fd)
                closed = [self._active_id]
                self._fd = self._active_id = None
            return closed

    def delete(self, segment_ids: Iterable[int]) -> None:
        """Remove closed segments (their spans are in Parquet)."""
        removed = False
        for segment_id in segment_ids:
            if segment_id == self._active_id:
                raise ValueError(f"segment {segment_id} is active; rotate() it first")
            path = self._path(segment_id)
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            with self._write_lock:
                self._bytes -= size
            removed = True
        if removed:
            _fsync_dir(self.directory)

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
            yield from read_segment(self._path(segment_id))


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


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
