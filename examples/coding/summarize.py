"""Per tier and policy version, what the coding rollouts of a run did, from its data directory:

    python examples/coding/summarize.py --data-dir /tmp/coding-run0 > examples/coding/results/seed0/summary.json

solved / rollouts, model calls (turns), prompt and completion tokens per rollout (summed over its calls,
from the captured token ids), the longest prompt, mini-swe-agent's exit statuses, and the CPU seconds of
the agent process with its sandboxes (``cpu_s`` in each rollout's summary line; vLLM's and the trainer's
CPU are not in it).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from statistics import mean


def rollout_lines(logs: Path) -> dict[str, dict]:
    """The agent's summary line (its last JSON line) per rollout id, from the rollout logs."""
    out = {}
    for path in logs.glob("*.log"):
        for line in reversed(path.read_text(errors="replace").splitlines()):
            if line.startswith("{") and '"cpu_s"' in line:
                try:
                    out[path.stem] = json.loads(line)
                except json.JSONDecodeError:
                    pass
                break
    return out


def summarize(data: Path) -> dict:
    from lightspan import store

    rows = store.connect(data).execute("""
        SELECT r.rollout_key, r.task_id, coalesce(r.split, 'train'), r.final_reward, r.status,
               c.n, c.prompt, c.completion, c.longest, c.version
        FROM rollouts r JOIN (
            SELECT rollout_key, count(*) AS n, sum(len(prompt_token_ids)) AS prompt,
                   sum(len(completion_token_ids)) AS completion, max(len(prompt_token_ids)) AS longest,
                   min(model_version) AS version
            FROM llm_calls WHERE prompt_token_ids IS NOT NULL GROUP BY 1) c USING (rollout_key)
        WHERE r.task_id IS NOT NULL""").fetchall()
    lines = rollout_lines(data / "rollout-logs")
    groups = defaultdict(list)
    for key, task_id, split, reward, status, n, prompt, completion, longest, version in rows:
        tier = task_id.rsplit("-", 1)[-1]
        groups[(split, int(version or 0), tier)].append(
            {"reward": reward, "status": status, "turns": n, "prompt": prompt, "completion": completion,
             "longest": longest, **{k: lines.get(key, {}).get(k) for k in ("cpu_s", "exit_status")}})
    out = []
    for (split, version, tier), rs in sorted(groups.items()):
        cpu = [r["cpu_s"] for r in rs if r["cpu_s"] is not None]
        statuses = defaultdict(int)
        for r in rs:
            statuses[(r["exit_status"] or r["status"] or "?").split(":")[0]] += 1
        out.append({"split": split, "policy_version": version, "tier": tier, "rollouts": len(rs),
                    "solved": sum(1 for r in rs if (r["reward"] or 0) >= 1.0),
                    "turns_mean": round(mean(r["turns"] for r in rs), 2),
                    "prompt_tokens_mean": round(mean(r["prompt"] for r in rs)),
                    "completion_tokens_mean": round(mean(r["completion"] for r in rs)),
                    "longest_prompt_max": max(r["longest"] for r in rs),
                    "agent_cpu_s_mean": round(mean(cpu), 1) if cpu else None,
                    "exit_statuses": dict(statuses)})
    return {"data_dir": str(data), "groups": out}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="the run's data directory (lightspan experiment --data-dir)")
    print(json.dumps(summarize(Path(p.parse_args(argv).data_dir)), indent=1))


if __name__ == "__main__":
    main()
