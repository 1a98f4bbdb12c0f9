"""Held-out solved, by family, of whatever policy a vLLM serves now: the agent's own loop and sandbox,
greedy, without lightspan (no traces, no training).

    python examples/sandbox/evaluate.py --base-url http://127.0.0.1:8731/v1 [--tasks examples/sandbox/data/val.jsonl]

Prints one JSON line: solved, of, and solved/of per family.
"""

from __future__ import annotations

import argparse
import collections
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

from agent import Sandbox, SandboxConfig, score, solve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--tasks", default=str(Path(__file__).parent / "data" / "val.jsonl"))
    parser.add_argument("--model", default="policy")
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    tasks = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line.strip()]
    client, box = OpenAI(base_url=args.base_url, api_key="none"), Sandbox(SandboxConfig.from_env())
    box.check()

    def one(task: dict) -> tuple[str, float]:
        episode = solve(client, box, task["question"], model=args.model, temperature=0.0)
        return task.get("family", "all"), score(episode["answer"], task["answer"])

    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(one, tasks))
    families = collections.defaultdict(list)
    for family, reward in results:
        families[family].append(reward >= 1)
    print(json.dumps({"solved": sum(ok for v in families.values() for ok in v), "of": len(results),
                      "by_family": {f: f"{sum(v)}/{len(v)}" for f, v in sorted(families.items())}}))


if __name__ == "__main__":
    main()
