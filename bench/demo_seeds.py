"""The demo over several seeds: held-out solved before and after, mean and range (the README's figure).

    .venv/bin/python bench/demo_seeds.py [--seeds 0,1,2] [-- more lightspan demo options]

Runs ``lightspan demo --seed S`` once per seed, one after the other, each in its own data directory
(``--data-dir-root``/seed-S), and reads each run's ``results.json``. A seed sets the demo's task split
(which additions are trained and held out), the trainer's initialisation of the adapter and its data
order, and vLLM's sampling. Prints one line per seed (held-out solved before and after, wall and CPU
time, the policy's entropy at the first and last step), then the mean and range over the seeds, and
writes everything to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def one(seed: int, root: Path, extra: list[str]) -> dict:
    data = root / f"seed-{seed}"
    subprocess.run([sys.executable, "-m", "lightspan.cli", "demo", "--seed", str(seed), "--data-dir", str(data),
                    *extra], check=True)
    results = json.loads((data / "results.json").read_text())
    before, after = results["val"][0], results["val"][-1]
    return {"seed": seed, "before": before["solved"], "after": after["solved"], "of": after["rollouts"],
            "steps": results["trainer"]["steps"], "wall_s": results["wall_seconds"],
            "cpu_s": after["cpu_seconds"], "entropy_first": results["trainer"].get("entropy_first"),
            "entropy_last": results["trainer"].get("entropy_last")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--data-dir-root", default="./lightspan-data/demo-seeds")
    parser.add_argument("--out", default="", help="JSON with every run and the summary")
    parser.add_argument("demo", nargs=argparse.REMAINDER, help="-- more lightspan demo options")
    args = parser.parse_args()
    extra = args.demo[1:] if args.demo[:1] == ["--"] else args.demo
    load = [os.getloadavg()[0]]
    runs = [one(int(s), Path(args.data_dir_root).resolve(), extra) for s in args.seeds.split(",")]
    load.append(os.getloadavg()[0])
    for r in runs:
        entropy = ("" if r["entropy_first"] is None else
                   f", entropy {r['entropy_first']:.2f} -> {r['entropy_last']:.2f} nats/token")
        print(f"seed {r['seed']}: held-out solved {r['before']:.1%} -> {r['after']:.1%} of {r['of']} in "
              f"{r['steps']} steps, {r['wall_s']:.0f} s wall, {r['cpu_s'] / 60:.1f} CPU-min{entropy}")
    summary = {}
    for key in ("before", "after"):
        values = [r[key] for r in runs]
        summary[key] = {"mean": statistics.mean(values), "min": min(values), "max": max(values)}
    gains = [r["after"] - r["before"] for r in runs]
    summary["gain"] = {"mean": statistics.mean(gains), "min": min(gains), "max": max(gains)}
    print(f"over {len(runs)} seeds: before {summary['before']['mean']:.1%} "
          f"({summary['before']['min']:.1%}-{summary['before']['max']:.1%}), after {summary['after']['mean']:.1%} "
          f"({summary['after']['min']:.1%}-{summary['after']['max']:.1%}), gain {summary['gain']['mean']:+.1%} "
          f"({summary['gain']['min']:+.1%} to {summary['gain']['max']:+.1%}); load {load[0]:.1f} -> {load[1]:.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "summary": summary, "load_1m": load,
                                              "argv": sys.argv[1:]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
