"""The reading of bench/learning_vs_trl.py's runs, pure functions: per side the held-out gain per CPU-minute
on the last evaluation and on the best, the ratios lightspan / TRL (mean and per seed), the entropy flag, and
the printed report. A run is ``{side: {seed: curve}}``, a curve a list of evaluations ``{"step", "cpu_s",
"solved", "of"}`` in order."""

from __future__ import annotations

import statistics

SIDES = ("lightspan", "trl")

ENTROPY_FLOOR = 0.2
"""nats per token: a run whose policy ends below this has collapsed (the issue's bound; the demo's
entropy_floor, lightspan/demo.py)."""


def entropy_flag(entropy: float | None, floor: float = ENTROPY_FLOOR) -> str | None:
    """The flag of a run whose final policy entropy (nats per token) fell below ``floor``: the warning
    the demo's trainer logs for such a step (trainer/metrics.py's ``entropy_warning``); a run that
    recorded no entropy is flagged too, never passed silently. None: the run kept its entropy."""
    from lightspan.trainer.metrics import entropy_warning

    if entropy is None:
        return "no policy entropy recorded: collapse cannot be ruled out"
    warning = entropy_warning(entropy, floor)
    return None if warning is None else f"ENTROPY COLLAPSE: {warning}"


def gain_per_cpu_minute(curve: list[dict]) -> float:
    first, last = curve[0], curve[-1]
    return (last["solved"] - first["solved"]) / max(last["cpu_s"] / 60.0, 1e-9)


def best_evaluation(curve: list[dict]) -> dict:
    """The curve's best evaluation: the most held-out tasks solved, the first evaluation that reached it."""
    best = max(curve, key=lambda p: p["solved"])           # max keeps the first of equals
    return {"step": best["step"], "solved": best["solved"], "of": best.get("of"), "cpu_s": best["cpu_s"]}


def best_gain_per_cpu_minute(curve: list[dict]) -> float:
    """(best - first evaluation's solved count) / the CPU-minutes at which the best was reached; 0 when
    the first evaluation is the best."""
    best = best_evaluation(curve)
    return (best["solved"] - curve[0]["solved"]) / max(best["cpu_s"] / 60.0, 1e-9)


def cpu_per_step(curve: list[dict]) -> float | None:
    """CPU-seconds a training step, from the first evaluation to the last (start-up left out); None for a
    curve without a step. What a host changes most: the same side's steps cost differently on another CPU."""
    first, last = curve[0], curve[-1]
    steps = last["step"] - first["step"]
    return (last["cpu_s"] - first["cpu_s"]) / steps if steps > 0 else None


def parts_per_step(parts: dict) -> dict:
    """Per side, each part's CPU-seconds a training step, the median over seeds. ``parts``: side -> seed ->
    ``{"cpu_s": {part: CPU-seconds over the run's steps, start-up and evaluations left out}, "steps": n}``
    (bench/learning_vs_trl.py's JSON); a seed without a step is left out, a part a seed lacks counts 0."""
    out = {}
    for side, seeds in parts.items():
        per = [{k: v / p["steps"] for k, v in p["cpu_s"].items()} for p in seeds.values() if p.get("steps")]
        if per:
            names = list(dict.fromkeys(k for d in per for k in d))
            out[side] = {"seeds": len(per), "cpu_s": {k: statistics.median(d.get(k, 0.0) for d in per) for k in names}}
    return out


PARTS = {"lightspan": "rest: the experiment's own process, the rollouts with their agents, the transition builds",
         "trl": "generate: TRL's sampling; score: the rewards and the logprobs before the update; train: the "
                "passes and the optimizer"}
"""What each side's parts are, printed beside them."""


def _ratio(lightspan: float, trl: float) -> float | None:
    return lightspan / trl if trl > 0 else None


