"""The transition builder: spans in, LightningRL transitions and a metrics dict out
(docs/architecture.md, "LightningRL").

The set-based work is SQL in DuckDB over the light span columns. The token lists, nearly all
the bytes, never pass through SQL: pyarrow decodes them once (:mod:`.tokens`), in background
threads while DuckDB works, from the files that hold new spans (a file that turns out to hold
no candidate is dropped, unread if its turn has not come), and the output takes them without a
copy. Python applies the pure credit and advantage functions to whole numpy columns, all
rollouts at once. Steps 1-4 below are the SQL selection (:mod:`.selection`), 5 and 6 the
assignment (:mod:`.assignment`); this module runs a build and writes it. One build:

1. Scope: every span (a full build), or (an incremental build, :mod:`.watermark`) the rollouts
   with a span received after the watermark plus the ones the last build left pending.
   Spans are grouped by rollout key (rollout id, else trace id) and deduplicated on
   (trace_id, span_id), first copy received wins. A trace counts as a rollout if it has a
   rollout id or a GenAI call span. Rollouts already in ``transitions`` are skipped (the
   anti-join: never emitted twice).
2. Each rollout is kept or dropped with the first reason that applies, in this order:
   ``split`` (not ``config.split``; a rollout without one is ``train``), ``duplicate`` (built
   before, and spans of it were received after that build — a late reward or a re-sent batch
   that is ignored), ``incomplete`` (no ``lightspan.runner`` end span and a span that ended
   within ``grace_s``; reconsidered next build), ``failed`` / ``timeout`` / ``infra`` when
   ``outcomes`` drops that cause (the runner's outcome; a runner span without the outcome
   attribute is failed iff its status is ERROR; a ``lightspan.rollout`` root span with status
   ERROR is also failed; by default only ``infra`` is dropped, and the agent's failures train
   as ``failed`` with their real reward, or ``masked``: in the baseline, zero loss), ``time_window`` (started
   before ``since`` or at/after ``until``), ``no_token_ids`` (no LLM call at all),
   ``agent_mismatch`` (no call of an agent matching ``agent_match``), ``no_token_ids`` (no
   matching call with token ids), ``other_policy`` (every such call was served by another named
   policy, step 7), ``model_version`` (a matching call with token ids served by a
   version outside [min_model_version, max_model_version]), ``truncated`` (``drop_truncated`` and
   every such call stopped at the length limit), ``not_selected`` (no such call passes
   ``turn_select_sql``), ``no_reward`` (no finite reward: a failed rollout without one too),
   ``small_group`` (fewer than ``min_group_size`` rollouts of its task left in this build).
3. An LLM call is a span with token ids or a GenAI operation name (as the ``llm_calls`` view).
   Nested LLM call spans (two instrumentations of one request) collapse into one: the inner
   span with token ids is kept, the others are dropped as ``duplicate`` calls, as is every span
   the instrumentor marked ``lightspan.capture.status = duplicate``. A call belongs to the agent
   of the nearest span, itself included, that is an agent span: one carrying
   ``gen_ai.agent.name``, or ``gen_ai.operation.name = invoke_agent`` (named by its span name
   ``invoke_agent {name}``), or traceloop's ``traceloop.span.kind = agent`` (named by
   ``traceloop.entity.name``), or a traceloop ``task`` span whose entity name is the name of an
   agent span of the same rollout (a LangGraph node that runs an agent's graph: langgraph-
   supervisor's ``supervisor`` and ``create_react_agent`` agents, whose own ``invoke_agent`` span
   is a sibling of the node's spans, not their parent); with none, to the resource's
   ``service.name``.
4. A group is the rollouts of one task among those kept in this build (a rollout without a
   task id is a group of its own). Rollouts already built or still incomplete never join a
   later group: a straggler that completes after its siblings were built is a group of one.
5. A rollout's actions are its calls of a matching agent, ordered by (start, end, span id).
   Rewards are matched to them (``credit.rewards_per_call``), the credit policy gives one
   credit per call, the estimator gives per-call advantages against the group's rollout
   returns (``identical``: the final reward; ``discounted``: G_0). Calls without token ids
   (missing prompt or completion ids, or logprobs not one per completion token), with
   ``drop_truncated`` truncated calls, and calls that turn selection leaves out (not passing
   ``turn_select_sql``, or before a rollout's last ``turn_last_k`` trainable calls) keep their
   place in the credit computation but are not emitted.
6. Output ``per_call``: one row per emitted call. ``per_rollout``: the emitted calls of one
   rollout and agent merged into sequences (:mod:`.sequences`); a row carries its first
   call's id, call index, credit and advantage — under ``identical`` that is the rollout's
   advantage; under ``discounted`` the return-to-go from the sequence's first call (a
   sequence is credited with every reward from its start on, none from before it), which is
   G_0 for a sequence that starts at the first call — and the oldest model version of its
   calls (staleness is bounded by the oldest policy that wrote it). A prefix mismatch starts a
   new *segment* of the rollout: its own row, credited as its first call is (credit flows across
   segments), with ``segment`` and ``segment_cause`` (the mismatch kind). Every row carries
   ``rollout_rows`` (its rollout's rows in this build, for a loss normalised per rollout),
   ``outcome`` (ok, failed, masked) and ``loss_weight`` (0 for masked).

7. Several policies (``policies``, lightspan/store/policies.py): steps 2-6 run once per policy
   over the spans step 1 read (token lists decoded once), the policy's owned agents as the
   matching ones: its own anti-join (a rollout built for one policy is still unbuilt for
   another), its own groups (the rollouts of one task that have its calls), its own credit,
   gamma and advantage, its rows marked ``policy``. A reward is matched among that policy's calls
   (step 5), so under ``discounted`` a policy's return counts the rewards from its own calls on. A
   call of its agents that recorded another policy (``lightspan.policy.name``: served by another
   adapter, whose logprobs these are) is not trained: ``other_policy``. A call that records no
   policy is its owner's.

Drop counts are per build. A full build counts every unbuilt rollout again; an incremental
build counts the rollouts it read (new spans, or pending). Two builds must not run at once on
one data dir.

Metrics (one build):

- ``transitions/rollouts``, ``/groups``: rollouts and task groups emitted;
  ``/group_size_mean``: rollouts per emitted group.
- ``transitions/calls``: LLM calls whose completion is trained; ``/sequences``: rows emitted
  (= calls with ``per_call``).
- ``transitions/reward_mean``, ``/reward_std``: the emitted rollouts' final rewards;
  ``/return_mean``: the rollout returns the baselines use (= reward_mean under ``identical``);
  ``/advantage_abs_mean``: mean |Â| over the rows (NaN when nothing was emitted).
- ``transitions/nonzero_advantage``: rows that carry a gradient (|Â| > 0).
- ``transitions/zero_std_groups``: groups whose returns are all equal, so they carry no
  rollout-level learning signal (every Â is 0 under ``identical``).
- ``transitions/completion_tokens``: sampled (mask 1) completion tokens emitted;
  ``/masked_tokens``: completion tokens with mask 0 (``per_rollout``: tool and user turns).
- ``transitions/truncated_calls``: emitted rollouts' matching calls with token ids that stopped
  at the length limit, dropped or not.
- ``transitions/prefix_mismatch/<kind>``: ``per_rollout`` calls that could not extend their
  sequence, by kind (``sequences.classify_mismatch``): ``compaction``, ``chat_template``,
  ``retokenization``, ``tool_text``, ``reply_dropped``.
- ``transitions/rows_per_rollout_mean``, ``/rows_per_rollout_max``: rows per emitted rollout;
  ``/merge_rate``: the share of emitted rollouts written as one row.
- ``transitions/outcomes/<ok|failed|masked>``: emitted rollouts by outcome.
- ``transitions/dropped_rollouts/<reason>``: rollouts not emitted, by first reason (above).
- ``transitions/dropped_calls/duplicate``, ``/agent_mismatch``, ``/no_token_ids``,
  ``/other_policy``, ``/truncated``, ``/not_selected``: LLM call spans of *emitted* rollouts that are not trained;
  with ``/calls`` they add up to all their LLM call spans.
- With policies, each policy's metrics (all of the above but ``spans_read`` and
  ``duplicate_spans``) are ``transitions/policies/<name>/...``; the top-level ones add the
  policies' up (a rollout emitted for two policies counts twice), the means weighted by what
  they average over and ``reward_std`` pooled, except ``dropped_calls/agent_mismatch``: the calls
  of emitted rollouts that *no* policy owns, each once.
- ``transitions/duplicate_spans``: re-sent copies of spans among those read (ignored).
- ``transitions/already_built``: rollouts read that earlier builds emitted (skipped).
- ``transitions/spans_read``: span rows read (both copies of a re-sent span count);
  ``/token_files_read``: Parquet files whose token lists were decoded.
- ``transitions/pending_rollouts``: rollouts the next incremental build reads again without a
  new span (``incomplete``, ``small_group``); ``/watermark_unix_nano``: the next watermark.
- ``transitions/build_seconds``: wall time of the build (not the write).
"""


