"""The SQL part of a build: the spans in scope, the rollouts kept and why the others are not, and
the calls, rewards and groups of the ready rollouts, read from Parquet with DuckDB (the queries
are :mod:`.selection_sql`'s).

Steps 1-4 of the build (lightningrl/builder.py's module docstring): :func:`read_spans` takes the
light span columns of the rollouts in scope into temp tables (``_lrl_*``), deduplicates
re-sent spans, has the token lists of the candidates' spans decoded (:mod:`.tokens`, in
background threads while DuckDB works) and leaves in a :class:`Found` what the assignment
(:mod:`.assignment`) needs: the calls in action order, the rewards and the group of each ready
rollout, the drop counts and the rollouts still pending. :func:`drop_temp` removes the temp
tables and registered arrays from the connection afterwards.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import duckdb
import numpy as np
import pyarrow as pa

from lightspan import store
from lightspan.store.policies import owner
from lightspan.tracing import semconv

from .config import TransitionsConfig
from .selection_sql import (AGENT_KEY_SQL, AGENTS_SQL, CALLS_SQL, DEDUP_SQL, DROP_COPIES_SQL, DROPPED_CALLS_SQL,
                            FETCH_CALLS_SQL, FETCH_REWARDS_SQL, FINAL_SQL, NEW_FILES_SQL, READY_SQL, REGISTERED,
                            REWARDS_SQL, ROLLOUTS_SQL, SCOPE_SQL, SPANS_SQL, TASK_AGENTS_SQL, TEMP_TABLES,
                            TOKEN_ROWS_SQL, UNOWNED_SQL)
from .tokens import Reader, Tokens
from .watermark import Watermark

ROLLOUT_DROP_REASONS = ("split", "duplicate", "incomplete", "failed", "timeout", "infra", "time_window",
                        "no_token_ids", "agent_mismatch", "other_policy", "model_version", "truncated",
                        "not_selected", "no_reward", "small_group")
CALL_DROP_REASONS = ("duplicate", "agent_mismatch", "no_token_ids", "other_policy",
                     "truncated")  # DROPPED_CALLS_SQL order
PENDING_REASONS = ("incomplete", "small_group")
TRUNCATED_FINISH = ("length", "max_tokens")

def span_files(data_dir) -> list[str]:
    """The Parquet files holding ``data_dir``'s spans, as the ``spans`` view reads them."""
    return [str(p) for p in store.table_files(data_dir, "spans")]


@dataclass(frozen=True)
class Pass:
    """One policy's share of a build: its name (None: the unnamed policy of every matching call) and
    which attributed agents it owns."""

    policy: str | None
    owns: Callable[[str], bool]
    owned_by_any: Callable[[str], bool] = bool     # whether some policy owns the agent (policies only)


@dataclass
class Found:
    """What the SQL part of one build found for one :class:`Pass`; the defaults are an empty read."""

    scan: dict = field(default_factory=lambda: {
        "spans_read": 0, "duplicate_spans": 0, "token_files_read": 0, "already_built": 0})
    newest: int = -1                 # the latest received_unix_nano read
    drops: dict = field(default_factory=dict)
    dropped_calls: dict = field(default_factory=lambda: dict.fromkeys(CALL_DROP_REASONS, 0))
    truncated_calls: int = 0
    pending: list = field(default_factory=list)
    num_rollouts: int = 0
    calls: pa.Table | None = None
    rewards: pa.Table | None = None
    groups: pa.Table | None = None
    tokens: Tokens | None = None
    unowned: set = field(default_factory=set)   # ids of emitted rollouts' calls no policy owns


def passes(config: TransitionsConfig) -> list[Pass]:
    """The build's passes: one per configured policy, else one of the calls ``agent_match`` selects."""
    if not config.policy_configs:
        pattern = re.compile(config.agent_match)
        return [Pass(None, (lambda name: bool(pattern.search(name))) if config.agent_match else (lambda name: True))]
    policies = tuple(p for p, _ in config.policy_configs)
    # owner() raises ConfigError for an agent two agent_match patterns claim
    return [Pass(p.name, lambda name, p=p: owner(policies, name) is p, lambda name: owner(policies, name) is not None)
            for p in policies]


