"""The API's two data endpoints, as functions the HTTP transport calls.

``POST /v1/rewards`` — late rewards keyed by rollout id (docs/architecture.md, "Delivery"). Each reward becomes
one span (name ``lightspan.reward``, attributes ``lightspan.rollout.id``, ``lightspan.reward``,
``lightspan.reward.name``) in an ordinary ``ExportTraceServiceRequest`` that goes through the
collector's one export path: WAL, fsync, acknowledgement, Parquet. So it is durable before the
200, and it shows in the ``rewards`` and ``rollouts`` views like a reward span an agent sent.
Its trace and span ids are a keyed hash of (rollout_id, name, id), the reward's key, that no
sender can predict (:func:`~lightspan.collector.reward_integrity.reward_ids`); only the API writes
its scope, and a reward's source is the one posted here (:mod:`~lightspan.collector.reward_integrity`). **A stored
reward is never changed** (it may have been trained on already): posting the same key again with
the same value is idempotent (200, the reward reported ``already_stored``, nothing written twice,
however long after and across restarts), and with another value the request is refused with 409
Conflict, naming the stored value, and nothing of it is stored (:class:`RewardBook`). Without
``id``, a rollout has one reward per name; give ``id`` to record several, or a correction.

``POST /v1/rollouts/{rollout_id}/events`` — Agent Lightning's events (``AGL_EVENT_URL``, which
``lightspan rollout`` sets): a reward event ``{"event_type": "reward", "data": {"value": v}}``
becomes the reward ``{"rollout_id": rollout_id, "value": v}`` and goes the path above. Each event
is its own reward (its id is the time it was received), so the rollout's last one is its final
reward, as in Agent Lightning; other event types are acknowledged and counted, not stored.

``POST /v1/sql`` / ``GET /v1/sql?q=`` — read-only SQL over the store's views: one SELECT (or
EXPLAIN) statement, on a fresh in-memory DuckDB connection from :func:`store.connect` whose
external access is switched off once the views exist (only the data directory's tables stay
readable; ``read_csv``, ``COPY``, ``ATTACH``, ``INSTALL`` of anything else are refused) and
whose configuration is then locked. A timer thread interrupts the query after ``timeout_s``;
at most ``max_rows`` rows and ``max_bytes`` bytes of them (as JSON) come back (``truncated`` says
there were more). DuckDB's own memory is capped by ``memory_limit``; the collector runs these
queries in worker processes whose whole memory is capped too (:mod:`lightspan.collector.sqlpool`):
DuckDB builds each block of rows (2,048 at a time) outside its memory limit.
"""

from __future__ import annotations

import collections
import json
import math
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote

import duckdb
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from lightspan import store
from lightspan.collector.reward_integrity import reward_ids
from lightspan.store.schema import REWARD_SCOPE
from lightspan.store.sql import SQL_MEMORY_LIMIT, jsonable, sql_connection, time_limit
from lightspan.tracing import semconv as sc

REWARD_ID = "lightspan.reward.id"       # the idempotency key of a posted reward
MAX_REWARDS = 10_000                    # per request
_HEX16 = re.compile(r"[0-9a-f]{16}")
# optional keys -> (attribute, longest value): who scored, why, a corrected answer, the call scored
_REWARD_TEXT = {"source": (sc.REWARD_SOURCE, 16), "comment": (sc.REWARD_COMMENT, 4096),
                "correction": (sc.REWARD_CORRECTION, 65536), "judge_model": (sc.REWARD_JUDGE_MODEL, 256),
                "rubric_sha256": (sc.REWARD_RUBRIC_SHA256, 64), "span_id": (sc.REWARD_CALL_SPAN_ID, 16)}
REWARD_SOURCES = ("agent", "judge", "human", "api")
_REWARD_KEYS = {"rollout_id", "value", "name", "id", "task_id", *_REWARD_TEXT}


class BadRequest(ValueError):
    """The client's request is wrong (HTTP 400); the message says what and how to fix it."""


# --- rewards -----------------------------------------------------------------------------------

