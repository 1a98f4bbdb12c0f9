"""The collector's writer side of evaluation events as rewards (collector/evaluations.py has the
rules): the evaluations found in each flushed chunk become reward rows; those whose span has not
arrived wait, bounded, and are looked for again at each flush and after a restart."""

from __future__ import annotations

import logging
import time

import pyarrow as pa
import pyarrow.compute as pc

from lightspan import store
from lightspan.collector.evaluations import (EVENT, MAX_PENDING, Evaluation, candidates, from_logs, from_spans,
                                             resolve, reward_request, stored_candidates)

log = logging.getLogger(__name__)


class Rewards:
    """The writer's side: evaluations found in each flushed chunk become reward rows; those whose
    span has not arrived wait (bounded, up to ``wait_s``), and are looked for again at each flush."""

    def __init__(self, data_dir, secret: bytes, label_values: dict[str, float] | None, wait_s: float, metrics):
        self.data_dir = data_dir
        self.secret = secret
        self.label_values = label_values
        self.wait_s = wait_s
        self.metrics = metrics
        self.pending: list[Evaluation] = []     # waiting for their span
        self.ready: list[Evaluation] = []       # matched, not yet written (read back at a restart)

    def rows(self, span_tables: list[pa.Table], log_tables: list[pa.Table], *, final: bool = False) -> pa.Table | None:
        """The reward rows (``SPAN_SCHEMA``) of the evaluations in these tables and of those
        waiting; ``final``: store the waiting ones now, matched or not (the collector stops)."""
        found = []
        for table in log_tables:
            evaluations, invalid = from_logs(table)
            found += evaluations
            self.metrics.add("evaluations_invalid_total", invalid)
        for table in span_tables:
            evaluations, invalid = from_spans(table)
            found += evaluations
            self.metrics.add("evaluations_invalid_total", invalid)
        if not found and not self.pending and not self.ready:
            return None
        self.metrics.add("evaluations_received_total", len(found))
        evaluations, self.pending = self.pending + found, []
        ready, unknown = self._match(evaluations, span_tables)
        ready, self.ready = self.ready + ready, []
        now = time.time_ns()
        for ev in unknown:
            if final or now - ev.received_ns >= self.wait_s * 1e9:
                self.metrics.add("evaluations_unmatched_total")
                ready.append(ev)
            else:
                self.pending.append(ev)
        if len(self.pending) > MAX_PENDING:       # bounded: the oldest are stored unmatched
            spill, self.pending = self.pending[:-MAX_PENDING], self.pending[-MAX_PENDING:]
            self.metrics.add("evaluations_unmatched_total", len(spill))
            ready += spill
        if not ready:
            return None
        return self.table(ready)

    def _match(self, evaluations: list[Evaluation], span_tables: list[pa.Table]):
        """(evaluations whose span is known, those still unknown): the spans flushed beside them
        first, then the store, asked once for all. An event with neither span context nor response
        id has nothing to wait for."""
        ready = [ev for ev in evaluations if ev.resolved or not (ev.trace_id or ev.response_id)]
        todo = [ev for ev in evaluations if not ev.resolved and (ev.trace_id or ev.response_id)]
        for where in ("chunk", "store"):
            if not todo:
                break
            traces = {ev.trace_id for ev in todo if ev.trace_id}
            responses = {ev.response_id for ev in todo if ev.response_id}
            if where == "chunk":
                rows = [row for table in span_tables for row in candidates(table, traces, responses)]
            else:
                try:
                    rows = stored_candidates(self.data_dir, traces, responses)
                except Exception:        # a store that cannot be read now: wait, as for a late span
                    log.exception("could not look up evaluated spans in the store; retrying at the next flush")
                    break
            todo = resolve(todo, rows)
            ready += [ev for ev in todo if ev.resolved]
            todo = [ev for ev in todo if not ev.resolved]
        return ready, todo

    def table(self, evaluations: list[Evaluation]) -> pa.Table:
        from lightspan.collector.otlp import flatten     # the one row builder of SPAN_SCHEMA

        table, rejected, first = flatten(reward_request(evaluations, self.secret, self.label_values), 0)
        if rejected:      # the collector's own spans: never malformed
            log.error("%d evaluation reward(s) did not flatten: %s", rejected, first)
        received = table.schema.get_field_index("received_unix_nano")
        table = table.set_column(received, "received_unix_nano",
                                 pa.array([ev.received_ns for ev in evaluations], pa.int64()))
        stored = pc.sum(pc.is_valid(table.column("reward"))).as_py() or 0
        self.metrics.add("evaluations_stored_total", len(evaluations))
        self.metrics.add("evaluations_unvalued_total", len(evaluations) - stored)
        return table

    def recover(self, since_ns: int) -> None:
        """After a restart: the evaluation events received since ``since_ns`` wait again (those
        stored already are deduplicated: the same ids)."""
        def query():
            con = store.connect(self.data_dir)
            try:
                return con.sql("SELECT * FROM logs WHERE event_name = $e AND received_unix_nano >= $t",
                               params={"e": EVENT, "t": since_ns}).to_arrow_table()
            finally:
                con.close()

        try:
            table = store.retry_vanished(query)
        except Exception:
            log.exception("could not read back recent evaluation events; those still waiting for their span "
                          "are not rewards until sent again")
            return
        evaluations, _ = from_logs(table.select([f.name for f in store.LOG_SCHEMA]).cast(store.LOG_SCHEMA))
        ready, unknown = self._match(evaluations, [])
        self.ready += ready           # written at the next flush, or dropped there as stored already
        self.pending += unknown
