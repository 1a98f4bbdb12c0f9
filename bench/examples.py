"""Every worked example over seeds, and one table of them in examples/README.md.

    .venv/bin/python bench/examples.py                              # every example, seeds 0 1 2
    .venv/bin/python bench/examples.py --examples gsm8k --seeds 1 2 # a subset
    .venv/bin/python bench/examples.py --table-only                 # rebuild the table from results

Each run is ``lightspan experiment`` with the example's documented command (its README, "Run it":
the table ``EXAMPLES`` below), ``--seed S`` and ``--out-dir examples/NAME/results/seedS``, so every
seed's ``results.json`` and ``curve.png`` are kept; a seed that has results already is refused
(``--rerun`` to run it again). Services an example's README starts by hand first (Search-R1's
retriever, the sandbox example's own vLLM) are started here, on free ports, and stopped after.
A run uses HEAD's committed files (``git archive`` into DATA_ROOT/tree-COMMIT, on PYTHONPATH), not
the shared working tree's edits in progress. Beside each ``results.json`` goes ``run.json``: the
commit, the command, the 1-minute load average
and the available memory sampled every 30 s during the run, the services' CPU seconds (the
experiment counts only its own processes), and the calls and tokens of the run's rollouts read from
its store (``lightspan sql``), per split.

The table, per example, over the seeds that have results: agent, turns (chat calls) per training
rollout, tokens (prompt + completion, summed over a rollout's calls) per training rollout, held-out
solved before -> after (mean and range), the held-out mean reward before -> after (partial credit, as
ScienceWorld's score gives), the gain, CPU-minutes per seed (the experiment's own count,
validation excluded, plus the services' whole CPU), and whether the issue's goal is met: a mean gain
of at least +10 points, every seed above its own start, at most 45 CPU-minutes a seed (the worked
examples' goal; the long-horizon examples, ScienceWorld and coding, are reported without one). Run it under
the machine's heavy slot so runs do not overlap: ``heavy-slot --slot A nice .venv/bin/python ...``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# bench/example_runs.py, loaded from beside this file (bench/ on sys.path would let this file shadow examples/)
if "example_runs" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("example_runs", Path(__file__).resolve().parent / "example_runs.py")
    sys.modules["example_runs"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["example_runs"])
from example_runs import (MODEL_DIR, ROOT, LoadSampler, committed_tree, start_service, stop,  # noqa: E402
                          store_counts, tree_cpu_seconds)

README = ROOT / "examples" / "README.md"
BEGIN, END = "<!-- bench/examples.py: table -->", "<!-- end of table -->"
GOAL_GAIN, GOAL_CPU_MIN = 0.10, 45.0


@dataclass(frozen=True)
class Example:
    """One example's documented command: its README's "Run it", less --seed/--data-dir/--out-dir."""
    agent: str
    tasks: str  # folder of data/train.jsonl and data/val.jsonl
    settings: tuple[str, ...]
    env_map: str = "QUESTION=input.question,ANSWER=input.answer"
    service: str = ""  # "retriever" or "vllm": started here as the README starts it by hand
    train: str = "train"  # the task files' names in the tasks folder's data/
    val: str = "val"
    what: str = ""  # the agent in a few words, for the table
    goal: bool = True  # the worked-examples goal applies (issue 30); the long-horizon ones (issue 31) report only


_GRPO = ("--tasks-per-step", "4", "--samples", "8", "--lora-r", "16", "--learning-rate", "3e-4")
EXAMPLES = {
    "gsm8k": Example(
        "examples/gsm8k/agent.py", "examples/gsm8k",
        ("--disabled-instrumentations", "langchain", "--steps", "30", *_GRPO, "--val-limit", "48",
         "--rollout-timeout-s", "1200", "--cpu-budget-s", "2700"),
        what="openai client, calculator tool (text tags)"),
    "search_r1": Example(
        "examples/search_r1/agent.py", "examples/search_r1",
        ("--disabled-instrumentations", "langchain", "--steps", "30", *_GRPO, "--max-model-len", "2048",
         "--val-limit", "48", "--rollout-timeout-s", "1200", "--cpu-budget-s", "2700", "--time-budget-s", "4800"),
        env_map="QUESTION=input.question,GOLDEN_ANSWERS=input.golden_answers", service="retriever",
        what="openai client, BM25 search service (Search-R1 tags)"),
    "sandbox": Example(
        "examples/sandbox/agent.py", "examples/sandbox",
        ("--steps", "12", "--tasks-per-step", "4", "--samples", "8", "--concurrency", "32", "--lora-r", "16",
         "--learning-rate", "3e-4", "--entropy-floor", "0.2", "--disabled-instrumentations", "langchain",
         "--rollout-timeout-s", "600", "--cpu-budget-s", "2700", "--time-budget-s", "3600"),
        service="vllm", what="openai client, Python in bubblewrap"),
    "calc_agent": Example(
        "examples/calc_agent/agent.py", "examples/calc_agent",
        ("--val-limit", "24", "--steps", "8", "--tasks-per-step", "4", "--samples", "6",
         "--learning-rate", "3e-5", "--time-budget-s", "840"),
        env_map="", what="LangGraph agent, calculator tool"),
    "sql_agent": Example(
        "examples/sql_agent/agent.py", "examples/sql_agent",
        ("--steps", "8", "--tasks-per-step", "4", "--samples", "8", "--learning-rate", "3e-5",
         "--time-budget-s", "780"),
        env_map="", what="openai client, SQLite queries"),
    "multi_agent": Example(
        "examples/multi_agent/agent.py", "examples/sql_agent",
        ("--agent-match", "^sql_writer$", "--val-limit", "24", "--steps", "8", "--tasks-per-step", "4",
         "--samples", "8", "--learning-rate", "3e-5", "--time-budget-s", "720"),
        env_map="", what="LangGraph writer + checker, writer trained"),
    "scienceworld": Example(  # issue 31: long-horizon, the game's JVM per rollout, history compacted every 4 turns
        "examples/scienceworld/agent.py", "examples/scienceworld",
        ("--disabled-instrumentations", "langchain", "--steps", "8", "--tasks-per-step", "3", "--samples", "4",
         "--concurrency", "12", "--lora-r", "16", "--learning-rate", "3e-4", "--max-model-len", "2048",
         "--max-memory-gb", "5", "--entropy-floor", "0.2", "--rollout-timeout-s", "900",
         "--output", "per_rollout", "--loss-normalisation", "rollout", "--cpu-budget-s", "2700", "--time-budget-s", "4800"),
        env_map="TASK_NAME=input.task_name,VARIATION_IDX=input.variation", what="openai client, ScienceWorld game (ReAct)",
        goal=False),
    "coding": Example(  # issue 31: mini-swe-agent from PyPI, unchanged; each rollout in its own mount namespace
        "unshare --mount --propagation private python examples/coding/agent.py", "examples/coding",
        ("--steps", "8", "--tasks-per-step", "2", "--samples", "4", "--concurrency", "8", "--lora-r", "16",
         "--learning-rate", "3e-4", "--max-model-len", "4096", "--rollout-timeout-s", "900",
         "--cpu-budget-s", "1200", "--time-budget-s", "3600"),
        env_map="", train="train-command", val="val-run", what="mini-swe-agent (PyPI), bash in bubblewrap", goal=False),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=list(EXAMPLES), metavar="NAME",
                        help=f"examples to run (default: all): {', '.join(EXAMPLES)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="seeds to run (default: 0 1 2)")
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing: rebuild examples/README.md's table from the results there")
    parser.add_argument("--rerun", action="store_true", help="run a seed again even if it has results")
    parser.add_argument("--data-root", default="/tmp/lightspan-examples",
                        help="the runs' data directories (DATA_ROOT/NAME-seedS, emptied at start)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.examples if name not in EXAMPLES]
    if unknown:
        parser.error(f"unknown example {', '.join(unknown)}; the examples are {', '.join(EXAMPLES)}")
    if len(set(args.examples)) != len(args.examples):
        parser.error("an example is named twice in --examples")
    if args.table_only and args.seeds is not None:
        parser.error("--table-only runs nothing: drop --seeds (the table takes every seed with results)")
    seeds = [0, 1, 2] if args.seeds is None else args.seeds
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds must be distinct non-negative integers, not {seeds}")
    args.seeds = seeds
    return args


def results_dir(name: str, seed: int) -> Path:
    return ROOT / "examples" / name / "results" / f"seed{seed}"


def command(name: str, seed: int, data_dir: Path, service_url: str = "") -> list[str]:
    ex = EXAMPLES[name]
    cmd = [sys.executable, "-m", "lightspan.cli", "experiment", "--agent", ex.agent,
           "--train-tasks", f"{ex.tasks}/data/{ex.train}.jsonl", "--val-tasks", f"{ex.tasks}/data/{ex.val}.jsonl",
           *ex.settings, "--seed", str(seed), "--data-dir", str(data_dir),
           "--out-dir", str(results_dir(name, seed))]
    if ex.env_map:
        cmd += ["--env-map", ex.env_map]
    if ex.service == "vllm":
        cmd += ["--vllm-url", service_url, "--model", str(MODEL_DIR)]
    return cmd


# --- running (the services, CPU and load sampling, the store's counts, HEAD's tree: bench/example_runs.py) ---

def run_one(name: str, seed: int, data_root: Path) -> dict:
    out_dir, data_dir = results_dir(name, seed), data_root / f"{name}-seed{seed}"
    out_dir.mkdir(parents=True, exist_ok=True)
    data_root.mkdir(parents=True, exist_ok=True)
    sampler = LoadSampler()
    sampler.start()
    commit, tree = committed_tree(data_root)
    service, url, env, service_cpu = None, "", {}, 0.0
    started = time.time()
    try:
        if EXAMPLES[name].service:
            service, url, env = start_service(EXAMPLES[name].service, seed,
                                              data_root / f"{name}-seed{seed}.svc.log", tree)
        cmd = command(name, seed, data_dir, url)
        with (data_root / f"{name}-seed{seed}.log").open("w") as log:
            path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # 'python' in a command
            rc = subprocess.run(cmd, cwd=tree, env={**os.environ, **env, "PYTHONPATH": str(tree), "PATH": path},
                                stdout=log, stderr=subprocess.STDOUT).returncode
    finally:
        if service is not None:
            service_cpu = tree_cpu_seconds(service)
            stop(service)
        sampler.done.set()
        sampler.join()
    loads = [s[0] for s in sampler.samples]
    run = {"example": name, "seed": seed, "commit": commit, "exit_code": rc,
           "command": " ".join(cmd), "service": EXAMPLES[name].service, "service_cpu_seconds": round(service_cpu, 1),
           "wall_seconds": round(time.time() - started, 1),
           "load_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads),
                         "samples": len(loads)},
           "mem_available_mib_min": min(s[1] for s in sampler.samples),
           "store": store_counts(data_dir, tree)}
    (out_dir / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    return run


# --- the table -------------------------------------------------------------------------------------

def seed_row(results: dict, run: dict | None) -> dict:
    """One seed's figures from its results.json (and run.json, when bench/examples.py ran it)."""
    val, train = results.get("val", []), results.get("train", [])
    row = {"seed": results.get("config", {}).get("seed"), "steps": len(train),
           "updates": results.get("trainer", {}).get("steps"), "finished": len(val) >= 2,
           "before": val[0]["solved"] if val else None, "of": val[0]["rollouts"] if val else None,
           "after": val[-1]["solved"] if len(val) >= 2 else None,
           "reward": (val[0].get("reward_mean"), val[-1].get("reward_mean")) if len(val) >= 2 else None,
           "cpu_s": val[-1].get("cpu_seconds") if len(val) >= 2 else None}
    rollouts = sum(step.get("rollouts", 0) for step in train)
    calls = sum(step.get("outcomes", {}).get("capture", {}).get("calls", 0) for step in train)
    row["turns"] = calls / rollouts if rollouts and calls else None
    row["tokens"] = row["load"] = row["commit"] = None
    if run:
        if row["cpu_s"] is not None:
            row["cpu_s"] += run.get("service_cpu_seconds", 0.0)
        tr = run.get("store", {}).get("train")
        if tr and tr.get("rollouts"):
            row["tokens"] = (float(tr.get("prompt_tokens") or 0) + float(tr.get("completion_tokens") or 0)) / tr["rollouts"]
        row["load"], row["commit"] = run.get("load_1min"), run.get("commit")
    return row


