"""OTel GenAI evaluation events as rewards (docs/architecture.md, "Data flow").

An evaluator that emits ``gen_ai.evaluation.result`` (Phoenix's or Langfuse's online evaluations,
OTel's GenAI evaluation utilities, a script on the OTel SDK's log API) feeds training with no glue.
The collector turns each such event into a reward span of the evaluated call's rollout:

1. **What counts as an evaluation.** An OTLP log record whose event name is
   ``gen_ai.evaluation.result`` (``LogRecord.event_name``, or the older ``event.name`` attribute), in
   the evaluated span's trace and span, or naming the evaluated completion by ``gen_ai.response.id``;
   or a span event of that name on the evaluated span. ``gen_ai.evaluation.name`` is required; the
   value, label and explanation are kept. One with ``error.type`` (the evaluation failed) makes no
   reward.
2. **Its rollout and call** are the evaluated span's: read from the span itself (a span event),
   from the spans flushed beside it, else from the store. An evaluation that arrives before its span
   waits for it up to ``evaluation_wait_s``, then is stored keyed by the evaluated trace (counted in
   ``evaluations_unmatched_total``). An evaluated LLM call is the reward's call (``call_span_id``);
   an evaluated agent or root span scores the whole rollout.
3. **Its source is the collector's to say**, never the sender's: the ``service.name`` of the
   process that emitted it, and ``agent`` when that process is the agent's own: a span event (the
   agent sent the span), a record whose resource or attributes carry the rollout's ids (the runner
   gives every agent process those), or one emitted by the evaluated span's own service. A service
   named like one of lightspan's own sources (``judge``, ``human``, ``api``, ``agent``) is
   ``evaluator:<name>``: an evaluation event is never a person's score nor the API's.
4. **One value per key.** The key is (emitting service, evaluation name, evaluated span or
   response); its reward span's ids are a keyed hash of it (:func:`~lightspan.collector.
   reward_integrity.reward_ids`), so a copy re-sent is stored once, and a record with another value
   for a stored key is rejected (OTLP ``partial_success``, counted in
   ``evaluations_conflicting_total``), as ``POST /v1/rewards`` answers 409.
5. **A label without a value** is stored (the ``evaluations`` view) and not trained on, unless the
   collector's ``evaluation_label_values`` maps it (``{"pass": 1.0, "Relevance/irrelevant": 0.0}``:
   ``NAME/LABEL`` for one evaluation's label, ``LABEL`` for any).

The reward spans are the collector's own (scope :data:`~lightspan.store.schema.REWARD_SCOPE`, which
no OTLP sender may use), so every reader (views, builder, UI) sees them as any late reward. They are
derived by the writer from what the WAL holds, so a replay derives them again, with the same ids.
The writer's side is collector/evaluation_writer.py; the conflict check on the request path, and
lightspan's own rewards sent out as these events, collector/evaluation_requests.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.compute as pc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from lightspan import store
from lightspan.collector.reward_integrity import reward_ids
from lightspan.store.schema import REWARD_SCOPE
from lightspan.tracing import semconv as sc


EVENT = sc.GEN_AI_EVALUATION_RESULT
RESERVED_SOURCES = ("agent", "judge", "human", "api")
"""Sources only lightspan gives (collector/api.py): an evaluator's service of such a name is prefixed."""
MAX_TEXT = 4096                   # an explanation is kept up to this many characters, as a comment
MAX_PENDING = 100_000             # evaluations waiting for their span; past it the oldest are stored unmatched


