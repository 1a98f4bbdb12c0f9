"""``lightspan export``: rollouts, LLM calls or transitions as a dataset (JSONL or Parquet), filtered,
for evaluation or supervised fine-tuning elsewhere.

- ``calls``: one row per LLM call (the ``llm_calls`` view): its rollout, task, split, agent, model
  and policy version, the chat messages in and out, the token ids and sampled-token logprobs,
  and the rollout's final reward and status.
- ``rollouts``: one row per rollout (the ``rollouts`` view) with its calls' messages in order and
  every reward it got (name, value, source, comment, correction).
- ``transitions``: the training transitions, the newest build of each.

In JSONL the messages are JSON (the instrumentation's ``gen_ai.*.messages`` parsed), one object
per line, strict JSON (a NaN is null: :func:`lightspan.store.sql.jsonable`); in Parquet they stay JSON text, and lists stay typed lists. The file is written to a
temporary name and renamed, so a reader never sees half of it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lightspan.core.config import ConfigError, option
from lightspan.store.layout import DATA_DIR_ENV, DEFAULT_DATA_DIR
from lightspan.store.sql import jsonable
from lightspan.store.views import connect, retry_vanished

WHAT = ("calls", "rollouts", "transitions")
FORMATS = ("jsonl", "parquet", "otlp-json")
OTLP_JSON = "otlp-json"
"""The stored spans themselves, as OTLP/JSON export requests one per line (the OTel Collector file
exporter's format; ``.gz``/``.zst`` by the file's name), written by ``lightspan.collector.otlp_files``."""
_MESSAGE_COLUMNS = ("input_messages", "output_messages", "messages", "rewards")

_CALLS = """
SELECT c.rollout_key, c.task_id, coalesce(c.split, 'train') AS split, c.agent_name, c.trace_id, c.span_id,
       c.start_time_unix_nano, c.request_model, c.model_version, c.temperature, c.finish_reasons,
       c.input_messages, c.output_messages, c.prompt_token_ids, c.completion_token_ids, c.completion_logprobs,
       r.final_reward, r.status
FROM llm_calls c LEFT JOIN rollouts r USING (rollout_key)
WHERE TRUE {where}
ORDER BY c.rollout_key, c.start_time_unix_nano, c.span_id
"""
_ROLLOUTS = """
WITH calls AS (
    SELECT rollout_key, to_json(list({{'agent_name': agent_name, 'input_messages': input_messages,
                                       'output_messages': output_messages}} ORDER BY start_time_unix_nano, span_id))
           AS messages
    FROM llm_calls GROUP BY rollout_key),
given AS (
    SELECT rollout_key, to_json(list({{'name': reward_name, 'value': reward, 'source': source, 'comment': comment,
                                       'correction': correction, 'call_span_id': call_span_id}}
                                     ORDER BY received_unix_nano, time_unix_nano, span_id)) AS rewards
    FROM rewards GROUP BY rollout_key)
SELECT r.rollout_key, r.task_id, coalesce(r.split, 'train') AS split, r.model_version, r.final_reward, r.status,
       r.outcome, r.num_llm_calls, r.start_time_unix_nano, r.end_time_unix_nano, calls.messages, given.rewards