def _text(item: dict, key: str, where: str, *, required: bool) -> str | None:
    value = item.get(key)
    if value is None:
        if required:
            raise BadRequest(f"{where}: {key!r} is required")
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise BadRequest(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    value = str(value)
    if not value.strip():
        raise BadRequest(f"{where}: {key!r} is empty")
    return value


def reward_request(doc, now_unix_nano: int, secret: bytes) -> tuple[ExportTraceServiceRequest, list[dict]]:
    """A JSON reward (or a list of them) → one span each; returns (request, what was recorded).

    A reward is ``{"rollout_id": str, "value": number, "name": "reward", "id": optional key,
    "task_id": optional}``, optionally with ``source`` (agent, judge, human or api: the default),
    ``comment``, ``correction`` (a corrected answer), ``span_id`` (the LLM call it scores: 16 hex
    digits), ``judge_model`` and ``rubric_sha256``. ``secret`` keys the reward ids (the collector's,
    :func:`~lightspan.collector.reward_integrity.load_key`). Raises :class:`BadRequest` naming the
    offending item and field.
    """
    items = doc if isinstance(doc, list) else [doc]
    if not items:
        raise BadRequest("no rewards: send an object or a non-empty list of objects")
    if len(items) > MAX_REWARDS:
        raise BadRequest(f"{len(items)} rewards in one request: send at most {MAX_REWARDS}")
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    scope.scope.name = REWARD_SCOPE
    recorded = []
    for i, item in enumerate(items):
        where = f"reward[{i}]" if isinstance(doc, list) else "reward"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} is not a JSON object: send {{\"rollout_id\": ..., \"value\": ...}}")
        unknown = sorted(set(item) - _REWARD_KEYS)
        if unknown:
            raise BadRequest(f"{where}: unknown field(s) {unknown}; known: {sorted(_REWARD_KEYS)}")
        rollout_id = _text(item, "rollout_id", where, required=True)
        name = _text(item, "name", where, required=False) or "reward"
        key = _text(item, "id", where, required=False)
        task_id = _text(item, "task_id", where, required=False)
        value = item.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"{where}: 'value' must be a number, got {value!r}")
        value = float(value) if isinstance(value, float) or abs(value) < 1 << 1000 else math.inf
        if not math.isfinite(value):
            raise BadRequest(f"{where}: 'value' must be finite, got {value}")
        extra = {k: _text(item, k, where, required=False) for k in _REWARD_TEXT if item.get(k) is not None}
        for k, text in extra.items():
            if len(text) > _REWARD_TEXT[k][1]:
                raise BadRequest(f"{where}: {k!r} is longer than {_REWARD_TEXT[k][1]} characters")
        if extra.setdefault("source", "api") not in REWARD_SOURCES:
            raise BadRequest(f"{where}: 'source' must be one of {list(REWARD_SOURCES)}, got {extra['source']!r}")
        if "span_id" in extra and not _HEX16.fullmatch(extra["span_id"]):
            raise BadRequest(f"{where}: 'span_id' must be the call's span id, 16 lowercase hex digits")
        # a reward on one call is keyed by the call too (two calls scored under one name are two rewards)
        call = extra.get("span_id")
        trace_id, span_id = reward_ids(secret, rollout_id, name, key if call is None else f"{key or ''}\x00{call}")
        span = scope.spans.add(trace_id=trace_id, span_id=span_id, name=sc.SPAN_REWARD, kind=1,
                               start_time_unix_nano=now_unix_nano, end_time_unix_nano=now_unix_nano)
        attrs = [(sc.ROLLOUT_ID, rollout_id), (sc.REWARD, value), (sc.REWARD_NAME, name)]
        attrs += [(k, v) for k, v in ((sc.TASK_ID, task_id), (REWARD_ID, key)) if v is not None]
        attrs += [(_REWARD_TEXT[k][0], v) for k, v in extra.items()]
        for attr, attr_value in sc.genai(dict(attrs)).items():
            kv = span.attributes.add(key=attr)
            if isinstance(attr_value, float):
                kv.value.double_value = attr_value
            else:
                kv.value.string_value = attr_value
        recorded.append({"rollout_id": rollout_id, "name": name, "id": key, "value": value,
                         **{("call_span_id" if k == "span_id" else k): v for k, v in extra.items()},
                         "trace_id": trace_id.hex(), "span_id": span_id.hex()})
    return request, recorded


# --- Agent Lightning's events ----------------------------------------------------------------------

