"""The SQL endpoint's worker processes: each ``/v1/sql`` query runs in one, capped in memory.

DuckDB's ``memory_limit`` covers its buffers, not the vectors a query builds (2,048 rows at a
time): ``SELECT repeat('x', 10000000) FROM range(10000)`` grew a collector by gigabytes under a
2 s time limit. So queries do not run in the collector's process: a worker process (spawned, at
most ``sql_max_concurrent``, reused) runs :func:`lightspan.collector.api.run_sql` with its address
space capped at what it held after start-up plus ``sql_memory_limit_bytes`` (and headroom for
thread stacks): an allocation past it fails, DuckDB reports "Out of Memory", and the query is
answered 400 while the collector's memory stays where it was. A worker that dies or outlives its
query's time limit is killed and replaced. At most ``sql_max_result_bytes`` come back.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import resource
import threading

from lightspan.collector import api
from lightspan.collector.config import CollectorConfig
from lightspan.core.config import redact

log = logging.getLogger(__name__)

_HEADROOM = 512 << 20     # address space for thread stacks and allocator arenas, beyond the limit
_GRACE_S = 5.0            # a worker silent this long past the query's time limit is killed


def _vm_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _serve(conn, memory_limit: int) -> None:
    """A worker: cap the address space once warm, then answer queries until the pipe closes."""
    import duckdb

    duckdb.connect().execute("SELECT 1").fetchall()     # DuckDB's own start-up, before the cap
    cap = _vm_size() + memory_limit + _HEADROOM
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", api.run_sql(*job[:2], **job[2]))
        except api.BadRequest as exc:
            reply = ("bad", str(exc))
        except OSError as exc:           # a bucket that does not answer (the views list its objects)
            reply = ("unreachable", redact(f"the store cannot be reached: {exc}; retry once it answers"))
        except MemoryError:
            reply = ("bad", f"the query needs more than sql_memory_limit_bytes={memory_limit}")
        try:
            conn.send(reply)
        except MemoryError:
            conn.send(("bad", f"the answer needs more than sql_memory_limit_bytes={memory_limit}"))


class Unreachable(Exception):
    """The store (a bucket, its endpoint) did not answer: the query may succeed later (503)."""


class _Worker:
    def __init__(self, context, memory_limit: int):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, memory_limit), daemon=True,
                                       name="lightspan-collector-sql")
        self.process.start()
        child.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class QueryPool:
    """Up to ``sql_max_concurrent`` workers, started on first use. :meth:`run` blocks its thread."""

    def __init__(self, config: CollectorConfig):
        self.config = config
        self._context = multiprocessing.get_context("spawn")   # never fork a process that runs gRPC
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._count = 0
        self._lock = threading.Lock()
        self._closed = False

    def _take(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._count < self.config.sql_max_concurrent:
                self._count += 1
                return _Worker(self._context, self.config.sql_memory_limit_bytes)
        return self._idle.get()

    def _lose(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._count -= 1

    def run(self, sql) -> dict:
        """``api.run_sql`` in a worker; raises :class:`Unreachable` when the store did not answer and
        :class:`api.BadRequest` for anything else that went wrong."""
        if self._closed:
            raise api.BadRequest("the collector is stopping")
        cfg = self.config
        worker = self._take()
        job = (str(self.config.data_dir), sql, {"timeout_s": cfg.sql_timeout_s, "max_rows": cfg.sql_max_rows,
                                                "max_bytes": cfg.sql_max_result_bytes,
                                                "memory_limit": cfg.sql_memory_limit_bytes})
        try:
            worker.conn.send(job)
            # the first query of a worker also waits for its start-up (imports: about a second)
            if not worker.conn.poll(cfg.sql_timeout_s + _GRACE_S + 10):
                self._lose(worker)
                raise api.BadRequest(f"the query ran past sql_timeout_s={cfg.sql_timeout_s:g} s and its worker "
                                     "was stopped")
            kind, value = worker.conn.recv()
        except (EOFError, OSError):
            self._lose(worker)
            log.warning("an SQL worker died (memory past sql_memory_limit_bytes=%d?); starting another",
                        cfg.sql_memory_limit_bytes)
            raise api.BadRequest(f"the query's worker died: it needed more than sql_memory_limit_bytes="
                                 f"{cfg.sql_memory_limit_bytes}") from None
        self._idle.put(worker)
        if kind == "bad":
            raise api.BadRequest(value)
        if kind == "unreachable":
            raise Unreachable(value)
        return value

    def close(self) -> None:
        """Stop every idle worker (a worker busy with a query stops when its pipe closes)."""
        self._closed = True
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            self._lose(worker)
