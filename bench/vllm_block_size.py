"""Benchmark: vLLM's KV block size on CPU and a GRPO step's shared prompts, side by side: vLLM's CPU per step's
batch of rollouts.

    .venv/bin/python bench/vllm_block_size.py [--rounds 5] [--block-sizes 128,64,32] [--groups 4] [--samples 8]

vLLM's CPU platform makes KV blocks of 128 tokens unless told otherwise, and its prefix cache only reuses
whole blocks. A demo prompt is about 51 tokens (the chat template's system prompt and the question), so with
128-token blocks the 8 rollouts of a GRPO group each compute the whole prompt their group shares. Smaller
blocks let them reuse it.

One real vLLM server per block size (``lightspan.inference``, SmolLM2-135M-Instruct as ``lightspan model
smollm2`` makes it, 2 OpenMP threads each, ``--block-size B``; 128 is vLLM's CPU default) run at once. Round
by round each server gets the same step's batch in turn: its prefix cache reset first (as lightspan's weight
sync leaves it), then ``--groups`` x ``--samples`` chat requests at once, the demo's next training additions
(``lightspan.demo.make_tasks``) in its agent's wording, 24 new tokens at temperature 0.7 with logprobs and token
ids (as the demo's rollouts ask). Recorded per server and round: CPU seconds of its process tree
(``lightspan.runs.tree_cpu_seconds``), wall seconds, tokens. Printed: the medians and each block size's ratio
to 128's, and the greedy answers of a few prompts from each server (the block size must not change them).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from lightspan import demo, inference
from lightspan.agents.math_agent import INSTRUCTION
from lightspan.models import DEFAULT_SMOLLM2_DIR, prepare_smollm2
from lightspan.runs import free_ports, tree_cpu_seconds
from vllm_servers import medians, servers


def chat(url: str, question: str, temperature: float) -> dict:
    r = requests.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": "policy", "max_tokens": 24, "temperature": temperature, "logprobs": True, "return_token_ids": True,
        "messages": [{"role": "user", "content": f"{question} {INSTRUCTION}"}]})
    r.raise_for_status()
    return r.json()


def step(url: str, questions: list[str], samples: int, pool: ThreadPoolExecutor) -> int:
    requests.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
    jobs = [q for q in questions for _ in range(samples)]
    return sum(r["usage"]["completion_tokens"] for r in pool.map(lambda q: chat(url, q, 0.7), jobs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block-sizes", default="128,64,32")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()
    prepare_smollm2(DEFAULT_SMOLLM2_DIR)
    sizes = [int(b) for b in args.block_sizes.split(",")]
    cfgs = {b: inference.VLLMConfig(model=str(DEFAULT_SMOLLM2_DIR), port=port, extra_args=f"--block-size {b}")
            for b, port in zip(sizes, free_ports(len(sizes)))}
    train, _ = demo.make_tasks(0, (args.rounds + 1) * args.groups, 0)
    questions = [t["question"] for t in train]
    work = Path(tempfile.mkdtemp(prefix="vllm-block-size-"))
    rows: dict = {b: [] for b in sizes}
    with servers(cfgs, work) as procs, ThreadPoolExecutor(args.groups * args.samples) as pool:
        greedy = {b: [chat(cfg.url, q, 0.0)["choices"][0]["message"]["content"] for q in questions[:4]]
                  for b, cfg in cfgs.items()}
        for b, cfg in cfgs.items():                     # warm-up
            step(cfg.url, questions[:args.groups], args.samples, pool)
        for k in range(1, args.rounds + 1):
            batch = questions[k * args.groups:(k + 1) * args.groups]
            for b, cfg in cfgs.items():
                c0, t0 = tree_cpu_seconds(procs[b].pid), time.monotonic()
                n = step(cfg.url, batch, args.samples, pool)
                rows[b].append({"cpu_s": tree_cpu_seconds(procs[b].pid) - c0, "wall_s": time.monotonic() - t0,
                                "tokens": n})
    med = medians(rows)
    base = med[sizes[0]]
    for b in sizes:
        print(f"block {b:>4}: vLLM CPU {med[b]['cpu_s']:.2f} s, wall {med[b]['wall_s']:.2f} s per step of "
              f"{args.groups} x {args.samples} ({med[b]['tokens']:.0f} tokens); CPU {med[b]['cpu_s'] / base['cpu_s']:.2f}x "
              f"block {sizes[0]}'s (rounds: {', '.join(format(r['cpu_s'], '.2f') for r in rows[b])})")
    same = all(greedy[b] == greedy[sizes[0]] for b in sizes)
    print(f"greedy answers of {len(greedy[sizes[0]])} prompts the same on every server: {same}")
    print(json.dumps({"rows": {str(b): r for b, r in rows.items()}, "greedy": {str(b): g for b, g in greedy.items()},
                      "argv": sys.argv[1:]}))


if __name__ == "__main__":
    main()
