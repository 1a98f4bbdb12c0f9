"""Benchmark: 1M spans -> LightningRL transitions, side by side with a per-rollout Python tree walk.

    .venv/bin/python bench/lightningrl_build.py [--rollouts 100000] [--cores 2] [--repeat 3]

1. Generates ``--rollouts`` rollouts of 10 spans (a ``lightspan.rollout`` root, an agent span,
   4 multi-turn LLM calls whose prompts extend the previous prompt + completion + a tool turn
   — ~500 prompt and ~85 completion tokens a call on average, with logprobs —, 2 tool spans, a
   reward span, the runner's end span) with ``store.write_table``, 10,000 rollouts per Parquet
   file as the collector writes them (sorted by rollout). Tasks have 8 rollouts. Not timed.
2. Times ``build_transitions`` (identical credit, rollout-level GRPO) over the whole store,
   per-call output and per-rollout output, each ``--repeat`` times, each in a fresh process
   (as ``lightspan transitions build`` runs) pinned to ``--cores`` cores, with DuckDB and
   pyarrow limited to as many threads. Reports the fastest run and the median.
3. Times the baseline on the first ``--baseline-rollouts`` rollouts, in a fresh process: load the
   span dicts from Parquet, group them by rollout, build each trace tree from parent links,
   walk it (children by start time) for the LLM-call spans (span-name regex, the approach of
   Agent Lightning's trace-to-triplet adapter), give the rollout's final reward to every call, and
   compute GRPO advantages per task in Python. It is linear in the rollouts (one independent
   walk each), so its time is scaled to the whole store, and the output says so. On that
   subsample the builder's transitions are checked to equal the walk's (ids and advantages).

Prints a summary and one JSON line (the numbers recorded in bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lightspan import store

T0 = 1_800_000_000 * 10**9
MS = 10**6
EOS, IM_START, NL, TOOL, ASSISTANT = 151645, 151644, 198, 14172, 77091     # Qwen-style template ids
VOCAB = 151_000
CALLS, TOOLS, GROUP, PER_FILE = 4, 2, 8, 10_000


# --- data -------------------------------------------------------------------------------------

def _lists(pieces: list, dtype) -> pa.Array:
    """A list<dtype> array with one numpy array per row (None: a null row)."""
    lengths = np.array([0 if p is None else len(p) for p in pieces], dtype=np.int64)
    offsets = np.zeros(len(pieces) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([p for p in pieces if p is not None]).astype(dtype, copy=False)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), mask=pa.array([p is None for p in pieces]))


def generate_chunk(first: int, count: int, rng: np.random.Generator, system: np.ndarray) -> pa.Table:
    """The spans of rollouts first .. first + count - 1, in SPAN_SCHEMA."""
    cols: dict[str, list] = defaultdict(list)
    heavy: dict[str, list] = defaultdict(list)
    keys = ("operation_name", "agent_name", "reward", "model_version", "finish_reasons", "attributes",
            "input_tokens", "output_tokens")

    def span(i, sid, parent, name, start, end, llm=None, **kw):
        cols["trace_id"].append(f"{i:032x}")
        cols["span_id"].append(f"{i:010x}{sid:06x}")
        cols["parent_span_id"].append(None if parent is None else f"{i:010x}{parent:06x}")
        cols["name"].append(name)
        cols["start_time_unix_nano"].append(start)
        cols["end_time_unix_nano"].append(end)
        cols["received_unix_nano"].append(end + 500 * MS)
        cols["rollout_id"].append(f"rollout-{i:08d}")
        cols["task_id"].append(f"task-{i // GROUP:06d}")
        for key in keys:
            cols[key].append(kw.get(key))
        for key, value in zip(("prompt_token_ids", "completion_token_ids", "completion_logprobs"), llm or (None,) * 3):
            heavy[key].append(value)

    task_prompt: dict[int, np.ndarray] = {}
    for i in range(first, first + count):
        task = i // GROUP
        if task not in task_prompt:
            task_prompt[task] = np.concatenate([system, np.random.default_rng(task).integers(0, VOCAB, 30 + task % 270),
                                                [EOS, NL, IM_START, ASSISTANT, NL]])
        start = T0 + i * 10**9
        t = start + 5 * MS
        span(i, 1, None, "lightspan.rollout", start, start + 60_000 * MS)
        span(i, 2, 1, "invoke_agent solver", t, start + 59_000 * MS, operation_name="invoke_agent", agent_name="solver")
        prompt, sid = task_prompt[task], 3
        for k in range(CALLS):
            completion = np.append(rng.integers(0, VOCAB, rng.integers(20, 150)), EOS)
            logprobs = -rng.exponential(0.7, len(completion)).astype(np.float32)
            duration = int(rng.integers(300, 3000)) * MS
            span(i, sid, 2, "chat policy", t, t + duration, llm=(prompt, completion, logprobs), operation_name="chat",
                 agent_name="solver", model_version=i // 20_000, input_tokens=len(prompt),
                 output_tokens=len(completion), finish_reasons=["length" if rng.random() < 0.03 else "stop"])
            sid += 1
            t += duration + 10 * MS
            if k < TOOLS:
                tool = int(rng.integers(10, 500)) * MS
                span(i, sid, 2, "execute_tool python", t, t + tool, operation_name="execute_tool")
                sid += 1
                t += tool
            if k < CALLS - 1:    # the next prompt: this one, the completion, a tool turn, the assistant header
                turn = rng.integers(0, VOCAB, rng.integers(10, 100))
                prompt = np.concatenate([prompt, completion, [NL, IM_START, TOOL, NL], turn,
                                         [EOS, NL, IM_START, ASSISTANT, NL]])
        span(i, sid, 1, "lightspan.reward", t, t + MS, reward=float(rng.random() < 0.4 + 0.2 * (task % 3)))
        span(i, sid + 1, None, "lightspan.runner", t + 2 * MS, t + 3 * MS,
             attributes=[("lightspan.rollout.outcome", '"ok"'), ("lightspan.rollout.exit_code", "0")])

    n = len(cols["trace_id"])
    arrays = {name: pa.array(values, store.SPAN_SCHEMA.field(name).type) for name, values in cols.items()}
    arrays["prompt_token_ids"] = _lists(heavy["prompt_token_ids"], np.int32)
    arrays["completion_token_ids"] = _lists(heavy["completion_token_ids"], np.int32)
    arrays["completion_logprobs"] = _lists(heavy["completion_logprobs"], np.float32)
    for name, value in (("kind", "INTERNAL"), ("service_name", "agent"), ("split", "train"), ("status_code", "UNSET")):
        arrays[name] = pa.array([value] * n)
    arrays["capture_status"] = pa.array([None if p is None else "ok" for p in heavy["prompt_token_ids"]], pa.string())
    return pa.table({f.name: arrays.get(f.name, pa.nulls(n, f.type)) for f in store.SPAN_SCHEMA},
                    schema=store.SPAN_SCHEMA)


def generate(data_dir: Path, rollouts: int, *, seed: int = 0) -> int:
    """Write the spans of ``rollouts`` rollouts, PER_FILE rollouts per Parquet file; returns the spans."""
    rng = np.random.default_rng(seed)
    system = np.random.default_rng(12345).integers(0, VOCAB, 120)
    spans = 0
    for first in range(0, rollouts, PER_FILE):
        table = generate_chunk(first, min(PER_FILE, rollouts - first), rng, system)
        store.write_table(data_dir, "spans", table, partition="date=2027-01-15")
        spans += table.num_rows
    return spans


# --- the baseline: a per-rollout Python tree walk ---------------------------------------------
# Written here: the per-rollout approach that Agent Lightning's trace-to-triplet adapter takes, on
# span dicts (a tree from parent links, LLM calls found by span-name regex inside the subtree of a
# matching agent, one per nested group, token ids checked and copied per call, each reward given
# once to the latest call that ended before it), then LightningRL's final reward to every call and
# GRPO. It is the baseline's shape that matters (a Python walk per rollout), not any one project's code.

class SpanNode:
    __slots__ = ("id", "span", "children")

    def __init__(self, span: dict, children: list):
        self.id, self.span, self.children = span["span_id"], span, children

    @classmethod
    def from_spans(cls, spans: list[dict]) -> "SpanNode":
        by_id = {s["span_id"]: s for s in spans}
        forward: dict[str, list[str]] = defaultdict(list)
        roots = []
        for s in spans:
            if s["parent_span_id"] is None or s["parent_span_id"] not in by_id:
                roots.append(s["span_id"])
            else:
                forward[s["parent_span_id"]].append(s["span_id"])

        def visit(span_id):
            children = sorted((visit(c) for c in forward.get(span_id, ())),
                              key=lambda n: n.span["start_time_unix_nano"])
            return cls(by_id[span_id], children)

        trees = sorted((visit(r) for r in roots), key=lambda n: n.span["start_time_unix_nano"])
        if len(trees) == 1:
            return trees[0]
        first = trees[0].span
        return cls({**first, "span_id": "virtual-root", "name": "virtual-root", "parent_span_id": None,
                    "reward": None, "prompt_token_ids": None}, trees)

    def traverse(self) -> list["SpanNode"]:
        nodes = [self]
        for child in self.children:
            nodes += child.traverse()
        return nodes

    def calls_under(self, llm_call_match: re.Pattern, agent_match: re.Pattern | None, agent: str | None,
                       within_reward: bool, within_call: bool, seen: set) -> list[tuple["SpanNode", str]]:
        calls = []
        span = self.span
        if (agent is not None and not within_reward and not within_call and llm_call_match.search(span["name"])
                and span["span_id"] not in seen):
            calls.append((self, agent))
            seen.add(span["span_id"])
            within_call = True
        name = span["agent_name"]
        if name is not None:
            agent = name if agent_match is None or agent_match.search(name) else None
        within_reward = within_reward or span["reward"] is not None
        for child in self.children:
            calls += child.calls_under(llm_call_match, agent_match, agent, within_reward, within_call, seen)
        return calls

    def first_rewards(self, calls: list["SpanNode"]) -> dict[str, float]:
        """Each reward goes to the latest call that ended before it, and a call takes one reward."""
        ids, rewards, assign_to = {c.id for c in calls}, {}, []
        for node in sorted(self.traverse(), key=lambda n: n.span["start_time_unix_nano"]):
            if node.id in ids:
                assign_to.append((node.id, node.span["end_time_unix_nano"]))
            if node.span["reward"] is not None:
                for call_id, end in reversed(assign_to):
                    if end > node.span["start_time_unix_nano"] or call_id in rewards:
                        continue
                    rewards[call_id] = node.span["reward"]
                    break
        return rewards


def _ids(values) -> list | None:
    """A list of ints, checked and copied (as a per-call adapter reads token ids)."""
    if isinstance(values, (list, tuple)) and all(isinstance(x, int) for x in values):
        return list(values)
    return None


def baseline(files: list[str], *, epsilon: float = 1e-6, llm_call_match: str = r"^chat ",
             agent_match: str | None = None) -> tuple[list[dict], dict]:
    """Span dicts -> trees -> one triplet per LLM call -> GRPO advantages per task, all in Python."""
    t0 = time.perf_counter()
    spans = [row for f in files for row in pq.read_table(f).to_pylist()]
    t_load = time.perf_counter()

    by_rollout: dict[str, dict] = defaultdict(dict)
    for s in spans:                          # at-least-once delivery: the first copy of a span wins
        by_rollout[s["rollout_id"] or s["trace_id"]].setdefault((s["trace_id"], s["span_id"]), s)
    call_pattern = re.compile(llm_call_match)
    agent_pattern = re.compile(agent_match) if agent_match else None
    rollouts = []
    for key, unique in by_rollout.items():
        nodes = list(unique.values())
        runners = [s for s in nodes if s["name"] == "lightspan.runner"]
        if not runners or any('"ok"' != dict(s["attributes"] or ()).get("lightspan.rollout.outcome") for s in runners):
            continue                         # incomplete, failed or timed out
        root = SpanNode.from_spans(nodes)
        calls = root.calls_under(call_pattern, agent_pattern, "*" if agent_pattern is None else None,
                                    False, False, set())
        triplets = []
        for node, agent in calls:
            span = node.span
            prompt, response = _ids(span["prompt_token_ids"]), _ids(span["completion_token_ids"])
            logprobs = span["completion_logprobs"]
            if prompt and response and logprobs is not None and len(logprobs) == len(response):
                triplets.append((node, {"transition_id": f"{key}/{span['span_id']}", "prompt": prompt,
                                        "response": response, "logprobs": list(logprobs), "agent": agent}))
        matched = root.first_rewards([node for node, _ in triplets])
        rewards = sorted((s for s in nodes if s["reward"] is not None),
                         key=lambda s: (s["end_time_unix_nano"], s["span_id"], s["reward"]))
        if not triplets or not rewards:
            continue
        final = rewards[-1]["reward"]        # LightningRL: the final reward to every call
        for node, t in triplets:
            t["matched_reward"], t["reward"] = matched.get(node.id), final
        rollouts.append({"task_id": nodes[0]["task_id"], "reward": final, "triplets": [t for _, t in triplets]})

    by_task = defaultdict(list)
    for r in rollouts:
        by_task[r["task_id"]].append(r)
    transitions = []
    for group in by_task.values():           # GRPO at rollout level: each rollout counts once
        if len(group) < 2:
            continue
        rewards = [r["reward"] for r in group]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        for r in group:
            advantage = (r["reward"] - mean) / (std + epsilon)
            transitions += [{**t, "call_index": i, "advantage": advantage} for i, t in enumerate(r["triplets"])]
    t_end = time.perf_counter()
    return transitions, {"load_s": t_load - t0, "walk_s": t_end - t_load, "total_s": t_end - t0}


# --- measurements, each in a fresh process ----------------------------------------------------

def _limit(cores: int) -> None:
    if hasattr(os, "sched_setaffinity"):
        available = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, set(available[:cores]))
    pa.set_cpu_count(cores)
    pa.set_io_thread_count(cores)


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _build(data_dir: str, cores: int, **cfg):
    from lightspan.lightningrl.builder import build_transitions
    from lightspan.lightningrl.config import TransitionsConfig

    con = store.connect(data_dir)
    con.execute(f"SET threads = {cores}")
    try:
        return build_transitions(con, TransitionsConfig(data_dir=data_dir, **cfg), now_unix_nano=T0 + 10**15)
    finally:
        con.close()


def measure_build(data_dir: str, cores: int, output: str) -> dict:
    _limit(cores)
    c0, t0 = _cpu(), time.perf_counter()
    table, metrics = _build(data_dir, cores, output=output)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    return {"wall_s": wall, "cpu_s": cpu, "rows": table.num_rows, "calls": metrics["transitions/calls"],
            "rollouts": metrics["transitions/rollouts"], "tokens": int(table.nbytes)}


def measure_baseline(data_dir: str, cores: int, rollouts: int) -> dict:
    _limit(cores)
    from lightspan.lightningrl.selection import span_files

    files = span_files(data_dir)[:max(1, -(-rollouts // PER_FILE))]
    c0 = _cpu()
    walk, times = baseline(files)
    times["cpu_s"] = _cpu() - c0
    ours = {}
    with tempfile.TemporaryDirectory() as sub:       # the builder on the same files, for the check
        dest = Path(sub) / "spans" / "date=2027-01-15"
        dest.mkdir(parents=True)
        for f in files:
            os.link(f, dest / Path(f).name)
        table, _ = _build(sub, cores)
        ours = {r["transition_id"]: r["advantage"] for r in table.select(["transition_id", "advantage"]).to_pylist()}
    theirs = {t["transition_id"]: t["advantage"] for t in walk}
    times["agrees"] = set(ours) == set(theirs) and all(abs(ours[k] - theirs[k]) < 1e-9 for k in theirs)
    times["transitions"] = len(walk)
    times["rollouts"] = len(files) * PER_FILE
    return times


def _child(*args) -> dict:
    out = subprocess.run([sys.executable, __file__, *map(str, args)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=100_000)
    p.add_argument("--baseline-rollouts", type=int, default=10_000,
                   help="rollouts the Python walk runs on (a multiple of 10,000; its time is scaled linearly)")
    p.add_argument("--cores", type=int, default=2, help="cores (and DuckDB / pyarrow threads) the build may use")
    p.add_argument("--repeat", type=int, default=3, help="runs of each build, each in a fresh process")
    p.add_argument("--dir", default=None, help="keep the generated store in this directory (default: a temp dir)")
    p.add_argument("--_measure", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._measure:           # a child process: one measurement, one JSON line
        what, data_dir, *rest = args._measure
        if what == "build":
            result = measure_build(data_dir, args.cores, rest[0])
        else:
            result = measure_baseline(data_dir, args.cores, int(rest[0]))
        print(json.dumps(result))
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(args.dir or tmp)
        t0 = time.perf_counter()
        spans = generate(data_dir, args.rollouts)
        size = sum(f.stat().st_size for f in (data_dir / "spans").rglob("*.parquet"))
        print(f"generated {spans:,} spans of {args.rollouts:,} rollouts ({size / 2**20:.0f} MiB of Parquet) "
              f"in {time.perf_counter() - t0:.0f} s (not timed)", file=sys.stderr)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        runs = {}
        for output in ("per_call", "per_rollout"):
            runs[output] = [_child("--cores", args.cores, "--_measure", "build", data_dir, output)
                            for _ in range(args.repeat)]
            best = min(runs[output], key=lambda r: r["wall_s"])
            print(f"build_transitions {output}: best {best['wall_s']:.2f} s wall ({best['cpu_s']:.2f} s CPU), "
                  f"median {statistics.median(r['wall_s'] for r in runs[output]):.2f} s -> {best['rows']:,} rows, "
                  f"{best['calls']:,} calls", file=sys.stderr)
        bases = [_child("--cores", args.cores, "--_measure", "baseline", data_dir, args.baseline_rollouts)
                 for _ in range(args.repeat)]
        base = min(bases, key=lambda r: r["total_s"])
        base_median = statistics.median(r["total_s"] for r in bases)
        scale = args.rollouts / base["rollouts"]
        best = min(runs["per_call"], key=lambda r: r["wall_s"])
        median = statistics.median(r["wall_s"] for r in runs["per_call"])
        result = {
            "spans": spans, "rollouts": args.rollouts, "parquet_mib": round(size / 2**20), "cores": args.cores,
            "load_average_at_start": round(load, 2),
            "build_per_call_best_s": round(best["wall_s"], 2), "build_per_call_cpu_s": round(best["cpu_s"], 2),
            "build_per_call_median_s": round(median, 2),
            "build_per_rollout_best_s": round(min(r["wall_s"] for r in runs["per_rollout"]), 2),
            "build_per_rollout_median_s": round(statistics.median(r["wall_s"] for r in runs["per_rollout"]), 2),
            "transitions": best["calls"],
            "baseline_rollouts": base["rollouts"], "baseline_scale": scale,
            "baseline_load_s": round(base["load_s"], 2), "baseline_walk_s": round(base["walk_s"], 2),
            "baseline_cpu_s": round(base["cpu_s"], 2),
            "baseline_scaled_s": round(base["total_s"] * scale, 1),
            "baseline_scaled_median_s": round(base_median * scale, 1),
            "baseline_walk_scaled_s": round(base["walk_s"] * scale, 1),
            "speedup": round(base["total_s"] * scale / best["wall_s"], 1),
            "speedup_median": round(base_median * scale / median, 1),
            "speedup_vs_walk_only": round(base["walk_s"] * scale / best["wall_s"], 1),
            "speedup_cpu": round(base["cpu_s"] * scale / best["cpu_s"], 1),
            "baseline_agrees_on_subsample": all(r["agrees"] for r in bases),
        }
        print(f"baseline (Python tree walk) on {base['rollouts']:,} rollouts: best {base['total_s']:.2f} s "
              f"(load {base['load_s']:.2f} s + walk {base['walk_s']:.2f} s), median {base_median:.2f} s; "
              f"scaled x{scale:g} (linear) to {result['baseline_scaled_s']} s; "
              f"agrees with the builder: {result['baseline_agrees_on_subsample']}", file=sys.stderr)
        print(f"speedup {result['speedup']}x best/best, {result['speedup_median']}x median/median (against the "
              f"walk alone, without loading: {result['speedup_vs_walk_only']}x; CPU time: "
              f"{result['speedup_cpu']}x)", file=sys.stderr)
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