FROM rollouts r LEFT JOIN calls USING (rollout_key) LEFT JOIN given USING (rollout_key)
WHERE TRUE {where}
ORDER BY r.start_time_unix_nano, r.rollout_key
"""
_TRANSITIONS = """
SELECT * EXCLUDE (created_unix_nano), created_unix_nano FROM transitions
WHERE TRUE {where}
QUALIFY row_number() OVER (PARTITION BY transition_id ORDER BY created_unix_nano DESC) = 1
ORDER BY rollout_id, call_index, transition_id
"""


@dataclass(frozen=True)
class ExportConfig:
    what: str = option("calls", "What one row is: an LLM call, a rollout, or a training transition.", choices=WHAT)
    out: str = option("", "The file to write; .jsonl or .parquet names the format unless --format says.")
    format: str = option("", "jsonl or parquet; empty: from the file name's suffix.")
    data_dir: str = option(DEFAULT_DATA_DIR, "Data directory to export from.", env=DATA_DIR_ENV)
    split: str = option("", "Only this split (train, val); empty: every split.")
    task: str = option("", "Only this task id.")
    agent: str = option("", "Only calls (or transitions) of agents whose name this Python regex finds (calls, transitions).")
    policy_version: int = option(-1, "Only rollouts, calls or transitions of this policy version; -1: any.")
    min_reward: float = option(float("-inf"), "Only rollouts (or their calls) whose final reward is at least this.")
    status: str = option("", "Only rollouts of this status: rewarded, unrewarded, failed or timeout (calls, rollouts).")
    limit: int = option(0, "At most this many rows; 0: all.")
    since: str = option("", "otlp-json: only spans that started at or after this time (ISO 8601, e.g. "
                            "2026-11-30T12:00:00Z, or Unix nanoseconds).")
    until: str = option("", "otlp-json: only spans that started before this time (ISO 8601 or Unix nanoseconds).")
    where: str = option("", "otlp-json: only spans for which this DuckDB SQL condition over the spans view's "
                            "columns holds, e.g. \"rollout_id = 'r-1'\" or \"service_name = 'agent'\".")

    def __post_init__(self):
        if not self.out:
            raise ConfigError("export", "out", "no output file given", "pass --out FILE.jsonl (or .parquet)")
        if self.resolved_format not in FORMATS:
            raise ConfigError("export", "format", f"cannot tell the format of {self.out!r}",
                              "pass --format jsonl or --format parquet, or name the file *.jsonl / *.parquet")
        if self.agent:
            try:
                re.compile(self.agent)
            except re.error as exc:
                raise ConfigError("export", "agent", f"{self.agent!r} is not a regex ({exc})", "pass a Python regex") from None
        if self.limit < 0:
            raise ConfigError("export", "limit", "must be >= 0", "pass --limit 0 (all) or more")

        for name in ("since", "until"):
            if getattr(self, name):
                try:
                    time_ns(getattr(self, name))
                except ValueError:
                    raise ConfigError("export", name, f"{getattr(self, name)!r} is not a time",
                                      "give ISO 8601 (2026-11-30T12:00:00Z) or Unix nanoseconds") from None

    @property
    def resolved_format(self) -> str:
        return self.format or Path(self.out).suffix.lstrip(".").lower()


def time_ns(text: str) -> int:
    """Unix nanoseconds of ``text``: an integer, or an ISO 8601 time (UTC unless it says)."""
    from datetime import datetime, timezone

    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp()) * 10**9 + moment.microsecond * 1000


def spans(cfg: ExportConfig) -> pa.Table:
    """The stored spans an ``otlp-json`` export writes: a time range and a SQL condition, in
    start order (``cfg.where`` is the caller's own SQL over their own data, on a read-only view)."""
    where, params = [], {}
    if cfg.since:
        where.append("start_time_unix_nano >= $since")
        params["since"] = time_ns(cfg.since)
    if cfg.until:
        where.append("start_time_unix_nano < $until")
        params["until"] = time_ns(cfg.until)
    if cfg.where:
        where.append(f"({cfg.where})")
    sql = (f"SELECT * FROM spans WHERE {' AND '.join(where) or 'TRUE'} "
           "ORDER BY start_time_unix_nano, trace_id, span_id" + (f" LIMIT {int(cfg.limit)}" if cfg.limit else ""))

    def read() -> pa.Table:
        con = connect(cfg.data_dir)
        try:
            return con.sql(sql, params=params).to_arrow_table()
        finally:
            con.close()

    return retry_vanished(read)


def query(cfg: ExportConfig) -> tuple[str, list]:
    """The export's SQL and its parameters."""
    where, params = [], []
    version_col, prefix = {"calls": ("c.model_version", "c."), "rollouts": ("r.model_version", "r."),
                           "transitions": ("model_version", "")}[cfg.what]
    if cfg.split:
        where.append(f"coalesce({prefix}split, 'train') = ?")
        params.append(cfg.split)
    if cfg.task:
        where.append(f"{prefix}task_id = ?")
        params.append(cfg.task)
    if cfg.policy_version >= 0:
        where.append(f"{version_col} = ?")
        params.append(cfg.policy_version)
    if cfg.agent and cfg.what != "rollouts":
        where.append(f"regexp_matches(coalesce({prefix}agent_name, ''), ?)")
        params.append(cfg.agent)
    if cfg.min_reward != float("-inf"):
        where.append({"calls": "r.final_reward", "rollouts": "r.final_reward", "transitions": "reward"}[cfg.what] + " >= ?")
        params.append(cfg.min_reward)
    if cfg.status and cfg.what != "transitions":
        where.append("r.status = ?")
        params.append(cfg.status)
    template = {"calls": _CALLS, "rollouts": _ROLLOUTS, "transitions": _TRANSITIONS}[cfg.what]
    sql = template.format(where="".join(f" AND {w}" for w in where))
    return sql + (f" LIMIT {int(cfg.limit)}" if cfg.limit else ""), params


def _jsonl_row(row: dict) -> dict:
    """A row as one JSONL object: values as :func:`lightspan.store.sql.jsonable` (NaN as null, bytes
    as base64), the message columns parsed."""
    row = {key: jsonable(value) for key, value in row.items()}
    for key in _MESSAGE_COLUMNS:
        if isinstance(row.get(key), str):
            try:
                row[key] = json.loads(row[key])
            except ValueError:
                pass          # not JSON as the instrumentation wrote it: kept as text
    return row


def write(cfg: ExportConfig) -> dict:
    """Write the export; returns ``{"rows": n, "out": path, "format": f}``."""
    sql, params = query(cfg)

    def read() -> pa.Table:
        con = connect(cfg.data_dir)
        try:
            return con.sql(sql, params=params).to_arrow_table()
        finally:
            con.close()

    table = retry_vanished(read)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    if cfg.resolved_format == "parquet":
        pq.write_table(table, tmp, compression="zstd")
    else:
        with open(tmp, "w") as fh:
            for row in table.to_pylist():
                fh.write(json.dumps(_jsonl_row(row), allow_nan=False) + "\n")
    os.replace(tmp, out)
    return {"rows": table.num_rows, "out": str(out), "format": cfg.resolved_format}
