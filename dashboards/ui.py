"""The web UI's queries: parameters in, JSON-able dicts out, through the store's views only.

Every function here reads the DuckDB views of :mod:`lightspan.store` (``spans``,
``llm_calls``, ``rollouts``, ``rewards``, ``transitions``, ``train_steps``) — the same ones
``lightspan sql`` and ``/v1/sql`` use — on a connection the caller opens. Values from the
request are always bound as parameters; only fixed SQL fragments are put together. Bad
parameters raise :class:`BadParameter` (HTTP 400) naming the parameter and the fix.

Endpoints (see :mod:`lightspan.dashboards.web`):

- ``/api/ui/rollouts``: :func:`rollouts` (filters: task, split, agent, min_reward, max_reward,
  version, since, until; limit, offset);
- ``/api/ui/facets``: :func:`facets`, the values the filters can take;
- ``/api/ui/rollouts/<key>``: :func:`rollout`, one rollout's spans as a tree, its LLM calls with
  messages, tokens and logprobs, the reward matched to each call and its transitions;
- ``/api/ui/training``, ``/api/ui/queue``, ``/api/ui/quality``: :mod:`lightspan.dashboards.quality`;
- ``/api/ui/health``: :mod:`lightspan.dashboards.health`, the collector's own metrics.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence

import duckdb
import numpy as np

from lightspan.store.attribution import rewards_per_call
from lightspan.store.sql import jsonable
from lightspan.store.views import NOT_CAPTURED_REASON, REWARD_ORDER
from lightspan.core.config import parse_time as core_parse_time

MAX_LIMIT = 1000
DEFAULT_LIMIT = 100
MAX_SPANS = 5000          # spans of one rollout returned; past it the answer says truncated
MAX_TEXT = 200            # longest filter value accepted

Params = Mapping[str, Sequence[str]]   # parse_qs output: each parameter's values


class BadParameter(ValueError):
    """A query parameter is wrong (HTTP 400); the message names it and the fix."""


# --- parameters ----------------------------------------------------------------------------------

def one(params: Params, name: str) -> str | None:
    values = params.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise BadParameter(f"{name!r} is given {len(values)} times: give it once")
    value = values[0].strip()
    if not value:
        return None
    if len(value) > MAX_TEXT:
        raise BadParameter(f"{name!r} is {len(value)} characters long: at most {MAX_TEXT}")
    return value


def check_known(params: Params, known: Sequence[str]) -> None:
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise BadParameter(f"unknown parameter(s) {unknown}: known are {sorted(known)}")


def integer(params: Params, name: str, *, low: int, high: int | None = None, default: int | None = None) -> int | None:
    text = one(params, name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise BadParameter(f"{name!r} must be a whole number, got {text!r}") from None
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise BadParameter(f"{name!r} must be {bound}, got {value}")
    return value


def number(params: Params, name: str) -> float | None:
    text = one(params, name)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise BadParameter(f"{name!r} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise BadParameter(f"{name!r} must be a finite number, got {text!r}")
    return value


def parse_time(text: str, name: str, now_ns: int) -> int:
    """Unix nanoseconds of ``text``: unix seconds (``1767225600``), an ISO 8601 time (UTC unless
    it has an offset), or a duration before now (``15m``, ``2h``, ``7d``):
    :func:`lightspan.core.config.parse_time`, its error a 400 naming the parameter."""
    try:
        ns = core_parse_time(text, now_ns=now_ns)
    except ValueError as exc:
        raise BadParameter(f"{name!r} must be unix seconds, an ISO 8601 time (2026-01-31T12:00:00Z) or a "
                           f"duration before now (15m, 2h, 7d), got {text!r} ({exc})") from None
    if ns is None:
        raise BadParameter(f"{name!r} is empty: give unix seconds, an ISO 8601 time or a duration before now")
    return ns


# --- rows to JSON --------------------------------------------------------------------------------

def records(cursor: duckdb.DuckDBPyConnection) -> list[dict]:
    names = [d[0] for d in cursor.description]
    return [{n: jsonable(v) for n, v in zip(names, row)} for row in cursor.fetchall()]


# --- rollouts ------------------------------------------------------------------------------------

ROLLOUT_PARAMS = ("task", "split", "agent", "status", "min_reward", "max_reward", "version", "since", "until",
                  "limit", "offset")
# the rollouts view's status: why a rollout trains or not (a failed one is never a reward of 0)
STATUSES = ("rewarded", "unrewarded", "failed", "timeout", "infra")

# One rollout per row, once per request into a temp table that the count and the page read: the
# rollouts view (without its num_llm_calls, which would read every span's prompt token ids), the
# agents of its GenAI spans and its trace ids. Only light columns are read; each request scans the
# spans as few times as it can.
_ROLLOUTS_TABLE_SQL = """
CREATE OR REPLACE TEMP TABLE _ui_rollouts AS
SELECT r.rollout_key, r.task_id, r.split, r.service_name, r.num_spans, r.final_reward, r.has_error,
       r.start_time_unix_nano, r.end_time_unix_nano, r.model_version, r.status, r.outcome, r.exit_code,
       r.num_uncaptured_calls, r.capture_problem, r.capture_reason, a.agents, a.traces