@dataclass(frozen=True)
class Evaluation:
    """One evaluation event, as the collector read it; the fields after ``received_ns`` are what
    :func:`resolve` learns of the evaluated span."""

    name: str
    value: float | None
    label: str | None
    explanation: str | None
    emitter: str                      # the emitting process's service.name ("" when it has none)
    own: bool                         # emitted by the agent's own process (see the module docstring)
    trace_id: str | None              # the evaluated span (hex) as the event names it, when in its context
    span_id: str | None
    response_id: str | None           # the evaluated completion's id, as the event names it
    time_ns: int
    received_ns: int
    rollout_id: str | None = None
    task_id: str | None = None
    split: str | None = None
    service: str | None = None        # the evaluated span's service.name
    is_call: bool | None = None       # the evaluated span is an LLM call (None: not found)
    found: tuple[str, str] | None = None   # the evaluated span's (trace_id, span_id), found by its response id
    record_id: str | None = None      # the log record's id (logs.record_id), for a log record

    @property
    def key(self) -> str:
        """What the reward's ids hash: the evaluated span or completion, as the event names them
        (whatever is found of it later, so a copy derived again has the same ids)."""
        return f"{self.trace_id or ''}\x00{self.span_id or ''}\x00{self.response_id or ''}"

    @property
    def evaluated(self) -> tuple[str | None, str | None]:
        """The evaluated span's (trace_id, span_id): as named, else as found by its response id."""
        return self.found or (self.trace_id, self.span_id)

    @property
    def resolved(self) -> bool:
        return self.rollout_id is not None or self.is_call is not None


def _text(value) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _parse(attrs: dict, **fields) -> Evaluation | None:
    """An :class:`Evaluation` of an event's decoded attributes; None when it is not one (no name,
    or the evaluation failed)."""
    name = _text(attrs.get(sc.GEN_AI_EVALUATION_NAME))
    if name is None or attrs.get(sc.ERROR_TYPE) is not None:
        return None
    explanation = _text(attrs.get(sc.GEN_AI_EVALUATION_EXPLANATION))
    return Evaluation(name=name[:256], value=_number(attrs.get(sc.GEN_AI_EVALUATION_SCORE_VALUE)),
                      label=_text(attrs.get(sc.GEN_AI_EVALUATION_SCORE_LABEL)),
                      explanation=explanation[:MAX_TEXT] if explanation else None,
                      response_id=_text(attrs.get(sc.GEN_AI_RESPONSE_ID)), **fields)


def _decoded(pairs) -> dict:
    out = {}
    for key, raw in pairs or ():
        try:
            out[key] = json.loads(raw)
        except (TypeError, ValueError):
            out[key] = None
    return out


def has_events(table: pa.Table) -> bool:
    """Whether a flattened logs table holds an evaluation event."""
    return bool(table.num_rows) and bool(pc.any(pc.fill_null(pc.equal(table.column("event_name"), EVENT), False)).as_py())


def from_logs(table: pa.Table) -> tuple[list[Evaluation], int]:
    """The evaluations among the rows of a flattened logs table (``LOG_SCHEMA``), and how many
    evaluation events were not evaluations (no ``gen_ai.evaluation.name``, or ``error.type``)."""
    if not has_events(table):
        return [], 0
    found, invalid = [], 0
    for row in table.filter(pc.fill_null(pc.equal(table.column("event_name"), EVENT), False)).to_pylist():
        evaluation = _parse(_decoded(row["attributes"]), emitter=row["service_name"] or "",
                            own=row["rollout_id"] is not None or row["task_id"] is not None,
                            trace_id=row["trace_id"], span_id=row["span_id"], time_ns=row["time_unix_nano"],
                            received_ns=row["received_unix_nano"], rollout_id=row["rollout_id"],
                            task_id=row["task_id"], split=row["split"], record_id=row["record_id"])
        if evaluation is None:
            invalid += 1
        else:
            found.append(evaluation)
    return found, invalid


