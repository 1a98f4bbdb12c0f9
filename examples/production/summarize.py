"""One run of the example in a few numbers: ``results/seedS/summary.json`` (run.sh writes the inputs).

    python examples/production/summarize.py --out examples/production/results/seed0 \
      --records /tmp/production-run/logs --data-dir /tmp/production-run

From the traffic's records (``RECORDS/NAME.jsonl``: every request with the right total and ``t``, its
wall-clock time), run.sh's ``OUT/timings.jsonl``, the SFT run's ``OUT/sft_summary.json``,
``OUT/cost.json`` (measure.py) and the store (which policy version served each request, the canary's decisions):

- ``stages``: per stage of traffic, the reward (share of requests answered right) per simulated hour
  and over the stage, and by the policy version that served the requests (from the store: a request's
  rollout's ``model_version``; the rollout's latest call's version, which is every call's under a
  canary);
- ``bad_version``: the deliberately bad version's canary: its decision, how long it took (wall seconds
  and simulated hours of its traffic, from the canary's start to the decision) and the share of that
  traffic's requests it served before the decision;
- ``deployments``: every canary decision, with its evidence; ``timings``: wall seconds per step.

Over seeds, from their ``summary.json`` files (mean and range of each figure the README reports):

    python examples/production/summarize.py --seeds examples/production/results/seed{0,1,2} \
      --out examples/production/results/seeds.json
"""

from __future__ import annotations

import argparse
import json
from itertools import zip_longest
from pathlib import Path

STAGES = ("hosted", "base", "sft", "rl", "bad")
DECISIONS = """SELECT time_unix_nano, action, version, actor, share, serving_version, candidate_rollouts,
    serving_rollouts, candidate_reward_mean, serving_reward_mean, p_value, reason FROM deployments
    ORDER BY time_unix_nano"""


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def versions(data_dir: str, keys: list[str]) -> dict[str, int | None]:
    """The policy version that served each rollout key (None: not a policy's, e.g. the hosted model)."""
    from lightspan import store

    if not keys:
        return {}
    con = store.connect(data_dir)
    try:
        rows = con.execute("SELECT rollout_key, model_version FROM rollouts WHERE list_contains($k, rollout_key)",
                           {"k": keys}).fetchall()
    finally:
        con.close()
    return dict(rows)


def stage(records: list[dict], served: dict[str, int | None]) -> dict:
    requests = [r for r in records if r["kind"] == "request"]
    hours = [r for r in records if r["kind"] == "hour"]
    by_version: dict[str, list[int]] = {}
    for r in requests:
        key = served.get(r["request_id"]) if r["request_id"] else None
        by_version.setdefault("none" if key is None else str(key), []).append(int(r["right"]))
    return {"requests": len(requests), "reward": round(sum(r["right"] for r in requests) / max(1, len(requests)), 4),
            "reward_per_hour": [h["reward"] for h in hours], "errors": sum(r["error"] is not None for r in requests),
            "feedback": sum(r["kind"] == "feedback" for r in records),
            "by_version": {v: {"requests": len(x), "reward": round(sum(x) / len(x), 4)} for v, x in by_version.items()},
            "wall_s": round(requests[-1]["t"] - requests[0]["t"], 1) if requests and "t" in requests[0] else None}


def bad_canary(timings: list[dict], decisions: list[dict], records: list[dict], served: dict) -> dict | None:
    """The bad version's canary: decision, time to it, share of its traffic served before it."""
    marks = [m for m in timings if m["event"] == "bad_traffic"]
    if not marks:
        return None
    version = marks[-1]["version"]
    began = [d for d in decisions if d["version"] == version and d["action"] == "canary"]
    decided = [d for d in decisions if d["version"] == version and d["action"] in ("promote", "rollback")]
    out = {"version": version, "canary_began": bool(began), "decision": decided[0]["action"] if decided else None}
    if not began:
        return out
    start = began[0]["time_unix_nano"] / 1e9
    end = decided[0]["time_unix_nano"] / 1e9 if decided else float("inf")
    during = [r for r in records if r["kind"] == "request" and start <= r["t"] <= end]
    mine = [r for r in during if r["request_id"] and served.get(r["request_id"]) == version]
    out.update({"decision_evidence": {k: decided[0][k] for k in ("candidate_rollouts", "serving_rollouts",
                                                               "candidate_reward_mean", "serving_reward_mean",
                                                               "p_value", "reason")} if decided else None,
                "wall_s_to_decision": round(end - start, 1) if decided else None,
                # the simulated time of the last request before the decision (its traffic began at 0 h)
                "simulated_h_to_decision": during[-1]["at_h"] if decided and during else None,
                "decided_while_traffic_ran": bool(decided) and any(r["t"] > end for r in records
                                                                   if r["kind"] == "request"),
                "requests_before_decision": len(during), "served_by_bad_version": len(mine),
                "share_of_traffic": round(len(mine) / len(during), 4) if during else None,
                "bad_version_reward": round(sum(r["right"] for r in mine) / len(mine), 4) if mine else None})
    return out


def spread(values: list) -> dict | None:
    """Mean and range of the seeds' figures that exist (a run without the figure is left out, and counted)."""
    xs = [v for v in values if v is not None]
    return {"mean": round(sum(xs) / len(xs), 4), "min": min(xs), "max": max(xs), "seeds": len(xs)} if xs else None


