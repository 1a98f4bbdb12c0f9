"""Play held-out tasks greedily against a running policy server and write what happened, per tier.

    python examples/scienceworld/evaluate.py --base-url http://127.0.0.1:8000/v1 \\
        --tasks examples/scienceworld/data/val.jsonl --out examples/scienceworld/results/baseline.json

The agent (``agent.py``'s ``play``) in this process, without tracing: ``--workers`` episodes at once,
each with its own game engine (JVM). Per episode: the game's score, steps, refused actions,
compactions, prompt and completion tokens (the server's ``usage``); per tier: mean score, solved
(score 100) and partly solved (score > 0); CPU seconds of this process and of its JVMs (the model
server's are not counted: read them from its process). Results are rewritten after every episode, so
a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_agent():
    spec = importlib.util.spec_from_file_location("scienceworld_agent", HERE / "agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_s() -> dict:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"self": own.ru_utime + own.ru_stime, "jvms": kids.ru_utime + kids.ru_stime}


def summary(episodes: list[dict]) -> dict:
    tiers: dict[str, dict] = {}
    for e in episodes:
        t = tiers.setdefault(e["tier"], {"episodes": 0, "score_sum": 0, "solved": 0, "partly": 0, "steps": 0,
                                         "invalid": 0, "prompt_tokens": 0, "completion_tokens": 0})
        t["episodes"] += 1
        t["score_sum"] += max(0, e["score"])
        t["solved"] += e["score"] >= 100
        t["partly"] += e["score"] > 0
        for k in ("steps", "invalid", "prompt_tokens", "completion_tokens"):
            t[k] += e[k]
    out = {}
    for tier, t in tiers.items():
        n = t["episodes"]
        out[tier] = {"episodes": n, "mean_score": round(t["score_sum"] / n, 1), "solved": t["solved"],
                     "partly_solved": t["partly"], "steps_per_episode": round(t["steps"] / n, 2),
                     "refused_per_episode": round(t["invalid"] / n, 2),
                     "prompt_tokens_per_episode": round(t["prompt_tokens"] / n),
                     "completion_tokens_per_episode": round(t["completion_tokens"] / n)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the policy server's OpenAI base URL (…/v1)")
    parser.add_argument("--model", default="policy")
    parser.add_argument("--tasks", type=Path, default=HERE / "data" / "val.jsonl")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    from openai import OpenAI

    agent = load_agent()
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=2)
    lock, episodes, start, cpu0 = threading.Lock(), [], time.time(), cpu_s()

    def one(task: dict) -> None:
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "calls": 0}

        class Counting:     # the agent's client, counting the server's usage
            class chat:
                class completions:
                    @staticmethod
                    def create(**request):
                        response = client.chat.completions.create(**request)
                        usage["prompt_tokens"] += response.usage.prompt_tokens
                        usage["completion_tokens"] += response.usage.completion_tokens
                        usage["calls"] += 1
                        return response

        game = agent.Game()
        try:
            game.load(task["task_name"], int(task["variation"]), task.get("simplification", "easy"))
            opts = agent.settings({**task, "temperature": args.temperature})
            episode = agent.play(Counting, game, model=args.model, seed=agent.zlib.crc32(
                f"{task['task_name']}:{task['variation']}".encode()), **opts)
        finally:
            game.close()
            game.env._gateway.java_process.wait(timeout=30)   # reaped: its CPU counts in RUSAGE_CHILDREN
        with lock:
            episodes.append({"id": task["id"], "tier": task["tier"], **usage, **episode})
            cpu = cpu_s()
            result = {"tasks": str(args.tasks), "temperature": args.temperature, "episodes_done": len(episodes),
                      "wall_s": round(time.time() - start, 1),
                      "cpu_s": {k: round(cpu[k] - cpu0[k], 1) for k in cpu},
                      "tiers": summary(episodes), "episodes": sorted(episodes, key=lambda e: e["id"])}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(one, tasks))
    print(json.dumps(json.loads(args.out.read_text())["tiers"]))


if __name__ == "__main__":
    main()
