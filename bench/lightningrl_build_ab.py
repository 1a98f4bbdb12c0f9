"""Benchmark: the transition builder of two trees side by side, on one store of bench/lightningrl_build.py.

    git archive <commit before> | tar -x -C /tmp/before/lightspan     # each arm: a `lightspan` package
    git archive HEAD | tar -x -C /tmp/after/lightspan
    .venv/bin/python bench/lightningrl_build_ab.py --arms before=/tmp/before after=/tmp/after \
        [--rollouts 100000] [--pairs 4] [--cores 2] [--dir STORE]

1. Generates ``--rollouts`` rollouts (10 spans each) with lightningrl_build.py's generator into
   ``--dir`` (kept; generated only if it holds no spans). Not timed.
2. For each of ``--pairs`` rounds and each of ``--outputs`` (per_call, per_rollout) runs one build per arm,
   the arms' order alternating round by round, each in a fresh process (lightningrl_build.py's
   ``--_measure build``) with ``PYTHONPATH`` set to the arm's directory, so that it imports that
   arm's ``lightspan``, pinned to ``--cores`` cores.
3. Prints each build's CPU and wall seconds and the load average at its start, then one JSON line:
   per output, each arm's CPU and wall seconds, the paired ratios (second arm / first arm) and
   their medians. On a shared machine the CPU-time ratio is the figure to read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTPUTS = ("per_call", "per_rollout")


def build_once(arm_root: str, store_dir: Path, output: str, cores: int) -> dict:
    env = {**os.environ, "PYTHONPATH": arm_root}
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, str(HERE / "lightningrl_build.py"), "--cores", str(cores),
                          "--_measure", "build", str(store_dir), output],
                         check=True, capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env)
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "load": load}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", nargs=2, required=True, metavar="NAME=DIR",
                   help="two arms, each a directory holding a `lightspan` package; ratios are second / first")
    p.add_argument("--rollouts", type=int, default=100_000)
    p.add_argument("--pairs", type=int, default=4, help="rounds of one build per arm and output")
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--outputs", nargs="+", choices=OUTPUTS, default=list(OUTPUTS), help="output modes to build")
    p.add_argument("--dir", default=None, help="the store (kept; default: a temp dir)")
    args = p.parse_args(argv)
    arms = []
    for spec in args.arms:
        name, sep, root = spec.partition("=")
        if not sep or not (Path(root) / "lightspan").is_dir():
            p.error(f"--arms {spec!r}: give NAME=DIR with DIR/lightspan a package (e.g. a git archive of the repo)")
        arms.append((name, root))

    with tempfile.TemporaryDirectory() as tmp:
        store_dir = Path(args.dir or tmp)
        if not list((store_dir / "spans").rglob("*.parquet")):
            env = {**os.environ, "PYTHONPATH": arms[-1][1]}
            code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import lightningrl_build as b; "
                    f"from pathlib import Path; print(b.generate(Path({str(store_dir)!r}), {args.rollouts}))")
            spans = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                   cwd=tempfile.gettempdir(), env=env).stdout.strip()
            print(f"generated {spans} spans of {args.rollouts:,} rollouts (not timed)", file=sys.stderr)
        runs: dict = {(o, name): [] for o in args.outputs for name, _ in arms}
        for i in range(args.pairs):
            for output in args.outputs:
                for name, root in (arms if i % 2 == 0 else arms[::-1]):
                    r = build_once(root, store_dir, output, args.cores)
                    runs[(output, name)].append(r)
                    print(f"round {i} {output} {name}: {r['cpu_s']:.2f} s CPU, {r['wall_s']:.2f} s wall, "
                          f"{r['rows']:,} rows, load {r['load']:.1f}", file=sys.stderr, flush=True)
        (first, _), (second, _) = arms
        result = {"rollouts": args.rollouts, "cores": args.cores, "pairs": args.pairs, "ratio": f"{second}/{first}"}
        for output in args.outputs:
            a, b = runs[(output, first)], runs[(output, second)]
            cpu = [y["cpu_s"] / x["cpu_s"] for x, y in zip(a, b)]
            wall = [y["wall_s"] / x["wall_s"] for x, y in zip(a, b)]
            result[output] = {
                f"{first}_cpu_s": [round(x["cpu_s"], 2) for x in a], f"{second}_cpu_s": [round(y["cpu_s"], 2) for y in b],
                f"{first}_wall_s": [round(x["wall_s"], 2) for x in a], f"{second}_wall_s": [round(y["wall_s"], 2) for y in b],
                "cpu_ratios": [round(c, 3) for c in cpu], "median_cpu_ratio": round(statistics.median(cpu), 3),
                "wall_ratios": [round(w, 3) for w in wall], "median_wall_ratio": round(statistics.median(wall), 3),
                "rows": [a[0]["rows"], b[0]["rows"]],
                "load": [round(r["load"], 1) for r in a + b]}
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