def load_rows(name: str, root: Path = ROOT) -> list[dict]:
    rows = []
    for results_file in sorted((root / "examples" / name / "results").glob("seed*/results.json")):
        run_file = results_file.with_name("run.json")
        run = json.loads(run_file.read_text()) if run_file.exists() else None
        rows.append(seed_row(json.loads(results_file.read_text()), run))
    return sorted(rows, key=lambda r: (r["seed"] is None, r["seed"]))


def _span(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


def summarise(name: str, rows: list[dict]) -> dict:
    """The table's cells for one example (strings), from its seeds' rows."""
    done = [r for r in rows if r["finished"]]
    cells = {"example": f"[{name}]({name}/)", "agent": EXAMPLES[name].what if name in EXAMPLES else "",
             "seeds": ", ".join(str(r["seed"]) for r in done) or "none finished"}
    unfinished = [str(r["seed"]) for r in rows if not r["finished"]]
    if unfinished:
        cells["seeds"] += f" (no final validation: {', '.join(unfinished)})"
    turns = [r["turns"] for r in done if r["turns"] is not None]
    tokens = [r["tokens"] for r in done if r["tokens"] is not None]
    cells["turns"] = _span(turns, ".1f") if turns else "-"
    cells["tokens"] = _span(tokens, ".0f") if tokens else "-"
    if not done:
        cells.update(heldout="-", reward="-", gain="-", cpu="-", goal="not measured")
        return cells
    before, after = [100 * r["before"] for r in done], [100 * r["after"] for r in done]
    gains = [a - b for a, b in zip(after, before)]
    cpu = [r["cpu_s"] / 60 for r in done if r["cpu_s"] is not None]
    cells["heldout"] = f"{_span(before, '.1f')} → {_span(after, '.1f')} (of {done[0]['of']})"
    rewards = [r["reward"] for r in done if r["reward"] and None not in r["reward"]]
    cells["reward"] = (f"{_span([b for b, _ in rewards], '.3f')} → {_span([a for _, a in rewards], '.3f')}"
                       if len(rewards) == len(done) else "-")
    cells["gain"] = _span(gains, "+.1f")
    cells["cpu"] = _span(cpu, ".1f") if cpu else "-"
    cells["goal"] = (goal(gains, cpu if len(cpu) == len(done) else None)
                     if name not in EXAMPLES or EXAMPLES[name].goal else "- (long-horizon: reported, no goal)")
    return cells


def goal(gains: list[float], cpu_min: list[float] | None) -> str:
    """The issue's goal over the seeds: mean gain >= +10 points, every seed up, <= 45 CPU-min a seed."""
    misses = []
    if statistics.mean(gains) < 100 * GOAL_GAIN:
        misses.append(f"mean gain < +{100 * GOAL_GAIN:.0f}")
    if not all(g > 0 for g in gains):
        misses.append("a seed not above its start")
    if cpu_min is None:
        misses.append("CPU not measured")
    elif max(cpu_min) > GOAL_CPU_MIN:
        misses.append(f"> {GOAL_CPU_MIN:.0f} CPU-min")
    verdict = "yes" if not misses else "no: " + ", ".join(misses)
    return verdict + ("" if len(gains) >= 3 else f" ({len(gains)} of 3 seeds)")


COLUMNS = [("example", "example"), ("agent", "agent"), ("seeds", "seeds"), ("turns", "turns / rollout"),
           ("tokens", "tokens / rollout"), ("heldout", "held-out solved % before → after"),
           ("reward", "held-out mean reward before → after"),
           ("gain", "gain (points)"), ("cpu", "CPU-min / seed"), ("goal", "goal met")]


def table(root: Path = ROOT) -> str:
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    commits, loads = set(), []
    for name in EXAMPLES:
        rows = load_rows(name, root)
        cells = summarise(name, rows)
        lines.append("| " + " | ".join(cells[key] for key, _ in COLUMNS) + " |")
        commits |= {r["commit"] for r in rows if r["commit"]}
        loads += [r["load"] for r in rows if r["load"]]
    lines.append("")
    lines.append("Mean [min, max] over the seeds. Turns and tokens: per training rollout (tokens are prompt + "
                 "completion summed over its calls, from the run's store; - where the run predates "
                 "bench/examples.py). CPU: the experiment's own count outside validation, plus the whole CPU of a "
                 "service started for it (the sandbox's vLLM, Search-R1's retriever). Goal: mean gain ≥ +10 points, "
                 "every seed above its own start, ≤ 45 CPU-min a seed.")
    if loads:
        lines.append(f"Code of the runs: {', '.join(sorted(commits))} (a trailing + : see the run's run.json note); "
                     f"1-minute load average "
                     f"sampled every 30 s during them: {min(l['min'] for l in loads):.1f}–"
                     f"{max(l['max'] for l in loads):.1f} (medians of runs "
                     f"{min(l['median'] for l in loads):.1f}–{max(l['median'] for l in loads):.1f}).")
    return "\n".join(lines) + "\n"


def write_table(readme: Path = README, root: Path = ROOT) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} block to replace")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    readme.write_text(f"{head}{BEGIN}\n{table(root)}{END}{tail}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.table_only:
        for name in args.examples:
            for seed in args.seeds:
                if (results_dir(name, seed) / "results.json").exists() and not args.rerun:
                    print(f"{name} seed {seed}: has results already (--rerun to run it again)")
                    continue
                run = run_one(name, seed, Path(args.data_root))
                print(f"{name} seed {seed}: exit {run['exit_code']}, wall {run['wall_seconds']:.0f} s, "
                      f"load {run['load_1min']['median']:.1f} (median)", flush=True)
    write_table()
    print(table())


if __name__ == "__main__":
    main()