def read_spans(con, config: TransitionsConfig, since: Watermark, now: int, files: list[str],
               passes: list[Pass]) -> list[Found]:
    """Step 1: the spans in scope, deduplicated, into ``_lrl_spans``; then :func:`_select` for each
    of ``passes`` (its steps 2-5 over the same spans; token lists are decoded once).
    ``files``: the span files to read (:func:`span_files`); ``now``: the build's time."""
    found = Found(newest=since.received_unix_nano, pending=list(since.pending))
    if not files:
        return [dataclasses.replace(found, pending=list(found.pending)) for _ in passes]
    source = (f"read_parquet({store.quote_list(files)}, filename=true, file_row_number=true, "
              f"union_by_name=true, hive_partitioning=false)")
    source = f"({store.with_all_columns(con, 'spans', f'SELECT * FROM {source}')})"
    con.register("_lrl_files", pa.table({"filename": files, "fidx": np.arange(len(files))}))
    reader = Reader(files)
    try:
        where = ""
        if since.received_unix_nano >= 0:      # incremental: only what changed
            con.register("_lrl_pending", pa.table({"rollout_key": pa.array(found.pending, pa.string())}))
            con.execute(SCOPE_SQL.format(source=source), {"watermark": since.received_unix_nano})
            if not con.execute("SELECT count(*) FROM _lrl_scope").fetchall()[0][0]:
                return [dataclasses.replace(found, pending=list(found.pending)) for _ in passes]
            where = "WHERE coalesce(s.rollout_id, s.trace_id) IN (SELECT rollout_key FROM _lrl_scope)"
            reader.prefetch(f for (f,) in con.execute(NEW_FILES_SQL.format(source=source),
                                                      {"watermark": since.received_unix_nano}).fetchall())
        else:
            reader.prefetch(range(len(files)))
        # the files' token lists decode in the background while DuckDB reads the light columns
        if config.turn_select_sql:      # over the llm_calls view's columns: the span's and rollout_key
            source = f"(SELECT *, coalesce(rollout_id, trace_id) AS rollout_key FROM {source})"
            selected = f"coalesce(({config.turn_select_sql})::BOOLEAN, false)"
        else:
            selected = "true"
        con.execute(SPANS_SQL.format(source=source, where=where, selected=selected),
                    {"runner": semconv.SPAN_RUNNER, "outcome": semconv.ROLLOUT_OUTCOME,
                     "invoke_agent": semconv.OPERATION_INVOKE_AGENT,
                     "invoke_workflow": semconv.OPERATION_INVOKE_WORKFLOW, "tl_kind": semconv.TRACELOOP_SPAN_KIND,
                     "tl_entity": semconv.TRACELOOP_ENTITY_NAME, "reward_call": semconv.REWARD_CALL_SPAN_ID})
        read, newest = con.execute("SELECT count(*), max(received_unix_nano) FROM _lrl_spans").fetchall()[0]
        con.execute(DEDUP_SQL)
        copies = con.execute("SELECT sum(copies - 1) FROM _lrl_copies").fetchall()[0][0]
        if copies:
            con.execute(DROP_COPIES_SQL)
        con.execute(TASK_AGENTS_SQL)
        found.scan.update(spans_read=int(read or 0), duplicate_spans=int(copies or 0))
        found.newest = max(found.newest, -1 if newest is None else int(newest))
        out = []
        for p in passes:
            mine = dataclasses.replace(found, scan=dict(found.scan), pending=list(found.pending))
            _select(con, config, now, reader, mine, p)
            out.append(mine)
    finally:
        reader.close()
    return out