EVENTS_PATH = re.compile(r"/v1/rollouts/([^/]+)/events")
_EVENT_KEYS = {"event_type", "data"}


def event_rollout(path: str) -> str | None:
    """The rollout id of an events path (``/v1/rollouts/ID/events``, ID percent-encoded), else None."""
    match = EVENTS_PATH.fullmatch(path)
    return unquote(match.group(1)) if match else None


def event_reward(rollout_id: str, doc, received_unix_nano: int) -> dict | None:
    """An Agent Lightning event posted for ``rollout_id`` as the reward :func:`reward_request`
    takes, or None when it is not a reward event. Raises :class:`BadRequest` for a malformed one."""
    example = '{"event_type": "reward", "data": {"value": 1.0}}'
    if not isinstance(doc, dict):
        raise BadRequest(f"event is not a JSON object: send {example}")
    unknown = sorted(set(doc) - _EVENT_KEYS)
    if unknown:
        raise BadRequest(f"event: unknown field(s) {unknown}; known: {sorted(_EVENT_KEYS)}")
    event_type, data = doc.get("event_type"), doc.get("data", {})
    if not isinstance(event_type, str) or not event_type.strip():
        raise BadRequest(f"event: 'event_type' must be a non-empty string, e.g. {example}")
    if not isinstance(data, dict):
        raise BadRequest(f"event: 'data' must be an object, got {type(data).__name__}")
    if event_type != "reward":
        return None
    if "value" not in data:
        raise BadRequest(f"reward event: 'data' has no 'value': send {example}")
    reward = {"rollout_id": rollout_id, "value": data["value"], "name": "reward", "id": f"event-{received_unix_nano}",
              "source": "agent"}        # the agent itself scored the rollout, as with emit_reward
    note = next((data[k] for k in ("message", "reason") if isinstance(data.get(k), str) and data[k].strip()), None)
    if note is not None:
        reward["comment"] = note[:4096]
    return reward


class Conflict(ValueError):
    """A reward with the same key and another value is stored already (HTTP 409)."""

    def __init__(self, message: str, conflicts: list[dict]):
        super().__init__(message)
        self.conflicts = conflicts


def _key(reward: dict) -> tuple[str, str]:
    return reward["trace_id"], reward["span_id"]


