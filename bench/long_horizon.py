"""What long trajectories do to the transition builder, per store (issue 31): rows per rollout, the
merge rate, prefix mismatches by cause, and the builder's CPU per 1,000 turns.

Each store (a data directory a run of an example left, e.g. ``lightspan experiment --data-dir D``) is
copied to a scratch directory with its built transitions left out, and ``lightspan transitions build
--output per_rollout`` runs there ``--runs`` times in a fresh process (its CPU is the child's user +
system time), with the outcomes every rollout may end in kept (``--outcomes`` default: the builder's).
A rollout that compacts its history, or whose harness rewrites it, is split into segments, one row
each; ``merge_rate`` is the share of rollouts built into exactly one row.

    .venv/bin/python bench/long_horizon.py NAME=DATA_DIR [NAME=DATA_DIR ...] [--runs 3] [--json OUT]

The trainer's tokens per second on these rows: bench/trainer_throughput.py; the 1M-span build time:
bench/lightningrl_build_ab.py.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEEP = ("spans", "policy.json", "reward-ids.key")     # what a build reads; transitions are rebuilt


def scratch_copy(data_dir: Path, into: Path) -> Path:
    """``data_dir``'s spans (and policy) in ``into``, without its transitions or watermark."""
    into.mkdir(parents=True)
    for name in KEEP:
        src = data_dir / name
        if src.is_dir():
            shutil.copytree(src, into / name)
        elif src.exists():
            shutil.copy2(src, into / name)
    return into


def lightspan(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "lightspan.cli", *args], check=True, text=True,
                          stdout=subprocess.PIPE, cwd=ROOT).stdout


def turns(data_dir: Path) -> tuple[int, int]:
    """(LLM calls, rollouts) in the store's llm_calls view."""
    out = lightspan("sql", "--data-dir", str(data_dir), "--format", "json",
                    "SELECT count(*) AS calls, count(DISTINCT rollout_key) AS rollouts FROM llm_calls")
    row = json.loads(out.strip().splitlines()[0])
    row = row[0] if isinstance(row, list) else row
    return int(row["calls"]), int(row["rollouts"])


def build_once(data_dir: Path, work: Path) -> tuple[dict, float]:
    """One per_rollout build of a scratch copy: (its metrics, its CPU seconds)."""
    copy = scratch_copy(data_dir, work)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = lightspan("transitions", "build", "--data-dir", str(copy), "--output", "per_rollout", "--grace-s", "0",
                    "--min-group-size", "1")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out.strip().splitlines()[-1]), cpu


def summarise(name: str, calls: int, rollouts: int, metrics: dict, cpus: list[float]) -> dict:
    mismatch = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith("transitions/prefix_mismatch/")}
    return {"store": name, "calls": calls, "rollouts": rollouts,
            "rollouts_built": metrics.get("transitions/rollouts", 0),
            "rows": metrics.get("transitions/sequences", 0),
            "rows_per_rollout_mean": metrics.get("transitions/rows_per_rollout_mean"),
            "rows_per_rollout_max": metrics.get("transitions/rows_per_rollout_max"),
            "merge_rate": metrics.get("transitions/merge_rate"),
            "prefix_mismatch": mismatch,
            "build_cpu_s": cpus, "build_cpu_s_per_1000_turns": 1000 * statistics.median(cpus) / max(calls, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stores", nargs="+", metavar="NAME=DATA_DIR")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args(argv)
    rows = []
    for spec in args.stores:
        name, sep, path = spec.partition("=")
        data_dir = Path(path if sep else name)
        if not (data_dir / "spans").is_dir():
            ap.error(f"{spec}: {data_dir} holds no spans/ (give NAME=DATA_DIR of a run's store)")
        calls, rollouts = turns(data_dir)
        cpus, metrics = [], {}
        with tempfile.TemporaryDirectory(prefix="long-horizon-") as tmp:
            for k in range(args.runs):
                metrics, cpu = build_once(data_dir, Path(tmp) / f"run{k}")
                cpus.append(cpu)
        rows.append(summarise(name if sep else data_dir.name, calls, rollouts, metrics, cpus))
    load = os.getloadavg()[0]
    print("| store | turns | rollouts built | rows / rollout (mean, max) | merge rate | prefix mismatches "
          "| build CPU-s per 1,000 turns |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        causes = ", ".join(f"{k} {v}" for k, v in sorted(r["prefix_mismatch"].items()) if v) or "none"
        print(f"| {r['store']} | {r['calls']} | {r['rollouts_built']} of {r['rollouts']} | "
              f"{r['rows_per_rollout_mean']:.2f}, {r['rows_per_rollout_max']} | {r['merge_rate']:.2f} | {causes} | "
              f"{r['build_cpu_s_per_1000_turns']:.1f} |")
    print(f"load (1 min) at the end: {load:.1f}; {args.runs} builds a store, median CPU")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "load_1m": load, "argv": sys.argv[1:]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
