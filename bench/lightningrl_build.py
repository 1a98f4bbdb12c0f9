"""Benchmark: 1M spans -> LightningRL transitions, against a per-rollout Python tree walk.

    .venv/bin/python bench/lightningrl_build.py [--rollouts 100000] [--baseline-rollouts 10000]

1. Generates ``--rollouts`` rollouts of 10 spans each (a ``lightspan.rollout`` root, an agent
   span, 4 multi-turn LLM calls whose prompts extend the previous call's prompt + completion
   + a tool turn, 2 tool spans, a reward span, the runner's end span) as Parquet files of the
   collector's layout, through ``store.write_table``. Tasks have 8 rollouts each. Generation
   time is not measured.
2. Times ``build_transitions`` (per-call output, identical credit, rollout-level GRPO) on the
   whole store, then the per-rollout output mode.
3. Times the baseline on the spans of the first ``--baseline-rollouts`` rollouts: load the
   span dicts, group them by rollout, walk each tree (children by start time) to its LLM
   calls, match the rewards, give the final reward to every call, compute GRPO advantages per
   task in Python — the approach of Agent Lightning's ``TracerTraceToTriplet`` adapter. Its
   time is scaled linearly to the full store (it is linear: one pass per rollout) and the
   script says so. Both results are checked against each other on the subsample.

Prints one JSON line with the numbers. Set ``--threads`` to the cores DuckDB may use.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lightspan.collector import store
from lightspan.lightningrl.builder import build_transitions
from lightspan.lightningrl.config import TransitionsConfig

T0 = 1_800_000_000 * 10**9
MS = 10**6
EOS, IM_START, NL, TOOL, ASSISTANT = 151645, 151644, 198, 14172, 77091
VOCAB = 151_000
CALLS, TOOLS, GROUP = 4, 2, 8
SPANS_PER_ROLLOUT = 4 + CALLS + TOOLS      # root, agent, reward, runner + calls + tools


# --- data -------------------------------------------------------------------------------------

def _lists(pieces: list[np.ndarray], dtype) -> pa.Array:
    """A list<dtype> array from one numpy array per row (None: a null row)."""
    lengths = np.array([0 if p is None else len(p) for p in pieces], dtype=np.int64)
    offsets = np.zeros(len(pieces) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([p for p in pieces if p is not None]).astype(dtype, copy=False)
    mask = pa.array([p is None for p in pieces])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), mask=mask)


def generate_chunk(first: int, count: int, rng: np.random.Generator, system: np.ndarray) -> pa.Table:
    """Spans of rollouts first .. first + count - 1, in SPAN_SCHEMA, sorted like the collector's."""
    cols: dict[str, list] = defaultdict(list)
    prompts, completions, logprobs = [], [], []
    task_prompts: dict[int, np.ndarray] = {}

    def span(i, sid, parent, name, start, end, **kw):
        trace = f"{i:032x}"
        cols["trace_id"].append(trace)
        cols["span_id"].append(f"{i:010x}{sid:06x}")
        cols["parent_span_id"].append(None if parent is None else f"{i:010x}{parent:06x}")
        cols["name"].append(name)
        cols["start_time_unix_nano"].append(start)
        cols["end_time_unix_nano"].append(end)
        cols["received_unix_nano"].append(end + 500 * MS)
        cols["rollout_id"].append(f"rollout-{i:08d}")
        cols["task_id"].append(f"task-{i // GROUP:06d}")
        for key in ("operation_name", "agent_name", "reward", "model_version", "finish_reasons", "attributes",
                    "input_tokens", "output_tokens", "status_code"):
            cols[key].append(kw.get(key))
        llm = kw.get("llm")
        prompts.append(llm[0] if llm else None)
        completions.append(llm[1] if llm else None)
        logprobs.append(llm[2] if llm else None)

    for i in range(first, first + count):
        task = i // GROUP
        if task not in task_prompts:
            task_prompts[task] = np.concatenate(
                [system, np.random.default_rng(task).integers(0, VOCAB, rng.integers(30, 300)),
                 [EOS, NL, IM_START, ASSISTANT, NL]])
        start = T0 + i * 10**9
        t = start + 5 * MS
        span(i, 1, None, "lightspan.rollout", start, start + 60_000 * MS, status_code="UNSET")
        span(i, 2, 1, "invoke_agent solver", t, start + 59_000 * MS, operation_name="invoke_agent",
             agent_name="solver")
        prompt, sid = task_prompts[task], 3
        version = i // 20_000
        for k in range(CALLS):
            completion = np.append(rng.integers(0, VOCAB, rng.integers(20, 150)), EOS)
            lp = -rng.exponential(0.7, len(completion)).astype(np.float32)
            dur = int(rng.integers(300, 3000)) * MS
            span(i, sid, 2, "chat policy", t, t + dur, operation_name="chat", agent_name="solver",
                 model_version=version, finish_reasons=["length" if rng.random() < 0.03 else "stop"],
                 input_tokens=len(prompt), output_tokens=len(completion), status_code="UNSET",
                 llm=(prompt, completion, lp))
            sid += 1
            t += dur + 10 * MS
            if k < TOOLS:
                tool_dur = int(rng.integers(10, 500)) * MS
                span(i, sid, 2, "execute_tool python", t, t + tool_dur, operation_name="execute_tool",
                     status_code="UNSET")
                sid += 1
                t += tool_dur
            if k < CALLS - 1:    # the next prompt: this one + completion + a tool or user turn
                turn = rng.integers(0, VOCAB, rng.integers(10, 100))
                prompt = np.concatenate([prompt, completion, [NL, IM_START, TOOL, NL], turn,
                                         [EOS, NL, IM_START, ASSISTANT, NL]])
        span(i, sid, 1, "lightspan.reward", t, t + MS, reward=float(rng.random() < 0.4 + 0.2 * (task % 3)))
        span(i, sid + 1, None, "lightspan.runner", t + 2 * MS, t + 3 * MS, status_code="UNSET",
             attributes=[("lightspan.rollout.outcome", '"ok"'), ("lightspan.rollout.exit_code", "0")])

    n = len(cols["trace_id"])
    arrays = {name: pa.array(values, store.SPAN_SCHEMA.field(name).type) for name, values in cols.items()}
    arrays["prompt_token_ids"] = _lists(prompts, np.int32)
    arrays["completion_token_ids"] = _lists(completions, np.int32)
    arrays["completion_logprobs"] = _lists(logprobs, np.float32)
    arrays["kind"] = pa.array(["INTERNAL"] * n)
    arrays["service_name"] = pa.array(["agent"] * n)
    arrays["split"] = pa.array(["train"] * n)
    arrays["capture_status"] = pa.array([None if p is None else "ok" for p in prompts], pa.string())
    table = pa.table({f.name: arrays.get(f.name, pa.nulls(n, f.type)) for f in store.SPAN_SCHEMA},
                     schema=store.SPAN_SCHEMA)
    return table


