"""The collector's writer: the WAL, the bounded queue, Parquet, replay, compaction, retention.

::

    export ─ {WAL write; enqueue} → fsync → ack      every flush_interval_s or flush_counts():
                                                     {rotate WAL; drain queue} ─ flatten ─ dedup ─
                                                     Parquet; delete the closed segments; compact;
                                                     expire old partitions

:meth:`Writer.enqueue` is the admission of an export (the queue is bounded by ``max_queue_bytes``:
bytes accepted, not yet in Parquet; past it, a retryable refusal); an export is acknowledged only
after its bytes are fsynced in the WAL (:meth:`lightspan.collector.wal.WAL.sync`, which concurrent
exports share). The store is deduplicated at write time (:mod:`lightspan.collector.dedup`): the
writer drops a span (or log record) it wrote within
``dedup_window_s``, a replayed row already in Parquet, and a repeat within one flush. After a crash
the WAL replays into Parquet (:meth:`Writer.open`) before the receivers serve.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import date, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa

from lightspan import store
from lightspan.collector import compact as compaction
from lightspan.collector import dedup, evaluation_writer, reward_integrity
from lightspan.collector.config import CollectorConfig, not_writable, writable
from lightspan.collector.metrics import Metrics
from lightspan.collector.otlp import flatten
from lightspan.collector.otlp_parse import DecodeError, parse_protobuf_request
from lightspan.collector.outcomes import CollectorError, Outcome
from lightspan.collector.signals import LOGS_TAG, SIGNALS
from lightspan.collector.wal import WAL
from lightspan.store.files import writer_tree
from lightspan.store.location import NOT_WRITABLE

log = logging.getLogger(__name__)

_NS_PER_DAY = 86_400 * 10**9
_EPOCH = date(1970, 1, 1)
_REPLAY_BATCH_BYTES = 64 << 20
_FLUSH_CHUNK_BYTES = 16 << 20   # queued bytes flattened and written per Parquet file (per date) at a time
COMPACT_GRACE_S = 30.0        # files a merged one replaces stay this long, for queries that listed them


class Writer:
    """The queue between the receivers and Parquet, and everything that writes the store."""

    def __init__(self, config: CollectorConfig, metrics: Metrics):
        self.config = config
        self.location = store.Location.of(config.data_dir)
        self.data_dir = self.location.root
        # where Parquet goes: TABLE/<tree>/date=…, the tree this collector owns (the whole table of
        # its data directory; its own collector=<id> in a bucket that several collectors share)
        self.tree = writer_tree(self.location, config.writer_id)
        wal_dir = Path(config.wal_path)
        self.wal_dir = wal_dir
        # local scratch beside the WAL: DuckDB's spill files, a merged file before its upload
        self.scratch = wal_dir.parent / f".{wal_dir.name}-scratch"
        self.last_flush_error = ""             # why the last flush failed ("" after one succeeded)
        self.metrics = metrics
        self._compact_lock = threading.Lock()
        self._lock = threading.Lock()          # the handoff: {WAL write; enqueue} vs {rotate; drain}
        self._flush_lock = threading.Lock()    # one flush at a time
        # (signal, request bytes (traces) or rows (logs), received_unix_nano, rejected, bytes)
        self._queue: list[tuple[str, bytes | pa.Table, int, int, int]] = []
        self.queue_bytes = 0                   # queued + drained but not yet in Parquet
        self._pending: tuple[list, list[int]] | None = None  # what a failed flush left behind
        self.accepting = False
        self.wal: WAL | None = None
        self.evaluations: evaluation_writer.Rewards | None = None   # made by open()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        # per partitioned table: the keys written recently (under _flush_lock)
        self._recent = {name: dedup.RecentKeys(config.dedup_max_keys, config.dedup_window_s)
                        for name in store.PARTITIONED}

    def _base(self, table: str) -> str:
        """The key of ``table``'s tree that this collector owns."""
        return f"{table}/{self.tree}" if self.tree else table

    def describe(self) -> str:
        return f"{self.location} (as {self.tree})" if self.tree else str(self.location)

    def open(self) -> None:
        """Open the WAL, remember the keys written lately, replay what a previous run left."""
        try:
            self.location.check()
        except OSError as exc:       # nothing accepted yet: the WAL stays as it is for the next start
            if exc.errno in NOT_WRITABLE:      # a data directory that is not writable: a ConfigError naming it
                raise not_writable(self.location, "data_dir", exc) from None
            raise CollectorError(f"cannot reach the store {self.describe()}: {exc}") from None
        writable(self.wal_dir, "wal_dir" if self.config.wal_dir else "data_dir")
        self.wal = WAL(self.wal_dir)
        self._seed_recent()
        # evaluation events become rewards as they are flushed (collector/evaluation_writer.py); those that
        # waited for their span when the last run ended wait again
        wait_s = min(self.config.evaluation_wait_s, self.config.dedup_window_s)
        self.evaluations = evaluation_writer.Rewards(self.data_dir, reward_integrity.load_key(self.data_dir),
                                               self.config.evaluation_label_values, wait_s, self.metrics)
        self.evaluations.recover(time.time_ns() - int(wait_s * 1e9))
        self._replay()

    def start(self) -> None:
        """Accept exports; flush, compact and expire on the configured interval from a thread."""
        self.accepting = True
        self._thread = threading.Thread(target=self._loop, name="lightspan-collector-writer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Refuse new exports, write everything accepted to Parquet, close the WAL."""
        with self._lock:
            self.accepting = False                 # a late export now gets a retryable refusal
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.flush_counts(final=True)
        except Exception:
            log.exception("final flush failed; the data stays in the WAL and replays at the next start")
        self.wal.close()
        try:
            self._sweep(0.0)
        except OSError:
            log.exception("could not remove compacted-away files; the next sweep removes them")

    def enqueue(self, signal: str, payload: bytes, data: bytes | pa.Table, received: int, rejected: int,
                size: int) -> tuple[Outcome, str] | None:
        """Admit one export: write ``payload`` to the WAL and queue ``data``; then fsync. Returns
        None once it is durable, else why not (a retryable refusal, nothing acknowledged)."""
        with self._lock:
            if not self.accepting:
                return Outcome.UNAVAILABLE, "the collector is stopping"
            if self.queue_bytes and self.queue_bytes + size > self.config.max_queue_bytes:
                why = f"; the last flush failed: {self.last_flush_error}" if self.last_flush_error else ""
                return (Outcome.QUEUE_FULL, f"queue full: {self.queue_bytes} bytes waiting for Parquet "
                                            f"(max_queue_bytes={self.config.max_queue_bytes}){why}")
            try:
                position = self.wal.write(payload)
            except OSError as exc:   # disk full or I/O error: nothing was acknowledged; retry later
                log.error("WAL write failed: %s", exc)
                return Outcome.DISK, f"WAL write failed: {exc.strerror or exc}"
            self._queue.append((signal, data, received, rejected, size))
            self.queue_bytes += size
        try:
            self.wal.sync(position)   # outside the lock: concurrent exports share an fsync
        except OSError as exc:
            # not acknowledged; the rows stay queued (the writer stores a retry's copy once)
            log.error("WAL fsync failed: %s", exc)
            return Outcome.DISK, f"WAL fsync failed: {exc.strerror or exc}"
        return None

    def flush_counts(self, final: bool = False) -> dict[str, int]:
        """Write everything accepted so far to Parquet (the WAL rotated, the queue drained); returns
        ``{"spans": n, "logs": m}`` rows written. ``final``: evaluations still waiting for their span
        are stored now (the collector stops)."""
        with self._flush_lock:
            written = {"spans": 0, "logs": 0}
            if self.wal is None:
                return written
            start = time.perf_counter()
            with self._lock:
                closed = self.wal.rotate()
                items, self._queue = self._queue, []
            if self._pending is not None:   # retry what a failed flush left behind, oldest first
                items, closed = self._pending[0] + items, self._pending[1] + closed
                self._pending = None
            if not items and not closed:
                if self.evaluations.pending or self.evaluations.ready:   # their span may be stored by now
                    written["spans"] += self._write("traces", self._with_evaluations([], [], final))
                return written
            # in chunks, each releasing its bytes from the queue once in Parquet: a writer that is
            # behind makes room for the receivers as it goes, not once per (long) flush
            done = 0
            try:
                while done < len(items):
                    end, size = done, 0
                    while end < len(items) and (end == done or size + items[end][-1] <= _FLUSH_CHUNK_BYTES):
                        size += items[end][-1]
                        end += 1
                    chunk = {signal_: [self._rows(data, received, rejected)
                                       for s, data, received, rejected, _ in items[done:end] if s == signal_]
                             for signal_ in SIGNALS}
                    chunk["traces"] = self._with_evaluations(chunk["traces"], chunk["logs"],
                                                             final and end == len(items))
                    for signal_, kind in SIGNALS.items():
                        written[kind["table"]] += self._write(signal_, chunk[signal_])
                    with self._lock:
                        self.queue_bytes -= size
                    done = end
            except Exception as exc:
                # the rest again at the next flush; rows of a chunk that failed half-way are not
                # written twice (the writer's recent keys); the segments stay until all are in
                # (an unreachable bucket: the queue fills, then exports get retryable refusals)
                self._pending = (items[done:], closed)
                self.last_flush_error = str(exc)[:300]
                self.metrics.add("flush_errors_total")
                raise
            self.last_flush_error = ""
            try:
                self.wal.delete(closed)
            except OSError:
                log.exception("could not delete WAL segments %s; they will replay (what is in Parquet is skipped)", closed)
            self.metrics.add("spans_written_total", written["spans"])
            self.metrics.add("log_records_written_total", written["logs"])
            seconds = time.perf_counter() - start
            self.metrics.observe_flush(seconds)
            log.info("flushed %d spans and %d log records to Parquet", written["spans"], written["logs"],
                     extra={"spans": written["spans"], "log_records": written["logs"], "wal_segments": len(closed),
                            "seconds": round(seconds, 4)})
            return written

    def _rows(self, data: bytes | pa.Table, received: int, rejected: int) -> pa.Table:
        """The rows of a queued export: a trace request's bytes are flattened here (the receivers
        checked them with :func:`otlp.check`, so every span they counted as accepted converts)."""
        if isinstance(data, pa.Table):
            return data
        table, flattened_rejected, first_error = flatten(parse_protobuf_request(data), received)
        if flattened_rejected != rejected:   # check() and flatten() disagree: a bug, and loud
            log.error("an acknowledged request flattened with %d spans rejected, %d when checked; first: %s",
                      flattened_rejected, rejected, first_error)
        return table

    def _with_evaluations(self, span_tables: list[pa.Table], log_tables: list[pa.Table], final: bool) -> list[pa.Table]:
        """``span_tables`` and the reward rows of the evaluation events among these rows and of those
        that waited for their span (collector/evaluations.py)."""
        rewards = self.evaluations.rows(span_tables, log_tables, final=final)
        return span_tables if rewards is None else [*span_tables, rewards]

    def _write(self, signal: str, tables: list[pa.Table]) -> int:
        """One Parquet file per UTC date, sorted by rollout and time, without the rows whose key
        was written recently or repeats in ``tables`` (the first received wins)."""
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return 0
        kind = SIGNALS[signal]
        name = kind["table"]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        recent = self._recent[name]
        keys = dedup.row_keys(name, table)
        keep = recent.new_rows(keys)
        if keep is not None:
            self.metrics.add(f"{kind['metric']}_deduplicated_total", keep.count(False))
            table = table.filter(pa.array(keep, pa.bool_()))
            keys = [key for key, kept in zip(keys, keep) if kept]
            if not table.num_rows:
                return 0
        days = table.column(kind["time"]).to_numpy() // _NS_PER_DAY
        unique_days = np.unique(days)
        for day in unique_days:
            if len(unique_days) == 1:
                part, part_keys = table, keys
            else:
                rows = days == day
                part = table.filter(pa.array(rows))
                part_keys = [key for key, chosen in zip(keys, rows.tolist()) if chosen]
            part = part.sort_by(kind["sort"])
            partition = f"date={(_EPOCH + timedelta(days=int(day))).isoformat()}"
            store.write_table(self.location, name, part, partition=f"{self.tree}/{partition}" if self.tree else partition)
            recent.add(part_keys)          # committed: a retried flush leaves this part out
        return table.num_rows

    def _seed_recent(self) -> None:
        """Remember the keys written within the dedup window before this start (an exporter may
        retry across a restart)."""
        now = time.time()
        for name, recent in self._recent.items():
            files = dedup.recent_files(self.location, self._base(name), now - self.config.dedup_window_s)
            keys = dedup.load_keys(name, self.location, files, received_since_ns=int((now - self.config.dedup_window_s) * 1e9),
                                   limit=max(self.config.dedup_max_keys // 2, 1))
            recent.add(keys)
            if keys:
                log.info("remembered %d %s keys written in the last %g s", len(keys), name,
                         self.config.dedup_window_s, extra={"table": name, "keys": len(keys), "files": len(files)})

    def _replay(self) -> None:
        """Segments left by a previous run → Parquet, before anything new is accepted."""
        segments = self.wal.closed_segment_ids()
        if not segments:
            return
        start, skipped = time.perf_counter(), 0
        # the Parquet that these segments may have produced before the crash: written after the
        # oldest segment's last write
        since = dedup.replay_since([self.wal.segment_path(i) for i in segments])
        stored = {kind["table"]: dedup.recent_files(self.location, self._base(kind["table"]), since)
                  for kind in SIGNALS.values()}
        tables = {signal_: [] for signal_ in SIGNALS}
        batch_bytes, counts = 0, dict.fromkeys(SIGNALS, 0)
        for payload in self.wal.replay(segments):
            signal_ = "logs" if payload.startswith(LOGS_TAG) else "traces"
            kind = SIGNALS[signal_]
            try:
                request = kind["protobuf"](payload[len(LOGS_TAG):] if signal_ == "logs" else payload)
            except DecodeError as exc:   # a CRC-valid record that is not a request: keep going
                log.warning("WAL replay: skipping an undecodable record: %s", exc)
                skipped += 1
                continue
            table, _, _ = kind["flatten"](request, time.time_ns())
            tables[signal_].append(table)
            batch_bytes += table.nbytes
            if batch_bytes >= _REPLAY_BATCH_BYTES:
                tables["traces"] = self._with_evaluations(tables["traces"], tables["logs"], False)
                for name in SIGNALS:
                    counts[name] += self._write_replayed(name, tables[name], stored)
                    tables[name] = []
                batch_bytes = 0
        tables["traces"] = self._with_evaluations(tables["traces"], tables["logs"], False)
        for name in SIGNALS:
            counts[name] += self._write_replayed(name, tables[name], stored)
        self.wal.delete(segments)
        self.metrics.add("spans_replayed_total", counts["traces"])
        self.metrics.add("spans_written_total", counts["traces"])
        self.metrics.add("log_records_written_total", counts["logs"])
        log.info("replayed %d spans and %d log records from %d WAL segments into Parquet",
                 counts["traces"], counts["logs"], len(segments),
                 extra={"spans": counts["traces"], "log_records": counts["logs"], "wal_segments": len(segments),
                        "skipped_records": skipped, "seconds": round(time.perf_counter() - start, 4)})

    def _write_replayed(self, signal: str, tables: list[pa.Table], stored: dict[str, list[str]]) -> int:
        """:meth:`_write` for replayed rows, less those already in the files in ``stored``."""
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return 0
        name = SIGNALS[signal]["table"]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        fresh = dedup.drop_stored(name, table, self.location, stored[name])
        if fresh.num_rows < table.num_rows:
            self.metrics.add(f"{SIGNALS[signal]['metric']}_deduplicated_total", table.num_rows - fresh.num_rows)
        return self._write(signal, [fresh])

    def _loop(self) -> None:
        interval = min(self.config.flush_interval_s, threading.TIMEOUT_MAX)
        while not self._stop_event.wait(interval):
            try:
                self.flush_counts()
            except Exception:
                log.exception("flush to Parquet failed; retrying at the next interval")
                continue
            try:
                if self.config.compact_min_files:
                    self.compact(min_files=self.config.compact_min_files + 1)
                self._sweep()
                self.expire()
            except Exception:
                self.metrics.add("maintenance_errors_total")
                log.exception("compaction or retention failed; retrying at the next interval")

    # --- compaction and retention ---
    def compact(self, min_files: int = 2, grace_s: float = COMPACT_GRACE_S) -> int:
        """Merge the small Parquet files of every date partition (spans and logs) that has at
        least ``min_files`` of them into one file; returns the number of files merged away.

        Readers switch to the merged file at once; the files it replaces are removed ``grace_s``
        seconds later (by the writer, or at stop), so queries that listed them still read them."""
        merged = 0
        with self._compact_lock:
            for table in store.PARTITIONED:
                for partition, files in compaction.small_files(self.location, self._base(table)).items():
                    if len(files) < max(min_files, 2):
                        continue
                    compaction.compact_partition(self.location, table, partition, files, self.scratch)
                    merged += len(files)
                    self.metrics.add("compactions_total")
                    self.metrics.add("files_compacted_total", len(files))
                    where = str(partition).rsplit("/", 1)[-1]
                    log.info("compacted %d files of %s/%s", len(files), table, where,
                             extra={"table": table, "partition": where, "files": len(files)})
        self._sweep(grace_s)
        return merged

    def _sweep(self, grace_s: float = COMPACT_GRACE_S) -> None:
        """Remove the files merged files replaced ``grace_s`` seconds ago or more."""
        with self._compact_lock:
            for table in store.PARTITIONED:
                compaction.sweep(self.location, self._base(table), grace_s)

    def expire(self) -> list[str]:
        """Delete date partitions older than ``retention_days`` (0 keeps all); returns their paths."""
        removed = []
        with self._compact_lock:
            for table in store.PARTITIONED:
                names = compaction.expire_partitions(self.location, self._base(table), self.config.retention_days)
                removed += [f"{table}/{name}" for name in names]
        if removed:
            self.metrics.add("partitions_expired_total", len(removed))
            log.info("retention (%d days) removed %s", self.config.retention_days, ", ".join(removed),
                     extra={"retention_days": self.config.retention_days, "partitions": removed})
        return removed
