"""What ``lightspan experiment`` shows of a finished run: the learning curve (``curve.png``) and the
summary it prints."""

from __future__ import annotations

import sys
from pathlib import Path

_PHASES = {"start_up": "of training, before its first step"}   # how the CPU-by-part line names a phase


def plot(results: dict, path: Path) -> Path:
    """The learning curve: train reward per step, held-out reward at each checkpoint."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=80)
    train = results["train"]
    # x is the step: step k's train batch was sampled before its update; the held-out point at k
    # is after k steps (0: before training), labelled with the policy version it evaluated
    ax.plot([t["step"] for t in train], [t["reward_mean"] for t in train], "o-", ms=3, color="tab:blue",
            label=f"train reward (step k's rollouts, T={results['config']['temperature']:.1f})")
    val = results["val"]
    ax.plot([v["step"] for v in val], [v["reward_mean"] for v in val], "s--", ms=6, color="tab:red",
            label=f"held-out reward after k steps (greedy, {val[0]['rollouts'] if val else 0} tasks)")
    for v in val:
        ax.annotate(f"{v['reward_mean']:.2f} (policy {v['policy_version']})", (v["step"], v["reward_mean"]),
                    textcoords="offset points", xytext=(-30, 7), fontsize=8, color="tab:red")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("GRPO step k")
    ax.set_ylabel("mean reward")
    ax.set_title(f"{results['name']}: {results['model']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def report(results: dict, out_dir: Path) -> None:
    """The run's summary on stdout: held-out before and after, train reward per step, the trainer's
    steps, wall time per stage and CPU time per part."""
    before, after = results["val"][0], results["val"][-1]
    out = sys.stdout
    out.write(f"\n==== lightspan experiment: {results['name']} ====\n")
    out.write(f"held-out validation ({before['rollouts']} tasks, greedy):\n")
    out.write(f"  before (policy {before['policy_version']}): mean reward {before['reward_mean']:.3f}, "
              f"solved {before['solved']:.1%}\n")
    out.write(f"  after  (policy {after['policy_version']}): mean reward {after['reward_mean']:.3f}, "
              f"solved {after['solved']:.1%}  ({after['reward_mean'] - before['reward_mean']:+.3f})\n")
    out.write("train reward per step: " + " ".join(f"{t['reward_mean']:.2f}" for t in results["train"]) + "\n")
    out.write(f"trainer: {results['trainer']['steps']} steps; wall time {results['wall_seconds']:.0f} s "
              f"({', '.join(f'{k} {v:.0f}' for k, v in results['stage_seconds'].items())})\n")
    by_part = results.get("cpu_seconds_by_part")
    if by_part:
        out.write("CPU-s by part: " + "; ".join(
            f"{_PHASES.get(phase, phase)} " + ", ".join(f"{k} {v:.0f}" for k, v in parts.items())
            for phase, parts in by_part.items()) + "\n")
    out.write(f"results: {out_dir / 'results.json'}, {out_dir / 'curve.png'}\n")