FROM rollouts r
LEFT JOIN (SELECT coalesce(rollout_id, trace_id) AS rollout_key,
                  list(DISTINCT coalesce(agent_name, service_name) ORDER BY coalesce(agent_name, service_name))
                      FILTER (WHERE agent_name IS NOT NULL OR operation_name IS NOT NULL) AS agents,
                  list(DISTINCT trace_id) AS traces
           FROM spans GROUP BY 1) a USING (rollout_key)
"""
# the LLM calls of the page's rollouts; the trace ids let DuckDB filter the scan (and, in a tree
# merged from several collectors, below the view's deduplication), so only those traces' token
# lists are read
_PAGE_CALLS_SQL = """
SELECT rollout_key, count(*) FROM llm_calls
WHERE list_contains($traces::VARCHAR[], trace_id) AND list_contains($keys::VARCHAR[], rollout_key)
GROUP BY 1
"""
# each filter: a fixed fragment and the name of the parameter it binds
_FILTERS = {
    "task": "task_id = $task",
    "split": "split = $split",
    "agent": "list_contains(coalesce(agents, []), $agent)",
    "status": "status = $status",
    "min_reward": "final_reward >= $min_reward",
    "max_reward": "final_reward <= $max_reward",
    "version": "model_version = $version",
    "since": "start_time_unix_nano >= $since",
    "until": "start_time_unix_nano < $until",
}


def rollout_filters(params: Params, now_ns: int | None = None) -> dict:
    """The validated filters of ``/api/ui/rollouts`` (absent ones left out), plus limit and offset."""
    check_known(params, ROLLOUT_PARAMS)
    now_ns = time.time_ns() if now_ns is None else now_ns
    found = {name: one(params, name) for name in ("task", "split", "agent", "status")}
    if found["status"] is not None and found["status"] not in STATUSES:
        raise BadParameter(f"'status' must be one of {list(STATUSES)}, got {found['status']!r}")
    found["min_reward"] = number(params, "min_reward")
    found["max_reward"] = number(params, "max_reward")
    found["version"] = integer(params, "version", low=0)
    for name in ("since", "until"):
        text = one(params, name)
        found[name] = parse_time(text, name, now_ns) if text is not None else None
    filters = {k: v for k, v in found.items() if v is not None}
    filters["limit"] = integer(params, "limit", low=1, high=MAX_LIMIT, default=DEFAULT_LIMIT)
    filters["offset"] = integer(params, "offset", low=0, default=0)
    return filters


def rollouts(con: duckdb.DuckDBPyConnection, filters: dict) -> dict:
    """Rollouts matching ``filters`` (from :func:`rollout_filters`), newest first, with the
    matching total and the mean final reward over all of them (not just this page)."""
    bound = {k: v for k, v in filters.items() if k in _FILTERS}
    where = " AND ".join(_FILTERS[k] for k in bound) or "true"
    con.execute(_ROLLOUTS_TABLE_SQL)
    summary = con.execute(f"SELECT count(*), avg(final_reward), count(final_reward) FROM _ui_rollouts WHERE {where}",
                          bound).fetchone()
    cursor = con.execute(f"""
        SELECT rollout_key, task_id, split, service_name, agents, num_spans, final_reward,
               has_error, start_time_unix_nano, end_time_unix_nano, model_version, status, outcome, exit_code,
               num_uncaptured_calls, capture_problem, capture_reason, traces
        FROM _ui_rollouts WHERE {where}
        ORDER BY start_time_unix_nano DESC NULLS LAST, rollout_key
        LIMIT $limit OFFSET $offset""", {**bound, "limit": filters["limit"], "offset": filters["offset"]})
    page = records(cursor)
    calls = dict(con.execute(_PAGE_CALLS_SQL, {"traces": [t for r in page for t in r["traces"] or []],
                                               "keys": [r["rollout_key"] for r in page]}).fetchall()) if page else {}
    for row in page:
        del row["traces"]
        row["num_llm_calls"] = calls.get(row["rollout_key"], 0)
    return {"rollouts": page, "total": summary[0], "reward_mean": jsonable(summary[1]),
            "with_reward": summary[2], "limit": filters["limit"], "offset": filters["offset"]}


def facets(con: duckdb.DuckDBPyConnection, params: Params) -> dict:
    """The values the rollout filters can take: tasks, splits, agents, policy versions (≤ 500 each)."""
    check_known(params, ())
    con.execute(_ROLLOUTS_TABLE_SQL)
    out = {}
    for name, column in (("tasks", "task_id"), ("splits", "split"), ("agents", "unnest(agents)"),
                         ("versions", "model_version")):
        rows = con.execute(f"SELECT DISTINCT v FROM (SELECT {column} AS v FROM _ui_rollouts) "
                           "WHERE v IS NOT NULL ORDER BY 1 LIMIT 500").fetchall()
        out[name] = [row[0] for row in rows]
    return out


# --- one rollout ---------------------------------------------------------------------------------

# The rollout's traces first (light columns); every later query filters on them as well as on the
# key, so DuckDB reads only those traces' rows.
_TRACES_SQL = "SELECT DISTINCT trace_id FROM spans WHERE coalesce(rollout_id, trace_id) = $key"
_IN_TRACES = "list_contains($traces::VARCHAR[], trace_id)"   # (faster here than IN (SELECT unnest(...)))
_SPANS_SQL = f"""
SELECT trace_id, span_id, parent_span_id, name, kind, service_name, scope_name,
       start_time_unix_nano, end_time_unix_nano, status_code, status_message, rollout_id, task_id, split,
       operation_name, request_model, response_model, temperature, input_tokens, output_tokens,
       cache_read_input_tokens, reasoning_output_tokens,
       finish_reasons, agent_name, input_messages, output_messages, len(prompt_token_ids) AS num_prompt_tokens,
       completion_token_ids, completion_logprobs, model_version, capture_status, reward, reward_name,
       attributes, events