def from_spans(table: pa.Table) -> tuple[list[Evaluation], int]:
    """The evaluations among the span events of a flattened spans table: each scores its own span,
    and is the agent's (it came in the span its process sent)."""
    if not table.num_rows:
        return [], 0
    names = pc.struct_field(pc.list_flatten(table.column("events")), "name")
    if not pc.any(pc.fill_null(pc.equal(names, EVENT), False)).as_py():
        return [], 0
    found, invalid = [], 0
    columns = ["trace_id", "span_id", "events", "service_name", "rollout_id", "task_id", "split", "operation_name",
               "received_unix_nano"]
    calls = pc.or_(pc.is_valid(table.column("prompt_token_ids")),
                   pc.is_in(table.column("operation_name"), pa.array(sorted(sc.LLM_OPERATIONS))))
    for row, is_call in zip(table.select(columns).to_pylist(), calls.to_pylist()):
        for event in row["events"] or ():
            if event["name"] != EVENT:
                continue
            try:
                attrs = json.loads(event["attributes"] or "{}")
            except ValueError:
                attrs = {}
            evaluation = _parse(attrs, emitter=row["service_name"] or "", own=True, trace_id=row["trace_id"],
                                span_id=row["span_id"], time_ns=event["time_unix_nano"],
                                received_ns=row["received_unix_nano"], rollout_id=row["rollout_id"],
                                task_id=row["task_id"], split=row["split"], service=row["service_name"],
                                is_call=bool(is_call))
            if evaluation is None:
                invalid += 1
            else:
                found.append(evaluation)
    return found, invalid


# --- the evaluated span ------------------------------------------------------------------------

_SPAN_COLUMNS = ["trace_id", "span_id", "rollout_id", "task_id", "split", "service_name", "operation_name"]


def candidates(table: pa.Table, traces: set[str], responses: set[str]) -> list[dict]:
    """The rows of a spans table in ``traces`` or answering ``responses``, as dicts with
    ``is_call`` and ``response_id``."""
    if not table.num_rows:
        return []
    response = pc.map_lookup(table.column("attributes"), sc.GEN_AI_RESPONSE_ID, "first")
    wanted = pc.is_in(table.column("trace_id"), pa.array(sorted(traces), pa.string()))
    if responses:
        wanted = pc.or_(wanted, pc.fill_null(pc.is_in(response, pa.array(
            sorted(json.dumps(r) for r in responses), pa.string())), False))
    if not pc.any(wanted).as_py():
        return []
    picked = table.filter(wanted)
    ops = pa.array(sorted(sc.LLM_OPERATIONS))
    calls = pc.or_(pc.is_valid(picked.column("prompt_token_ids")),
                   pc.fill_null(pc.is_in(picked.column("operation_name"), ops), False)).to_pylist()
    rows = picked.select(_SPAN_COLUMNS).to_pylist()
    for row, is_call, rid in zip(rows, calls, pc.filter(response, wanted).to_pylist()):
        row["is_call"] = bool(is_call)
        row["response_id"] = _decoded([("r", rid)])["r"] if rid is not None else None
    return rows


def stored_candidates(data_dir, traces: set[str], responses: set[str]) -> list[dict]:
    """:func:`candidates` of the spans already in the store."""
    def query():
        con = store.connect(data_dir)
        try:
            rows = con.execute(
                "SELECT trace_id, span_id, rollout_id, task_id, split, service_name, operation_name, "
                "prompt_token_ids IS NOT NULL OR list_contains($ops::VARCHAR[], operation_name) AS is_call, "
                "json_extract_string(attributes[$rid], '$') AS response_id FROM spans "
                "WHERE trace_id IN (SELECT unnest($traces::VARCHAR[])) "
                "   OR attributes[$rid] IN (SELECT unnest($responses::VARCHAR[]))",
                {"ops": sorted(sc.LLM_OPERATIONS), "rid": sc.GEN_AI_RESPONSE_ID, "traces": sorted(traces),
                 "responses": sorted(json.dumps(r) for r in responses)}).fetchall()
        finally:
            con.close()
        return [dict(zip(_SPAN_COLUMNS + ["is_call", "response_id"], r)) for r in rows]

    return store.retry_vanished(query)


