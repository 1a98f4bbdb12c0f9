"""Hand-built span trees for the transition builder tests: one helper per kind of span."""

import json

import pyarrow as pa

from lightspan import store
from lightspan.lightningrl.builder import build_transitions
from lightspan.lightningrl.config import TransitionsConfig

T0 = 1_800_000_000 * 10**9          # spans happen around here (ns)
NOW = T0 + 3600 * 10**9             # builds run an hour later unless a test says otherwise
EPS = 1e-6

# --- hand-built span trees --------------------------------------------------------------------

_ids = iter(range(1, 10**9))


def span(rid, name, start, end, *, trace=None, task="t1", split="train", **cols):
    row = {f.name: None for f in store.SPAN_SCHEMA}
    row.update(trace_id=trace or f"{abs(hash(rid)) % 16**32:032x}", span_id=f"{next(_ids):016x}",
               name=name, kind="INTERNAL", service_name="agent", start_time_unix_nano=T0 + start,
               end_time_unix_nano=T0 + end, status_code="UNSET", rollout_id=rid, task_id=task,
               split=split, received_unix_nano=T0 + end)
    row.update(cols)
    return row


def call(rid, start, end, *, tokens=True, agent="solver", prompt=(1, 2, 3), completion=(4, 5),
         logprobs=None, version=3, finish=None, **kw):
    cols = dict(operation_name="chat", agent_name=agent, model_version=version,
                finish_reasons=None if finish is None else [finish])
    if tokens:
        cols.update(prompt_token_ids=list(prompt), completion_token_ids=list(completion),
                    completion_logprobs=list(logprobs if logprobs is not None else [-0.5] * len(completion)))
    return span(rid, "chat model", start, end, **cols, **kw)


def reward(rid, at, value, **kw):
    return span(rid, "lightspan.reward", at, at, reward=value, reward_name="reward", **kw)


def runner(rid, at, outcome="ok", *, attribute=True, **kw):
    attrs = [("lightspan.rollout.outcome", json.dumps(outcome))] if attribute else []
    return span(rid, "lightspan.runner", at, at, attributes=attrs,
                status_code="UNSET" if outcome == "ok" else "ERROR", **kw)


def episode(rid, r, *, task="t1", calls=1, **kw):
    """A finished rollout: `calls` LLM calls 0–10, 20–30, …, reward r after them, runner end."""
    rows = [call(rid, 20 * i, 20 * i + 10, task=task, **kw) for i in range(calls)]
    return rows + [reward(rid, 20 * calls, r, task=task, **kw), runner(rid, 20 * calls + 5, task=task, **kw)]


def write(d, rows):
    store.write_table(d, "spans", pa.Table.from_pylist(rows, schema=store.SPAN_SCHEMA),
                      partition="date=2026-11-30")


def build(d, now=NOW, **cfg):
    con = store.connect(d)
    try:
        return build_transitions(con, TransitionsConfig(data_dir=str(d), **cfg), now_unix_nano=now)
    finally:
        con.close()


def rows_by_id(table):
    return {r["transition_id"]: r for r in table.to_pylist()}