def stored_rewards(data_dir: str | Path, keys: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
    """The values of the posted rewards among ``keys`` ((trace_id, span_id) hex) already in the store."""
    if not keys:
        return {}

    def query():
        con = store.connect(data_dir)
        try:
            return con.execute(
                "SELECT trace_id, span_id, reward FROM spans WHERE scope_name = $scope AND name = $name "
                "AND trace_id IN (SELECT unnest($traces::VARCHAR[]))",
                {"scope": REWARD_SCOPE, "name": sc.SPAN_REWARD, "traces": sorted({t for t, _ in keys})}).fetchall()
        finally:
            con.close()

    wanted = set(keys)
    return {(t, s): v for t, s, v in store.retry_vanished(query) if (t, s) in wanted}


class RewardBook:
    """The re-post rule of ``POST /v1/rewards`` (see the module docstring), across restarts: a key
    is looked up among the rewards this process accepted (at most ``max_keys``, the oldest
    forgotten first, long since in Parquet) and then in the store, which a restart's WAL replay has
    completed before the API serves. One post at a time, so two posts of a key cannot race."""

    def __init__(self, data_dir: str | Path, max_keys: int):
        self.data_dir = data_dir
        self.max_keys = max_keys
        self._accepted: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def post(self, request: ExportTraceServiceRequest, recorded: list[dict], export: Callable):
        """Store the rewards of ``request`` that are new, through ``export(request)``; returns its
        result (None when every reward was stored already). Raises :class:`Conflict`."""
        with self._lock:
            values: dict[tuple[str, str], float] = {}
            for reward in recorded:                       # the same key twice in one post must agree
                if values.setdefault(_key(reward), reward["value"]) != reward["value"]:
                    raise Conflict(f"reward {reward['name']!r} of rollout {reward['rollout_id']!r} (id "
                                   f"{reward['id']!r}) is given twice with different values",
                                   [{**reward, "stored_value": values[_key(reward)]}])
            known = {k: self._accepted[k] for k in values if k in self._accepted}
            known.update(stored_rewards(self.data_dir, [k for k in values if k not in known]))
            conflicts = [{**r, "stored_value": known[_key(r)]} for r in recorded
                         if _key(r) in known and known[_key(r)] != r["value"]]
            if conflicts:
                first = conflicts[0]
                raise Conflict(f"{len(conflicts)} reward(s) already stored with another value; first: "
                               f"{first['name']!r} of rollout {first['rollout_id']!r} (id {first['id']!r}) is "
                               f"{first['stored_value']!r}, not {first['value']!r}. A stored reward is never "
                               "changed: post a correction under a new 'id'", conflicts)
            for reward in recorded:
                reward["status"] = "already_stored" if _key(reward) in known else "stored"
            fresh = {k for k in values if k not in known}
            if not fresh:
                return None
            scope = request.resource_spans[0].scope_spans[0]
            kept = [span for span in scope.spans if (span.trace_id.hex(), span.span_id.hex()) in fresh]
            del scope.spans[:]
            scope.spans.extend(kept)
            result = export(request)
            if result.outcome.value == "ok" and not result.rejected:
                for key in fresh:
                    self._accepted[key] = values[key]
                while len(self._accepted) > self.max_keys:
                    self._accepted.popitem(last=False)
            return result


# --- SQL -------------------------------------------------------------------------------------

_READ_ONLY = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


def run_sql(data_dir: str | Path, sql: str, *, timeout_s: float, max_rows: int, max_bytes: int = 16 << 20,
            memory_limit: int = SQL_MEMORY_LIMIT) -> dict:
    """Run one read-only statement; returns ``{"columns", "types", "rows", "row_count",
    "truncated", "elapsed_s"}``. Raises :class:`BadRequest` with DuckDB's message on any error."""
    if not isinstance(sql, str) or not sql.strip():
        raise BadRequest('no SQL: send {"sql": "SELECT ..."} or GET /v1/sql?q=SELECT+...')
    start = time.perf_counter()
    try:
        con = sql_connection(data_dir, memory_limit)
    except duckdb.Error as exc:
        raise BadRequest(f"cannot open the store: {exc}") from None
    try:
        with time_limit(con, timeout_s) as timed_out:
            statements = con.extract_statements(sql)
            if len(statements) != 1:
                raise BadRequest(f"send exactly one statement, got {len(statements)}")
            if statements[0].type not in _READ_ONLY:
                raise BadRequest(f"only SELECT and EXPLAIN are allowed here, got {statements[0].type.name}: "
                                 "the SQL endpoint is read-only")
            timed_out.start()
            cursor = con.execute(sql)
            columns = [d[0] for d in cursor.description or []]
            types = [str(d[1]) for d in cursor.description or []]
            rows, truncated = _fetch(cursor, max_rows, max_bytes)
    except duckdb.OutOfMemoryException as exc:
        raise BadRequest(f"the query needs more than sql_memory_limit_bytes={memory_limit}: {exc}") from None
    except duckdb.Error as exc:
        if timed_out.is_set():
            raise BadRequest(f"the query ran past sql_timeout_s={timeout_s:g} s and was interrupted") from None
        raise BadRequest(f"{type(exc).__name__}: {exc}") from None
    finally:
        con.close()
    return {"columns": columns, "types": types, "rows": rows, "row_count": len(rows), "truncated": truncated,
            "elapsed_s": round(time.perf_counter() - start, 6)}


def _fetch(cursor, max_rows: int, max_bytes: int) -> tuple[list[list], bool]:
    """At most ``max_rows`` rows whose JSON takes at most ``max_bytes``; and whether there were more.
    Rows are converted a few at a time, as many as the bytes left suggest, so one answer never
    holds much more than ``max_bytes`` of Python objects."""
    rows, size, batch = [], 2, 1
    while True:
        chunk = cursor.fetchmany(batch)
        if not chunk:
            return rows, False
        for row in chunk:
            out = [jsonable(v) for v in row]
            size += len(json.dumps(out, allow_nan=False)) + 1
            if len(rows) == max_rows or size > max_bytes:
                return rows, True
            rows.append(out)
        per_row = max(1, size // len(rows))
        batch = max(1, min(1024, (max_bytes - size) // per_row // 2))