def generate(data_dir: Path, rollouts: int, *, seed: int = 0, per_file: int = 10_000) -> int:
    """Write the spans of ``rollouts`` rollouts, ``per_file`` rollouts per Parquet file."""
    rng = np.random.default_rng(seed)
    system = np.random.default_rng(12345).integers(0, VOCAB, 120)
    spans = 0
    for first in range(0, rollouts, per_file):
        table = generate_chunk(first, min(per_file, rollouts - first), rng, system)
        store.write_table(data_dir, "spans", table, partition="date=2027-01-15")
        spans += table.num_rows
    return spans


# --- the baseline: a per-rollout Python tree walk ---------------------------------------------

def baseline(files: list[str], rollouts: set[str] | None, *, epsilon: float = 1e-6) -> tuple[list[dict], dict]:
    """Agent Lightning's approach: span dicts -> trees -> triplets -> GRPO, all in Python."""
    t0 = time.perf_counter()
    spans = []
    for f in files:
        for row in pq.read_table(f).to_pylist():
            if rollouts is None or row["rollout_id"] in rollouts:
                spans.append(row)
    t_load = time.perf_counter()

    by_rollout: dict[str, dict[str, dict]] = defaultdict(dict)
    for s in spans:                          # at-least-once delivery: keep the first copy of a span
        key = s["rollout_id"] or s["trace_id"]
        by_rollout[key].setdefault((s["trace_id"], s["span_id"]), s)

    results = []
    for key, tree in by_rollout.items():
        nodes = list(tree.values())
        children = defaultdict(list)
        roots = []
        for s in nodes:
            (children[s["parent_span_id"]] if s["parent_span_id"] else roots).append(s)
        if not any(s["name"] == "lightspan.runner" for s in nodes):
            continue
        if any(s["name"] == "lightspan.runner" and s["status_code"] == "ERROR" for s in nodes):
            continue
        calls, rewards = [], []
        stack = sorted(roots, key=lambda s: s["start_time_unix_nano"], reverse=True)
        while stack:                          # depth first, children in start order
            s = stack.pop()
            if s["prompt_token_ids"] is not None:
                calls.append(s)
            if s["reward"] is not None:
                rewards.append(s)
            stack.extend(sorted(children[s["span_id"]], key=lambda c: c["start_time_unix_nano"], reverse=True))
        calls.sort(key=lambda s: (s["start_time_unix_nano"], s["end_time_unix_nano"], s["span_id"]))
        if not calls or not rewards:
            continue
        final = max(rewards, key=lambda s: (s["end_time_unix_nano"], s["span_id"]))["reward"]
        triplets = [{"prompt": c["prompt_token_ids"], "response": c["completion_token_ids"],
                     "logprobs": c["completion_logprobs"], "reward": final, "span_id": c["span_id"]}
                    for c in calls if c["completion_token_ids"]
                    and len(c["completion_logprobs"] or ()) == len(c["completion_token_ids"])]
        results.append({"rollout_id": key, "task_id": nodes[0]["task_id"], "reward": final, "triplets": triplets})

    by_task = defaultdict(list)
    for r in results:
        by_task[r["task_id"]].append(r)
    transitions = []
    for group in by_task.values():
        if len(group) < 2:
            continue
        rewards = [r["reward"] for r in group]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        for r in group:
            advantage = (r["reward"] - mean) / (std + epsilon)
            for i, t in enumerate(r["triplets"]):
                transitions.append({**t, "transition_id": f"{r['rollout_id']}/{t['span_id']}",
                                    "call_index": i, "advantage": advantage})
    t_end = time.perf_counter()
    return transitions, {"load_s": t_load - t0, "walk_s": t_end - t_load, "total_s": t_end - t0}