def resolve(evaluations: list[Evaluation], candidates: list[dict]) -> list[Evaluation]:
    """Each evaluation with what ``candidates`` (span rows) tell of its evaluated span: the span
    itself (its ids, else its response id), else its trace's rollout."""
    by_span, by_response, by_trace = {}, {}, {}
    for row in candidates:
        by_span[(row["trace_id"], row["span_id"])] = row
        if row["response_id"]:
            by_response.setdefault(row["response_id"], row)
        if row["rollout_id"] is not None:
            by_trace.setdefault(row["trace_id"], row)
    out = []
    for ev in evaluations:
        row = by_span.get((ev.trace_id, ev.span_id)) or (by_response.get(ev.response_id) if ev.response_id else None)
        if row is not None:
            ev = replace(ev, found=(row["trace_id"], row["span_id"]), is_call=row["is_call"],
                         service=row["service_name"], rollout_id=ev.rollout_id or row["rollout_id"],
                         task_id=ev.task_id or row["task_id"], split=ev.split or row["split"])
        elif ev.trace_id in by_trace and ev.rollout_id is None:
            row = by_trace[ev.trace_id]
            ev = replace(ev, rollout_id=row["rollout_id"], task_id=ev.task_id or row["task_id"],
                         split=ev.split or row["split"], service=row["service_name"])
        out.append(ev)
    return out


# --- rewards -------------------------------------------------------------------------------------

def source(ev: Evaluation) -> str:
    """Who gave the reward (see the module docstring, 3)."""
    if ev.own or (ev.service is not None and ev.emitter == ev.service):
        return "agent"
    name = ev.emitter or "evaluator"
    return f"evaluator:{name}" if name in RESERVED_SOURCES else name


def value_of(ev: Evaluation, label_values: dict[str, float] | None) -> float | None:
    """The reward's value: the score, else the label's mapped value, else None (not trained on)."""
    if ev.value is not None or ev.label is None or not label_values:
        return ev.value
    mapped = label_values.get(f"{ev.name}/{ev.label}", label_values.get(ev.label))
    return float(mapped) if mapped is not None else None


def ids(secret: bytes, ev: Evaluation) -> tuple[bytes, bytes]:
    """The reward span's (trace_id, span_id): in the evaluated trace when the event names it, the
    span id a keyed hash of the evaluation's key, which no sender can take first."""
    trace_id, span_id = reward_ids(secret, f"evaluation\x00{ev.emitter}", ev.name, ev.key)
    return (bytes.fromhex(ev.trace_id) if ev.trace_id else trace_id), span_id


def add_attribute(span, key: str, value) -> None:
    if value is None:
        return
    kv = span.attributes.add(key=key)
    if isinstance(value, float):
        kv.value.double_value = value
    else:
        kv.value.string_value = str(value)


def reward_request(evaluations: list[Evaluation], secret: bytes,
                   label_values: dict[str, float] | None) -> ExportTraceServiceRequest:
    """One reward span per evaluation, in the collector's reward scope."""
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    scope.scope.name = REWARD_SCOPE
    for ev in evaluations:
        trace_id, span_id = ids(secret, ev)
        evaluated_trace, evaluated_span = ev.evaluated
        span = scope.spans.add(trace_id=trace_id, span_id=span_id, name=sc.SPAN_REWARD, kind=1,
                               start_time_unix_nano=ev.time_ns, end_time_unix_nano=ev.time_ns)
        attrs = {sc.ROLLOUT_ID: ev.rollout_id, sc.TASK_ID: ev.task_id, sc.SPLIT: ev.split,
                 sc.REWARD: value_of(ev, label_values), sc.REWARD_NAME: ev.name, sc.REWARD_SOURCE: source(ev),
                 sc.REWARD_EVALUATOR: ev.emitter or None,
                 # a rollout's agent or root span scored: the whole rollout's reward
                 sc.REWARD_CALL_SPAN_ID: evaluated_span if ev.is_call is not False else None,
                 sc.REWARD_COMMENT: ev.explanation, sc.GEN_AI_EVALUATION_NAME: ev.name,
                 sc.GEN_AI_EVALUATION_SCORE_VALUE: ev.value, sc.GEN_AI_EVALUATION_SCORE_LABEL: ev.label,
                 sc.GEN_AI_RESPONSE_ID: ev.response_id, sc.REWARD_EVALUATED_TRACE_ID: evaluated_trace,
                 sc.REWARD_EVALUATED_SPAN_ID: evaluated_span}
        for key, value in sc.genai({k: v for k, v in attrs.items() if v is not None}).items():
            add_attribute(span, key, value)
    return request