from __future__ import annotations

import logging
import math
import time

import duckdb
import pyarrow as pa

from lightspan import store
from lightspan.core.progress import progress

from . import selection
from . import watermark as wm
from .assignment import assign, empty_stats
from .config import TransitionsConfig
from .watermark import Watermark

log = logging.getLogger(__name__)


def build_transitions(con: duckdb.DuckDBPyConnection, config: TransitionsConfig, *,
                      now_unix_nano: int | None = None) -> tuple[pa.Table, dict]:
    """Build the transitions of every complete, not yet built rollout of ``config.split``.

    ``con`` has the store's views (``store.connect(config.data_dir)``); spans are read from
    ``config.data_dir``'s Parquet files. Returns a table in exactly ``store.TRANSITION_SCHEMA``
    (empty when nothing is ready) and the build's metrics. Reads every span; nothing is
    written: see :func:`build_incremental` and :func:`run`.
    """
    table, metrics, _ = build_incremental(con, config, Watermark(), now_unix_nano=now_unix_nano)
    return table, metrics


def build_incremental(con: duckdb.DuckDBPyConnection, config: TransitionsConfig, since: Watermark, *,
                      now_unix_nano: int | None = None) -> tuple[pa.Table, dict, Watermark]:
    """:func:`build_transitions` over the rollouts changed since ``since``; also returns the next
    watermark, to be saved (``watermark.save``) once the table is written."""
    t0 = time.perf_counter()
    now = time.time_ns() if now_unix_nano is None else int(now_unix_nano)
    passes = selection.passes(config)
    try:
        founds = selection.read_spans(con, config, since, now, selection.span_files(config.data_dir), passes)
    finally:
        selection.drop_temp(con)
    own_config = {p.name: c for p, c in config.policy_configs}
    tables, per_pass = [], []
    for p, found in zip(passes, founds):
        if found.num_rollouts:      # each policy's own credit, gamma and advantage
            table, stats = assign(found.calls, found.rewards, found.groups, found.tokens, found.num_rollouts,
                                  own_config.get(p.policy, config), now, p.policy)
        else:
            table, stats = store.TRANSITION_SCHEMA.empty_table(), empty_stats()
        tables.append(table)
        per_pass.append(_pass_metrics(found, stats))
    # never past spans that may still be on their way to Parquet; never backwards
    lag = now - int(config.watermark_lag_s * 1e9)
    pending = sorted({key for found in founds for key in found.pending})
    next_mark = Watermark(max(since.received_unix_nano, min(founds[0].newest, lag)), tuple(pending))

    if config.policy_configs:
        metrics = combined(dict(zip((p.policy for p in passes), per_pass)),
                           unowned=len(set().union(*(found.unowned for found in founds))))
    else:
        metrics = per_pass[0]
    metrics["transitions/pending_rollouts"] = len(next_mark.pending)
    metrics["transitions/watermark_unix_nano"] = next_mark.received_unix_nano
    metrics["transitions/build_seconds"] = time.perf_counter() - t0
    return pa.concat_tables(tables), metrics, next_mark


