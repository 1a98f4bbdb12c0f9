"""Benchmark: vLLM's CPU per batch of rollouts with its queue readers' own waits (``vllm``: a 1 s busy
wait, a 5 s recheck) and with lightspan's (``lightspan``: ``VLLMConfig``'s ``reader_spin_s`` and
``reader_recheck_s`` defaults), side by side.

    .venv/bin/python bench/vllm_reader_spin.py [--rounds 6] [--requests 32] [--tokens 24] [--idle-s 3]

Two real vLLM servers (``lightspan.inference``, SmolLM2-135M-Instruct as ``lightspan model smollm2``
makes it, 2 OpenMP threads each), started alike but for the readers' settings (-1: vLLM's own;
lightspan's defaults, lightspan/vllm_site/sitecustomize.py). Round by round, the same batch
goes to one server and then the other, the order alternating: ``--requests`` chat requests at once
(the demo's additions, ``--tokens`` new tokens, temperature 0.7, logprobs and token ids, as the
demo's rollouts ask). A server's CPU seconds (its process tree, ``lightspan.runs.tree_cpu_seconds``)
are counted from the batch's start to ``--idle-s`` after its last answer, as a training step
follows each batch in a run: vLLM's readers keep spinning for their 1 s after the last read. The
servers are first checked to answer the same greedy tokens and logprobs. Printed: medians, the ratio
lightspan / vllm, and every round as JSON.
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

from lightspan import inference
from lightspan.models import DEFAULT_SMOLLM2_DIR, prepare_smollm2
from lightspan.runs import free_ports, tree_cpu_seconds
from vllm_servers import medians, servers

_DEFAULT = inference.VLLMConfig.__dataclass_fields__
ARMS = {"vllm": (-1.0, -1.0),   # arm -> VLLMConfig's (reader_spin_s, reader_recheck_s)
        "lightspan": (_DEFAULT["reader_spin_s"].default, _DEFAULT["reader_recheck_s"].default)}


def ask(url: str, i: int, tokens: int, temperature: float) -> dict:
    r = requests.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": "policy", "max_tokens": tokens, "temperature": temperature, "logprobs": True,
        "return_token_ids": True, "messages": [{"role": "user", "content": f"What is {11 + i} + {38 + 2 * i}? "
                                                                          "End your reply with 'Answer: <number>'."}]})
    r.raise_for_status()
    return r.json()


def greedy(url: str, tokens: int) -> list:
    """Token ids and logprobs (rounded to 1e-5) of 4 greedy answers."""
    out = []
    for i in range(4):
        choice = ask(url, i, tokens, 0.0)["choices"][0]
        out.append((choice["token_ids"], [round(p["logprob"], 5) for p in choice["logprobs"]["content"]]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--idle-s", type=float, default=3.0, help="counted after each batch's last answer")
    args = parser.parse_args()
    prepare_smollm2(DEFAULT_SMOLLM2_DIR)
    work = Path(tempfile.mkdtemp(prefix="vllm-reader-spin-"))
    cfgs = {arm: inference.VLLMConfig(model=str(DEFAULT_SMOLLM2_DIR), port=port, reader_spin_s=spin,
                                      reader_recheck_s=recheck)
            for (arm, (spin, recheck)), port in zip(ARMS.items(), free_ports(len(ARMS)))}
    with servers(cfgs, work) as procs:
        same = greedy(cfgs["vllm"].url, args.tokens) == greedy(cfgs["lightspan"].url, args.tokens)
        rows: dict = {arm: [] for arm in cfgs}
        with ThreadPoolExecutor(args.requests) as pool:
            def batch(url: str) -> int:
                return sum(pool.map(lambda i: ask(url, i, args.tokens, 0.7)["usage"]["completion_tokens"],
                                    range(args.requests)))
            for cfg in cfgs.values():                    # warm-up
                batch(cfg.url)
            time.sleep(args.idle_s)
            for round_ in range(args.rounds):
                for arm in (list(cfgs) if round_ % 2 == 0 else list(cfgs)[::-1]):
                    pid = procs[arm].pid
                    c0, t0 = tree_cpu_seconds(pid), time.monotonic()
                    n = batch(cfgs[arm].url)
                    wall = time.monotonic() - t0
                    time.sleep(args.idle_s)
                    rows[arm].append({"cpu_s": round(tree_cpu_seconds(pid) - c0, 2), "wall_s": round(wall, 2),
                                      "tokens": n})
    med = medians(rows)
    for arm in rows:
        print(f"{arm:>9} (reader_spin_s {ARMS[arm][0]:g}, reader_recheck_s {ARMS[arm][1]:g}): "
              f"vLLM CPU {med[arm]['cpu_s']:.2f} s, wall "
              f"{med[arm]['wall_s']:.2f} s per batch of {args.requests} ({med[arm]['tokens']:.0f} tokens), "
              f"median of {args.rounds}")
    print(f"lightspan / vllm: CPU {med['lightspan']['cpu_s'] / med['vllm']['cpu_s']:.2f}x, wall "
          f"{med['lightspan']['wall_s'] / med['vllm']['wall_s']:.2f}x; greedy tokens and logprobs the same: {same}")
    print(json.dumps({"rows": rows, "same_greedy": same, "argv": sys.argv[1:]}))


if __name__ == "__main__":
    main()