def hourly(series: list[list[float]]) -> list[float]:
    """Per simulated hour, the mean over the runs that had that hour."""
    means = []
    for hour in zip_longest(*series):
        xs = [x for x in hour if x is not None]
        means.append(round(sum(xs) / len(xs), 4))
    return means


def across(summaries: dict[str, dict]) -> dict:
    """The figures of several seeds' runs: reward per stage, SFT and RL by version, the bad version's canary, cost."""
    runs = list(summaries.values())

    def each(get) -> list:
        out = []
        for run in runs:
            try:
                out.append(get(run))
            except (KeyError, TypeError):
                out.append(None)
        return out

    stages = sorted({name for run in runs for name in run["stages"]}, key=STAGES.index)

    def rl_versions(run: dict) -> float | None:
        """The rl stage's reward on the requests the RL-trained versions served (not the SFT version's)."""
        sft = set(run["stages"]["sft"]["by_version"])
        mine = [v for k, v in run["stages"]["rl"]["by_version"].items() if k not in sft and k != "none"]
        n = sum(v["requests"] for v in mine)
        return round(sum(v["reward"] * v["requests"] for v in mine) / n, 4) if n else None

    bad = [run.get("bad_version") or {} for run in runs]
    return {
        "runs": list(summaries),
        "reward": {name: spread(each(lambda r, n=name: r["stages"][n]["reward"])) for name in stages},
        "reward_per_hour": {name: hourly([r["stages"][name].get("reward_per_hour", []) for r in runs
                                          if name in r["stages"]]) for name in stages},
        "rl_trained_versions_reward": spread(each(rl_versions)),
        "sft_exact_match": {"before": spread(each(lambda r: r["sft"]["val/exact_match_before"])),
                            "after": spread(each(lambda r: r["sft"]["val/exact_match_after"]))},
        "bad_version": {"decisions": [b.get("decision") for b in bad],
                        "share_of_traffic": spread([b.get("share_of_traffic") for b in bad]),
                        "served_by_bad_version": spread([b.get("served_by_bad_version") for b in bad]),
                        "wall_s_to_decision": spread([b.get("wall_s_to_decision") for b in bad]),
                        "simulated_h_to_decision": spread([b.get("simulated_h_to_decision") for b in bad])},
        "wall_minutes": spread(each(lambda r: r["cost"]["wall_min"])),
        "cpu_minutes": spread(each(lambda r: r["cost"]["cpu_min"]))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the run's results directory (run.sh's OUT); with --seeds, "
                                                      "the JSON file to write")
    parser.add_argument("--records", help="the traffic's records (run.sh's LOGS)")
    parser.add_argument("--data-dir", help="the run's lightspan data directory")
    parser.add_argument("--seeds", nargs="+", metavar="DIR", help="summarise these runs' summary.json over seeds")
    args = parser.parse_args(argv)
    if args.seeds:
        summaries = {d: json.loads((Path(d) / "summary.json").read_text()) for d in args.seeds}
        for d, summary in summaries.items():   # measure.py writes cost.json after run.sh's own summary
            if summary.get("cost") is None and (Path(d) / "cost.json").is_file():
                summary["cost"] = json.loads((Path(d) / "cost.json").read_text())
        result = across(summaries)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({"reward": {k: v and v["mean"] for k, v in result["reward"].items()},
                          "bad_version": result["bad_version"]["decisions"]}))
        return 0
    if not (args.records and args.data_dir):
        parser.error("--records and --data-dir are needed for one run (or pass --seeds)")
    out = Path(args.out)
    from lightspan import store

    records = {name: _lines(Path(args.records) / f"{name}.jsonl") for name in STAGES}
    served = versions(args.data_dir, [r["request_id"] for rs in records.values() for r in rs
                                      if r["kind"] == "request" and r["request_id"]])
    con = store.connect(args.data_dir)
    try:
        cursor = con.execute(DECISIONS)
        names = [c[0] for c in cursor.description]
        decisions = [dict(zip(names, row)) for row in cursor.fetchall()]
    except Exception:          # no deployments table before the rl stage
        decisions = []
    finally:
        con.close()
    timings = _lines(out / "timings.jsonl")
    sft = json.loads((out / "sft_summary.json").read_text()) if (out / "sft_summary.json").is_file() else {}
    keep = ("examples", "assistant_tokens", "prompt_tokens", "epochs", "optimizer_steps", "loss_first_epoch",
            "loss_last_epoch", "val/examples", "val/loss_before", "val/loss_after", "val/exact_match_before",
            "val/exact_match_after", "seconds")
    summary = {
        "stages": {name: stage(rs, served) for name, rs in records.items() if rs},
        "sft": {k: sft.get(f"train/sft/{k}") for k in keep},
        "bad_version": bad_canary(timings, decisions, records["bad"], served),
        "deployments": [{**d, "t": round(d.pop("time_unix_nano") / 1e9, 3)} for d in decisions],
        "timings": {f"{a['event']}->{b['event']}": round(b["t"] - a["t"], 1) for a, b in zip(timings, timings[1:])},
        "cost": json.loads((out / "cost.json").read_text()) if (out / "cost.json").is_file() else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(json.dumps({k: summary["stages"][k]["reward"] for k in summary["stages"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