def _pass_metrics(found: selection.Found, stats: dict) -> dict:
    """The ``transitions/*`` metrics of one policy's pass."""
    metrics: dict = {"transitions/rollouts": int(found.num_rollouts), **stats,
                     "transitions/truncated_calls": int(found.truncated_calls)}
    for reason in selection.ROLLOUT_DROP_REASONS:
        metrics[f"transitions/dropped_rollouts/{reason}"] = int(found.drops.get(reason, 0))
    for reason in selection.CALL_DROP_REASONS:
        metrics[f"transitions/dropped_calls/{reason}"] = int(found.dropped_calls[reason] or 0)
    for key, value in found.scan.items():
        metrics[f"transitions/{key}"] = int(value)
    return metrics


_SHARED = ("transitions/spans_read", "transitions/duplicate_spans")   # step 1: one read for every pass
_WEIGHTED = {"transitions/reward_mean": "transitions/rollouts", "transitions/return_mean": "transitions/rollouts",
             "transitions/advantage_abs_mean": "transitions/sequences",
             "transitions/group_size_mean": "transitions/groups",
             "transitions/rows_per_rollout_mean": "transitions/rollouts", "transitions/merge_rate": "transitions/rollouts"}
_MAX = ("transitions/token_files_read", "transitions/rows_per_rollout_max")