# --- the run ----------------------------------------------------------------------------------

def _build(data_dir: Path, **cfg) -> tuple[pa.Table, dict, float]:
    con = store.connect(data_dir)
    try:
        t0 = time.perf_counter()
        table, metrics = build_transitions(con, TransitionsConfig(data_dir=str(data_dir), **cfg),
                                           now_unix_nano=T0 + 10**15)
        return table, metrics, time.perf_counter() - t0
    finally:
        con.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=100_000)
    p.add_argument("--baseline-rollouts", type=int, default=10_000,
                   help="rollouts the Python walk runs on (its time is scaled linearly)")
    p.add_argument("--threads", type=int, default=2, help="DuckDB threads")
    p.add_argument("--dir", default=None, help="keep the generated store here (default: a temp dir)")
    args = p.parse_args(argv)
    os.environ["DUCKDB_THREADS"] = str(args.threads)
    import duckdb
    duckdb.default_connection().execute(f"SET threads = {args.threads}")

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(args.dir or tmp)
        t0 = time.perf_counter()
        spans = generate(data_dir, args.rollouts)
        gen_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in (data_dir / "spans").rglob("*.parquet"))
        print(f"generated {spans} spans of {args.rollouts} rollouts ({size / 2**20:.0f} MiB Parquet) "
              f"in {gen_s:.1f} s (not timed)", file=sys.stderr)

        table, metrics, build_s = _build(data_dir)
        tokens = int(pc.sum(pc.list_value_length(table.column("prompt_token_ids"))).as_py()) + \
            metrics["transitions/completion_tokens"]
        print(f"build_transitions (per_call): {build_s:.2f} s -> {table.num_rows} transitions, "
              f"{metrics['transitions/rollouts']} rollouts, {tokens / 1e6:.0f} M tokens", file=sys.stderr)
        del table
        seq, seq_metrics, seq_s = _build(data_dir, output="per_rollout")
        print(f"build_transitions (per_rollout): {seq_s:.2f} s -> {seq.num_rows} sequences", file=sys.stderr)

        files = sorted(str(f) for f in (data_dir / "spans").rglob("*.parquet"))
        sub = args.baseline_rollouts
        sample_files = files[:math.ceil(sub / 10_000)]
        wanted = {f"rollout-{i:08d}" for i in range(sub)}
        walk, times = baseline(sample_files, wanted)
        scale = args.rollouts / sub
        # the subsample's own builder result, to check that both compute the same thing
        check = {r["transition_id"]: r["advantage"] for r in seq.slice(0, 0).to_pylist()}
        ours = {r["transition_id"]: r["advantage"]
                for r in _build_subset(data_dir, sample_files).to_pylist()}
        check = {t["transition_id"]: t["advantage"] for t in walk}
        agree = set(ours) == set(check) and all(abs(ours[k] - check[k]) < 1e-9 for k in check)
        result = {
            "spans": spans, "rollouts": args.rollouts, "threads": args.threads,
            "parquet_mib": round(size / 2**20),
            "build_per_call_s": round(build_s, 2), "build_per_rollout_s": round(seq_s, 2),
            "transitions": metrics["transitions/calls"], "sequences": seq_metrics["transitions/sequences"],
            "baseline_rollouts": sub, "baseline_load_s": round(times["load_s"], 2),
            "baseline_walk_s": round(times["walk_s"], 2),
            "baseline_total_scaled_s": round(times["total_s"] * scale, 1),
            "baseline_walk_scaled_s": round(times["walk_s"] * scale, 1),
            "speedup_total": round(times["total_s"] * scale / build_s, 1),
            "speedup_walk_only": round(times["walk_s"] * scale / build_s, 1),
            "baseline_agrees_on_subsample": agree,
        }
        print(json.dumps(result))
    return 0


def _build_subset(data_dir: Path, files: list[str]) -> pa.Table:
    """The builder on just the baseline's files (same rollouts), for the agreement check."""
    with tempfile.TemporaryDirectory() as sub:
        for f in files:
            dest = Path(sub) / "spans" / "date=2027-01-15"
            dest.mkdir(parents=True, exist_ok=True)
            os.link(f, dest / Path(f).name)
        table, _, _ = _build(Path(sub))
        return table


if __name__ == "__main__":
    sys.exit(main())
