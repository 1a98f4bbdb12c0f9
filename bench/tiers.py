"""Per split, policy version and tier, what a run's rollouts did, from its data directory.

    .venv/bin/python bench/tiers.py --data-dir DATA_DIR --tasks examples/scienceworld/data/*.jsonl \\
        --fields score,steps,compactions,invalid > examples/scienceworld/results/seed0/tiers.json

A task's tier is its task line's ``tier`` field (the task files given; a task with none is "-"). Per
group: rollouts, solved (reward >= ``--solved-at``), partly (0 < reward < solved-at), the mean reward,
model calls (turns), prompt and completion tokens per rollout (summed over its calls, from the
captured token ids), the longest prompt, the rollouts' statuses, and for each field named by
``--fields`` in the agent's summary line (the last JSON line of its rollout log that has the first
of them) the mean of its numeric values and the count of its string values (up to a first ``:``,
e.g. an exit status's kind). A validation group's policy version is the version that served its calls.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUERY = """
SELECT r.rollout_key, r.task_id, coalesce(r.split, 'train'), r.final_reward, r.status,
       c.n, c.prompt, c.completion, c.longest, c.version
FROM rollouts r JOIN (
    SELECT rollout_key, count(*) AS n, sum(len(prompt_token_ids)) AS prompt,
           sum(len(completion_token_ids)) AS completion, max(len(prompt_token_ids)) AS longest,
           min(model_version) AS version
    FROM llm_calls WHERE prompt_token_ids IS NOT NULL GROUP BY 1) c USING (rollout_key)
WHERE r.task_id IS NOT NULL"""


def tiers_of(task_files: list[Path]) -> dict[str, str]:
    """Task id -> tier, from JSONL task files."""
    out = {}
    for path in task_files:
        for line in path.read_text().splitlines():
            if line.strip():
                task = json.loads(line)
                out[str(task["id"])] = str(task.get("tier", "-"))
    return out


def agent_lines(logs: Path, key: str) -> dict[str, dict]:
    """The agent's summary line (its last JSON line holding ``key``) per rollout id, from the rollout logs."""
    out = {}
    for path in logs.glob("*.log"):
        for line in reversed(path.read_text(errors="replace").splitlines()):
            if line.startswith("{") and f'"{key}"' in line:
                try:
                    out[path.stem] = json.loads(line)
                except json.JSONDecodeError:
                    continue
                break
    return out


def summarize(data: Path, tiers: dict[str, str], fields: list[str], solved_at: float = 1.0) -> dict:
    from lightspan import store

    rows = store.connect(data).execute(QUERY).fetchall()
    lines = agent_lines(data / "rollout-logs", fields[0]) if fields else {}
    groups = defaultdict(list)
    for key, task_id, split, reward, status, n, prompt, completion, longest, version in rows:
        groups[(split, int(version or 0), tiers.get(task_id, "-"))].append(
            {"reward": reward or 0.0, "status": status or "?", "turns": n, "prompt": prompt,
             "completion": completion, "longest": longest, "line": lines.get(key, {})})
    out = []
    for (split, version, tier), rs in sorted(groups.items()):
        statuses = defaultdict(int)
        for r in rs:
            statuses[r["status"]] += 1
        group = {"split": split, "policy_version": version, "tier": tier, "rollouts": len(rs),
                 "solved": sum(r["reward"] >= solved_at for r in rs),
                 "partly": sum(0 < r["reward"] < solved_at for r in rs),
                 "reward_mean": round(mean(r["reward"] for r in rs), 4),
                 "turns_mean": round(mean(r["turns"] for r in rs), 2),
                 "prompt_tokens_mean": round(mean(r["prompt"] for r in rs)),
                 "completion_tokens_mean": round(mean(r["completion"] for r in rs)),
                 "longest_prompt_max": max(r["longest"] for r in rs),
                 "statuses": dict(statuses)}
        for name in fields:
            values = [r["line"][name] for r in rs if isinstance(r["line"].get(name), (int, float))]
            group[f"{name}_mean"] = round(mean(values), 2) if values else None
            kinds = defaultdict(int)
            for r in rs:
                if isinstance(r["line"].get(name), str):
                    kinds[r["line"][name].split(":")[0]] += 1
            if kinds:
                group[f"{name}_counts"] = dict(kinds)
        out.append(group)
    return {"data_dir": str(data), "solved_at": solved_at, "groups": out}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="the run's data directory (lightspan experiment --data-dir)")
    p.add_argument("--tasks", nargs="+", required=True, type=Path, help="the task files (JSONL) naming each task's tier")
    p.add_argument("--fields", default="", help="comma-separated numeric fields of the agent's summary line to average")
    p.add_argument("--solved-at", type=float, default=1.0, help="a reward at least this counts as solved")
    args = p.parse_args(argv)
    fields = [f for f in args.fields.split(",") if f]
    print(json.dumps(summarize(Path(args.data_dir), tiers_of(args.tasks), fields, args.solved_at), indent=1))


if __name__ == "__main__":
    main()