def _select(con, config: TransitionsConfig, now: int, reader: Reader, found: Found, p: Pass) -> None:
    """Steps 2–5 in SQL over ``_lrl_spans``: the calls, rewards and groups of the ready rollouts of
    pass ``p`` (its policy's agents)."""
    con.execute(ROLLOUTS_SQL, {
        "runner": semconv.SPAN_RUNNER, "root": semconv.SPAN_ROLLOUT, "split": config.split, "policy": p.policy,
        "ops": sorted(semconv.LLM_OPERATIONS), "cutoff": now - int(config.grace_s * 1e9),
        "since": config.since_unix_nano, "until": config.until_unix_nano,
        "dropped": [c for c, o in config.outcome_of.items() if o == "dropped"]})
    found.scan["already_built"] = con.execute("SELECT count(*) FROM _lrl_rollouts WHERE built").fetchall()[0][0]

    where = con.sql(TOKEN_ROWS_SQL).to_arrow_table()
    fidx = where.column("fidx").to_numpy()
    found.tokens, lengths = reader.read(fidx, where.column("frow").to_numpy())
    found.scan["token_files_read"] = len(np.unique(fidx))
    con.register("_lrl_tok", lengths)
    con.execute(CALLS_SQL, {"ops": sorted(semconv.LLM_OPERATIONS), "truncated": list(TRUNCATED_FINISH)})
    if con.execute("SELECT count(*) FROM _lrl_calls WHERE agent_name IS NULL").fetchall()[0][0]:
        con.execute(AGENTS_SQL)
        con.execute(AGENT_KEY_SQL)
    con.execute(REWARDS_SQL)
    names = [row[0] for row in con.execute(
        "SELECT DISTINCT agent_key FROM _lrl_calls WHERE NOT duplicate ORDER BY 1").fetchall()]
    agents = [n for n in names if p.owns(n)]
    owned = [n for n in names if p.owned_by_any(n)] if p.policy is not None else []
    con.execute(FINAL_SQL, {"agents": agents, "policy": p.policy, "min_group_size": config.min_group_size,
                             "group_by": config.group_by,
                             "drop_truncated": config.drop_truncated,
                             "vmin": config.min_model_version, "vmax": config.max_model_version})
    con.execute(READY_SQL, {"masked": [c for c, o in config.outcome_of.items() if o == "masked"]})
    found.drops = dict(con.execute(
        "SELECT reason, count(*) FROM _lrl_final WHERE reason IS NOT NULL GROUP BY reason").fetchall())
    found.drops.pop("built", None)         # done before: skipped, counted as already_built
    found.pending = [row[0] for row in con.execute(
        "SELECT rollout_key FROM _lrl_final WHERE list_contains($reasons::VARCHAR[], reason)",
        {"reasons": list(PENDING_REASONS)}).fetchall()]
    found.num_rollouts = con.execute("SELECT count(*) FROM _lrl_ready").fetchall()[0][0]
    params = {"agents": agents, "policy": p.policy, "drop_truncated": config.drop_truncated}
    found.calls = con.sql(FETCH_CALLS_SQL, params=params).to_arrow_table()
    found.rewards = con.sql(FETCH_REWARDS_SQL).to_arrow_table()
    found.groups = con.sql("SELECT gidx, outcome FROM _lrl_ready ORDER BY ridx").to_arrow_table()
    *counts, found.truncated_calls = con.execute(DROPPED_CALLS_SQL, params).fetchall()[0]
    found.dropped_calls = dict(zip(CALL_DROP_REASONS, counts))
    if p.policy is not None:     # calls of agents no policy owns, counted once however many passes see them
        found.unowned = {row[0] for row in con.execute(UNOWNED_SQL, {"owned": owned}).fetchall()}


def drop_temp(con: duckdb.DuckDBPyConnection) -> None:
    """Remove what :func:`read_spans` left on ``con``: its temp tables and registered arrays."""
    for name in TEMP_TABLES:
        con.execute(f"DROP TABLE IF EXISTS {name}")
    for name in REGISTERED:
        try:
            con.unregister(name)
        except duckdb.Error:
            pass