FROM spans WHERE {_IN_TRACES} AND coalesce(rollout_id, trace_id) = $key
ORDER BY start_time_unix_nano, end_time_unix_nano, span_id
LIMIT $limit
"""
# the rollout's LLM calls in the builder's action order: (start, end, span id)
_CALLS_SQL = f"""
SELECT trace_id, span_id, end_time_unix_nano, capture_status,
       json_extract_string(attributes['lightspan.capture.reason'], '$') AS capture_reason
FROM llm_calls WHERE {_IN_TRACES} AND rollout_key = $key
ORDER BY start_time_unix_nano, end_time_unix_nano, span_id
"""
_REWARDS_SQL = f"""
SELECT trace_id, span_id, reward_name, reward, time_unix_nano, source, call_span_id, comment, correction,
       judge_model FROM rewards
WHERE {_IN_TRACES} AND rollout_key = $key AND isfinite(reward) ORDER BY received_unix_nano, time_unix_nano, span_id
"""
# the rollouts view's columns for this rollout's traces only (the view itself would scan every span)
_SUMMARY_SQL = f"""
SELECT any_value(task_id) FILTER (WHERE task_id IS NOT NULL) AS task_id,
       any_value(split) FILTER (WHERE split IS NOT NULL) AS split,
       coalesce(arg_max(reward, {REWARD_ORDER}) FILTER (WHERE reward IS NOT NULL
                    AND attributes['lightspan.reward.call_span_id'] IS NULL),
                arg_max(reward, {REWARD_ORDER}) FILTER (WHERE reward IS NOT NULL)) AS final_reward,
       max(model_version) AS model_version, bool_or(status_code = 'ERROR') AS has_error,
       any_value(json_extract_string(attributes['lightspan.rollout.outcome'], '$'))
           FILTER (WHERE name = 'lightspan.runner') AS outcome,
       any_value(TRY_CAST(attributes['lightspan.rollout.exit_code'] AS BIGINT))
           FILTER (WHERE name = 'lightspan.runner') AS exit_code,
       CASE WHEN outcome IN ('failed', 'timeout', 'infra') THEN outcome
            WHEN final_reward IS NOT NULL THEN 'rewarded' ELSE 'unrewarded' END AS status
FROM spans WHERE {_IN_TRACES} AND coalesce(rollout_id, trace_id) = $key
"""
# the newest build of each of the rollout's transitions
_TRANSITIONS_SQL = """
SELECT transition_id, call_index, num_calls, model_version, reward, credit, advantage, credit_policy,
       advantage_estimator, build_id, created_unix_nano, len(completion_token_ids) AS num_completion_tokens,
       segment, segment_cause, coalesce(outcome, 'ok') AS outcome, coalesce(loss_weight, 1.0) AS loss_weight
