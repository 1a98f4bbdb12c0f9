"""Evaluation events on the collector's request path (collector/evaluations.py has the rules): the
one-value-per-key check of a logs request before the WAL, and lightspan's own rewards sent out as
``gen_ai.evaluation.result`` log records."""

from __future__ import annotations

import collections
import threading
import time

import pyarrow as pa
import pyarrow.compute as pc
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from lightspan import store
from lightspan.collector import otlp_logs
from lightspan.collector.evaluations import EVENT, add_attribute, from_logs, ids, value_of
from lightspan.store.schema import REWARD_SCOPE
from lightspan.tracing import semconv as sc


# --- the request path: one value per key ------------------------------------------------------------

_MISSING = object()


class Book:
    """The conflict rule (module docstring, 4) on the request path: an evaluation whose key holds
    another value (accepted by this process, or in the store) is taken out of its logs request
    before the WAL. Callers hold :attr:`lock` from :meth:`conflicts` to :meth:`remember`."""

    def __init__(self, data_dir, label_values: dict[str, float] | None, max_keys: int):
        self.data_dir = data_dir
        self.label_values = label_values
        self.max_keys = max_keys
        self._accepted: collections.OrderedDict[tuple[str, str], float | None] = collections.OrderedDict()
        self.lock = threading.Lock()

    def conflicts(self, table: pa.Table, secret: bytes) -> tuple[set[str], dict, str | None]:
        """(the record ids to take out, {reward ids: value} of the others, a message naming the first)."""
        from lightspan.collector.api import stored_rewards

        evaluations, _ = from_logs(table)
        if not evaluations:
            return set(), {}, None
        keyed = [(tuple(x.hex() for x in ids(secret, ev)), value_of(ev, self.label_values), ev) for ev in evaluations]
        known = {k: self._accepted[k] for k, _, _ in keyed if k in self._accepted}
        missing = sorted({k for k, _, _ in keyed if k not in known})
        if missing:
            known.update(stored_rewards(self.data_dir, missing))
        out, accepted, first = set(), {}, None
        for key, value, ev in keyed:
            stored = known.get(key, accepted.get(key, _MISSING))
            if stored is not _MISSING and stored != value:
                out.add(ev.record_id)
                first = first or (f"evaluation {ev.name!r} by {ev.emitter or 'an unnamed service'!r} of "
                                  f"{'/'.join(p for p in ev.key.split(chr(0)) if p)!r} is stored as {stored!r}, not "
                                  f"{value!r}: a stored reward is never changed")
            else:
                accepted.setdefault(key, value)
        return out, accepted, first

    def remember(self, accepted: dict) -> None:
        self._accepted.update(accepted)
        while len(self._accepted) > self.max_keys:
            self._accepted.popitem(last=False)


def drop_records(request: ExportLogsServiceRequest, table: pa.Table, record_ids: set[str]) -> tuple[pa.Table, int]:
    """Take the records whose id is in ``record_ids`` out of ``request`` (in place) and ``table``."""
    dropped = 0
    for resource_logs in request.resource_logs:
        digest = otlp_logs.resource_digest(resource_logs)
        for scope_logs in resource_logs.scope_logs:
            keep = [r for r in scope_logs.log_records
                    if otlp_logs.record_id(digest, scope_logs.scope.name, r) not in record_ids]
            dropped += len(scope_logs.log_records) - len(keep)
            del scope_logs.log_records[:]
            scope_logs.log_records.extend(keep)
    keep = pc.invert(pc.is_in(table.column("record_id"), pa.array(sorted(record_ids), pa.string())))
    return table.filter(keep), dropped


# --- out: lightspan's rewards as evaluation events ----------------------------------------------------

def rewards_of(request: ExportTraceServiceRequest, data_dir) -> list[dict]:
    """The rewards of the API's reward spans in ``request`` as :func:`event_records` takes them, each
    with the trace id of the call it scores when the store holds that call."""
    out = []
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                attrs = {kv.key: otlp_logs._py(kv.value) for kv in span.attributes}
                out.append({"name": attrs.get(sc.REWARD_NAME), "value": attrs.get(sc.REWARD),
                            "comment": attrs.get(sc.REWARD_COMMENT), "source": attrs.get(sc.REWARD_SOURCE),
                            "rollout_id": attrs.get(sc.ROLLOUT_ID), "time_unix_nano": span.end_time_unix_nano,
                            "span_id": attrs.get(sc.REWARD_CALL_SPAN_ID)})
    calls = sorted({r["span_id"] for r in out if r["span_id"]})
    if calls:
        def query():
            con = store.connect(data_dir)
            try:
                return dict(con.execute("SELECT span_id, any_value(trace_id) FROM spans WHERE span_id IN "
                                        "(SELECT unnest($s::VARCHAR[])) GROUP BY 1", {"s": calls}).fetchall())
            finally:
                con.close()

        traces = store.retry_vanished(query)
        for reward in out:
            reward["trace_id"] = traces.get(reward["span_id"])
    return out


def event_records(rewards: list[dict], service_name: str = "lightspan-collector") -> ExportLogsServiceRequest:
    """``gen_ai.evaluation.result`` log records of lightspan's own rewards (a judge's, a person's), so
    other tools show them: ``rewards`` are dicts with ``name``, ``value``, ``comment``, ``source``,
    ``rollout_id``, ``time_unix_nano`` and, to parent the event to the scored call, ``trace_id`` and
    ``span_id`` (hex)."""
    request = ExportLogsServiceRequest()
    resource_logs = request.resource_logs.add()
    resource_logs.resource.attributes.add(key=sc.SERVICE_NAME, value=AnyValue(string_value=service_name))
    scope_logs = resource_logs.scope_logs.add()
    scope_logs.scope.name = REWARD_SCOPE
    for reward in rewards:
        record = scope_logs.log_records.add(event_name=EVENT, time_unix_nano=int(reward.get("time_unix_nano") or 0),
                                            observed_time_unix_nano=time.time_ns(), severity_number=9)
        if reward.get("trace_id") and reward.get("span_id"):
            record.trace_id = bytes.fromhex(reward["trace_id"])
            record.span_id = bytes.fromhex(reward["span_id"])
        for key, value in ((sc.GEN_AI_EVALUATION_NAME, reward.get("name") or "reward"),
                           (sc.GEN_AI_EVALUATION_SCORE_VALUE, reward.get("value")),
                           (sc.GEN_AI_EVALUATION_EXPLANATION, reward.get("comment")),
                           (sc.REWARD_SOURCE, reward.get("source")), (sc.ROLLOUT_ID, reward.get("rollout_id"))):
            add_attribute(record, key, float(value) if isinstance(value, (int, float)) and not isinstance(value, bool)
                 else value)
    return request