def summarise(runs: dict) -> dict:
    """Per side: gains per CPU-minute over the seeds, on the last evaluation and on the best; the ratio
    of the means, lightspan / TRL, on each (absent when TRL's mean gain is not positive); per seed run by
    both sides, the two ratios (None where TRL gained nothing on that seed). Seeds as strings (JSON's)."""
    out: dict = {}
    for side in SIDES:
        curves = {str(seed): c for seed, c in runs.get(side, {}).items() if c}
        if curves:
            rates = [gain_per_cpu_minute(c) for c in curves.values()]
            best = [best_gain_per_cpu_minute(c) for c in curves.values()]
            out[side] = {"gain_per_cpu_min": rates, "mean": statistics.mean(rates), "range": [min(rates), max(rates)],
                         "seeds": list(curves), "best_gain_per_cpu_min": best, "best_mean": statistics.mean(best),
                         "best_range": [min(best), max(best)],
                         "best_evaluation": [best_evaluation(c) for c in curves.values()],
                         "cpu_s_per_step": [cpu_per_step(c) for c in curves.values()]}
    if "lightspan" in out and "trl" in out:
        ls, trl = out["lightspan"], out["trl"]
        if trl["mean"] > 0:
            out["ratio"] = ls["mean"] / trl["mean"]
        if trl["best_mean"] > 0:
            out["best_ratio"] = ls["best_mean"] / trl["best_mean"]
        per_seed = {}
        for seed in (s for s in ls["seeds"] if s in trl["seeds"]):
            i, j = ls["seeds"].index(seed), trl["seeds"].index(seed)
            per_seed[seed] = {"ratio": _ratio(ls["gain_per_cpu_min"][i], trl["gain_per_cpu_min"][j]),
                              "best_ratio": _ratio(ls["best_gain_per_cpu_min"][i], trl["best_gain_per_cpu_min"][j])}
        out["per_seed"] = per_seed
        out["every_seed_at_least_1x"] = {
            key: bool(per_seed) and all(r[name] is not None and r[name] >= 1.0 for r in per_seed.values())
            for key, name in (("last", "ratio"), ("best", "best_ratio"))}
    return out


def report(summary: dict, noun: str = "additions", load: list[float] | None = None,
           hosts: list[str] | None = None, parts: dict | None = None) -> list[str]:
    """The summary's printed lines: the last evaluation's (as before), then the best evaluation's, then
    each seed's ratios, then each side's CPU-seconds a step (and by part: ``parts``, :func:`parts_per_step`'s)
    and the host (``hosts``: the CPU model of each file read; several: a cross-host reading, said so)."""
    lines = []
    for side in SIDES:
        if side in summary:
            s = summary[side]
            lines.append(f"{side:>9}: held-out gain {s['mean']:+.2f} {noun} per CPU-minute "
                         f"(seeds: {', '.join(f'{r:+.2f}' for r in s['gain_per_cpu_min'])})")
    where = f"   (load {load[0]:.1f} -> {load[1]:.1f})" if load and len(load) == 2 else ""
    if "ratio" in summary:
        lines.append(f"ratio lightspan / TRL: {summary['ratio']:.2f}x{where}")
    else:
        lines.append("ratio: n/a (TRL gained nothing, or a side was not run)")
    for side in SIDES:
        if side in summary and "best_mean" in summary[side]:
            s = summary[side]
            seeds = ", ".join(f"{r:+.2f} ({b['solved']}/{b['of']} @ {b['cpu_s'] / 60:.1f})"
                              for r, b in zip(s["best_gain_per_cpu_min"], s["best_evaluation"]))
            lines.append(f"{side:>9}: best held-out gain {s['best_mean']:+.2f} {noun} per CPU-minute "
                         f"(seeds: {seeds}: best solved @ CPU-min)")
    if "best_ratio" in summary:
        lines.append(f"ratio lightspan / TRL on the best evaluation: {summary['best_ratio']:.2f}x")
    elif "lightspan" in summary and "trl" in summary:
        lines.append("ratio on the best evaluation: n/a (TRL gained nothing)")
    def show(r):
        return "n/a" if r is None else f"{r:.2f}x"
    for seed, r in summary.get("per_seed", {}).items():
        lines.append(f"seed {seed}: lightspan / TRL {show(r['ratio'])} on the last evaluation, "
                     f"{show(r['best_ratio'])} on the best")
    if "every_seed_at_least_1x" in summary:
        every = summary["every_seed_at_least_1x"]
        lines.append(f"every seed at least 1.0x: last evaluation {'yes' if every['last'] else 'no'}, "
                     f"best evaluation {'yes' if every['best'] else 'no'}")
    for side in SIDES:
        steps = [c for c in summary.get(side, {}).get("cpu_s_per_step", ()) if c is not None]
        if steps:
            lines.append(f"{side:>9}: {statistics.median(steps):.1f} CPU-s a step, median over seeds "
                         f"(seeds: {', '.join(f'{c:.1f}' for c in steps)})")
    for side, p in (parts or {}).items():
        split = ", ".join(f"{k} {v:.1f}" for k, v in p["cpu_s"].items())
        lines.append(f"{side:>9}: CPU-s a step by part, median over {p['seeds']} seed{'s' * (p['seeds'] > 1)}: "
                     f"{split} ({PARTS.get(side, '')})")
    if hosts and len(set(hosts)) == 1:
        lines.append(f"host: {hosts[0]}")
    elif hosts:
        lines.append(f"hosts differ ({'; '.join(sorted(set(hosts)))}): a cross-host reading, "
                     "each side's CPU a step moves with the host")
    return lines