FROM transitions WHERE rollout_id = $key
QUALIFY row_number() OVER (PARTITION BY transition_id ORDER BY created_unix_nano DESC) = 1
ORDER BY call_index, transition_id
"""

Decoder = Callable[[list[int]], list[str] | None]


def _messages(text):
    """The instrumentation's JSON message text, parsed; the raw text if it is not JSON."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _capture(calls: list[tuple]) -> dict:
    """The rollouts view's capture columns from the rollout's calls (trace, span, end, capture status,
    reason): the calls not captured (status not ok, or none), the most common problem and its reason."""
    problems: dict[str, list] = {}
    for *_, status, reason in calls:
        if status != "ok":
            entry = problems.setdefault(status or "not_captured", [0, None])
            entry[0] += 1
            entry[1] = entry[1] or reason
    if not problems:
        return {"num_uncaptured_calls": 0, "capture_problem": None, "capture_reason": None}
    problem, (_, reason) = max(problems.items(), key=lambda item: (item[1][0], item[0]))
    reason = reason or (NOT_CAPTURED_REASON if problem == "not_captured" else None)
    return {"num_uncaptured_calls": sum(n for n, _ in problems.values()), "capture_problem": problem,
            "capture_reason": reason}


def rollout(con: duckdb.DuckDBPyConnection, key: str, decode: Decoder | None = None) -> dict | None:
    """One rollout by its key (``lightspan.rollout.id``, else the trace id); None if it has no spans.

    Spans come with their tree (``parent_span_id`` within the trace; a span whose parent is not
    stored is a root). Each LLM call gets ``call_index`` (the builder's action order), its
    messages parsed, its completion tokens (decoded by ``decode`` when given) with their
    logprobs, ``matched_reward`` (the rewards credit assignment attributes to it,
    :func:`lightspan.store.attribution.rewards_per_call`) and its newest ``transition`` (credit,
    advantage), if one was built for it.
    """
    if not key or len(key) > MAX_TEXT:
        raise BadParameter(f"a rollout key is 1 to {MAX_TEXT} characters, got {len(key)}")
    traces = [row[0] for row in con.execute(_TRACES_SQL, {"key": key}).fetchall()]
    if not traces:
        return None
    at = {"key": key, "traces": traces}
    spans = records(con.execute(_SPANS_SQL, {**at, "limit": MAX_SPANS + 1}))
    truncated = len(spans) > MAX_SPANS
    spans = spans[:MAX_SPANS]
    calls = con.execute(_CALLS_SQL, at).fetchall()
    rewards = records(con.execute(_REWARDS_SQL, at))
    transitions = records(con.execute(_TRANSITIONS_SQL, {"key": key}))
    matched = np.zeros(len(calls))
    if calls and rewards:
        ends = {c[1]: c[2] or 0 for c in calls}      # a reward naming a call counts at its end, as in the builder
        matched = rewards_per_call(np.array([c[2] or 0 for c in calls], dtype=np.int64),
                                   np.array([ends.get(r["call_span_id"], r["time_unix_nano"] or 0) for r in rewards],
                                            dtype=np.int64),
                                   np.array([r["reward"] for r in rewards], dtype=np.float64))
    call_at = {(c[0], c[1]): i for i, c in enumerate(calls)}
    by_transition = {t["transition_id"]: t for t in transitions}
    ids = {(s["trace_id"], s["span_id"]) for s in spans}
    for span in spans:
        span["is_root"] = span["parent_span_id"] is None or (span["trace_id"], span["parent_span_id"]) not in ids
        span["input_messages"] = _messages(span["input_messages"])
        span["output_messages"] = _messages(span["output_messages"])
        index = call_at.get((span["trace_id"], span["span_id"]))
        span["call_index"] = index
        if index is None:
            continue
        span["matched_reward"] = float(matched[index]) if rewards else None
        span["transition"] = by_transition.get(f"{key}/{span['span_id']}")
        ids_ = span["completion_token_ids"] or []
        span["completion_tokens"] = decode(ids_) if decode is not None and ids_ else None
    first = min((s["start_time_unix_nano"] for s in spans if s["start_time_unix_nano"] is not None), default=None)
    last = max((s["end_time_unix_nano"] for s in spans if s["end_time_unix_nano"] is not None), default=None)
    summary = records(con.execute(_SUMMARY_SQL, at))[0]
    return {"rollout_key": key, **summary, **_capture(calls), "start_time_unix_nano": first,
            "end_time_unix_nano": last, "num_llm_calls": len(calls), "spans": spans, "rewards": rewards,
            "transitions": transitions, "truncated": truncated,
            "tokens_decoded": decode is not None and all(s.get("completion_tokens") is not None
                                                         for s in spans if s.get("completion_token_ids"))}