def combined(by_policy: dict[str, dict], *, unowned: int) -> dict:
    """The metrics of a build with policies: each policy's under ``transitions/policies/<name>/``,
    and at the top the counts added over the policies (a rollout emitted for two policies counts
    twice), the means weighted by what they average over, ``reward_std`` pooled, and
    ``dropped_calls/agent_mismatch`` = ``unowned``: calls of emitted rollouts that no policy owns."""
    first = next(iter(by_policy.values()))
    out = {}
    for key, value in first.items():
        values = [m[key] for m in by_policy.values()]
        if key in _SHARED:
            out[key] = value
        elif key in _MAX:
            out[key] = max(values)
        elif key in _WEIGHTED:
            out[key] = _mean(values, [m[_WEIGHTED[key]] for m in by_policy.values()])
        elif key == "transitions/reward_std":
            out[key] = _pooled_std(by_policy.values())
        else:
            out[key] = sum(values)
    out["transitions/dropped_calls/agent_mismatch"] = unowned
    for name, metrics in by_policy.items():
        out.update({f"transitions/policies/{name}/{key.removeprefix('transitions/')}": value
                    for key, value in metrics.items() if key not in _SHARED})
    return out


def _mean(values, weights) -> float:
    pairs = [(v, w) for v, w in zip(values, weights) if w]
    return sum(v * w for v, w in pairs) / sum(w for _, w in pairs) if pairs else math.nan


def _pooled_std(metrics) -> float:
    """The population std of the rollouts' rewards over every policy, from each policy's n, mean, std."""
    parts = [(m["transitions/rollouts"], m["transitions/reward_mean"], m["transitions/reward_std"])
             for m in metrics if m["transitions/rollouts"]]
    if not parts:
        return math.nan
    n = sum(k for k, _, _ in parts)
    mean = sum(k * mu for k, mu, _ in parts) / n
    return math.sqrt(sum(k * (sd ** 2 + (mu - mean) ** 2) for k, mu, sd in parts) / n)


def run(config: TransitionsConfig, *, now_unix_nano: int | None = None) -> dict:
    """One build over ``config.data_dir``: write the new transitions (if any), then (incremental)
    the watermark, and return the metrics. A crash in between costs a re-read, never a duplicate."""
    since = wm.load(config) if config.incremental else Watermark()

    def build():
        con = store.connect(config.data_dir)
        try:
            return build_incremental(con, config, since, now_unix_nano=now_unix_nano)
        finally:
            con.close()

    with progress(f"transitions build ({config.split})") as bar:
        table, metrics, next_mark = store.retry_vanished(build)
        bar.update(f"{metrics['transitions/rollouts']} rollouts, {table.num_rows} rows, "
                   f"{metrics['transitions/spans_read']} spans read")
        bar.advance(table.num_rows)
    if table.num_rows:
        path = store.write_table(config.data_dir, "transitions", table)
        log.info("wrote %d transitions (%d calls) of %d rollouts in %d groups to %s (reward mean %.4f)",
                 table.num_rows, metrics["transitions/calls"], metrics["transitions/rollouts"],
                 metrics["transitions/groups"], path, metrics["transitions/reward_mean"])
    else:
        log.info("no complete rollout to build in %s (%d spans read)", config.data_dir,
                 metrics["transitions/spans_read"])
    if config.incremental and next_mark != since:
        wm.save(config, next_mark)
    dropped = {k.removeprefix("transitions/"): v for k, v in metrics.items()
               if k.startswith("transitions/dropped_") and v}
    if dropped:
        log.info("dropped: %s", ", ".join(f"{k}={v}" for k, v in sorted(dropped.items())))
    return metrics

