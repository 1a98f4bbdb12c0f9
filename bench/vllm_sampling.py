"""Diagnostic: does vLLM (CPU, float32, as lightspan serves the demo's policy) sample from the distribution the
trainer trains on? Issue 33: the batches lightspan trains on are sampled by vLLM, TRL's by transformers.

    .venv/bin/python bench/vllm_sampling.py [--first-tokens 2000] [--prompts 4] [--completions 64] [--out F.json]

vLLM starts as the demo starts it (``lightspan.inference.VLLMConfig``'s command: ``--dtype float32``,
``--logprobs-mode processed_logprobs``), serving SmolLM2-135M-Instruct (``lightspan model smollm2``'s). The
prompts are the demo's training additions (``lightspan.demo.make_tasks``, seed 0) in the demo agent's
wording, rendered by the tokenizer's chat template (as vLLM's chat endpoint renders them) and sent as token
ids to ``/v1/completions`` at temperature ``--temperature``. The exact distribution is
softmax(logits / T) of the same model in transformers, float32: what the trainer's logprobs are.

1. **First token**: ``--first-tokens`` single-token samples of the first prompt against the exact
   probabilities: each of the six likeliest tokens' frequency and its z-score, and a chi-square test over
   those six and the rest.
2. **Every token of whole completions** (``--prompts`` x ``--completions`` of up to 24 tokens): the
   randomised probability integral transform of each sampled token under the exact distribution at its
   position, the vocabulary ordered from the likeliest down: u = P(likelier tokens) + V * p(token), V
   uniform. Sampled from the exact distribution, u is uniform on [0, 1]; a sampler that is too greedy (a
   lower temperature, a top-k or top-p) pushes u towards 0, one too flat towards 1. Printed: the mean of u
   (0.5 expected), the Kolmogorov-Smirnov distance to the uniform and its p-value, and the largest
   difference between the logprob vLLM recorded for a sampled token and the exact one.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
from pathlib import Path

import numpy as np
import requests
import torch
from scipy import stats
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightspan import demo, inference
from lightspan.agents.math_agent import INSTRUCTION
from lightspan.models import DEFAULT_SMOLLM2_DIR, prepare_smollm2
from lightspan.runs import free_ports
from vllm_servers import servers


def sample(url: str, model: str, prompt: list[int], n: int, max_tokens: int, temperature: float) -> list[dict]:
    """``n`` completions of ``prompt`` (token ids) with the token ids and logprobs vLLM sampled."""
    out = []
    while len(out) < n:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                "n": min(100, n - len(out)), "logprobs": 1, "return_token_ids": True}
        response = requests.post(f"{url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        for c in response.json()["choices"]:
            ids, logprobs = c["token_ids"], c["logprobs"]["token_logprobs"]
            if len(ids) != len(logprobs):
                raise RuntimeError(f"vLLM returned {len(ids)} token ids and {len(logprobs)} logprobs")
            out.append({"ids": ids, "logprobs": logprobs})
    return out


def exact_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at each completion position: (len(completion), vocabulary)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:len(prompt) + len(completion) - 1]
    return torch.log_softmax(logits.float() / temperature, -1)


def first_token(model, tokenizer, url: str, name: str, prompt: list[int], n: int, temperature: float) -> dict:
    probs = exact_logprobs(model, prompt, [0], temperature)[0].exp()
    counts: dict[int, int] = {}
    for s in sample(url, name, prompt, n, 1, temperature):
        counts[s["ids"][0]] = counts.get(s["ids"][0], 0) + 1
    top = torch.topk(probs, 6)
    rows, observed, expected = [], [], []
    for p, token in zip(top.values.tolist(), top.indices.tolist()):
        k = counts.get(token, 0)
        rows.append({"token": tokenizer.convert_ids_to_tokens(token), "exact": p, "vllm": k / n,
                     "z": (k / n - p) / math.sqrt(p * (1 - p) / n)})
        observed.append(k)
        expected.append(p * n)
    observed.append(n - sum(observed))
    expected.append(n - sum(expected))
    chi2 = stats.chisquare(observed, expected)
    return {"samples": n, "tokens": rows, "chi2": float(chi2.statistic), "p_value": float(chi2.pvalue)}


def integral_transform(model, url: str, name: str, prompts: list[list[int]], n: int, temperature: float,
                       rng: random.Random) -> dict:
    us, logprob_diffs = [], []
    for prompt in prompts:
        for s in sample(url, name, prompt, n, 24, temperature):
            exact = exact_logprobs(model, prompt, s["ids"], temperature)
            for i, token in enumerate(s["ids"]):
                p = exact[i].exp()
                order = torch.argsort(p, descending=True)
                rank = int((order == token).nonzero()[0, 0])
                below = float(p[order[:rank]].sum())
                us.append(below + rng.random() * float(p[token]))
                logprob_diffs.append(abs(float(exact[i, token]) - s["logprobs"][i]))
    ks = stats.kstest(us, "uniform")
    return {"tokens": len(us), "u_mean": float(np.mean(us)), "u_mean_se": float(np.std(us) / math.sqrt(len(us))),
            "ks_distance": float(ks.statistic), "ks_p_value": float(ks.pvalue),
            "deciles": np.histogram(us, bins=10, range=(0, 1))[0].tolist(),
            "max_abs_logprob_diff": max(logprob_diffs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first-tokens", type=int, default=2000)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--completions", type=int, default=64, help="per prompt")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    model_dir = str(prepare_smollm2(DEFAULT_SMOLLM2_DIR))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    train, _ = demo.make_tasks(args.seed, args.prompts, 0)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": f"{t['question']} {INSTRUCTION}"}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
               for t in train]
    cfg = inference.VLLMConfig(model=model_dir, port=free_ports(1)[0], seed=args.seed)
    with tempfile.TemporaryDirectory() as work, servers({"policy": cfg}, Path(work)):
        name = cfg.served_base_name
        result = {"temperature": args.temperature,
                  "first_token": first_token(model, tokenizer, cfg.url, name, prompts[0], args.first_tokens,
                                             args.temperature),
                  "completions": integral_transform(model, cfg.url, name, prompts, args.completions,
                                                    args.temperature, random.Random(args.seed))}
    f = result["first_token"]
    print(f"first token, {f['samples']} samples at T {args.temperature}: chi-square {f['chi2']:.2f}, p {f['p_value']:.3f}")
    for row in f["tokens"]:
        print(f"  {row['token']!r:>12}  exact {row['exact']:.4f}  vLLM {row['vllm']:.4f}  z {row['z']:+.2f}")
    c = result["completions"]
    print(f"every sampled token of {args.prompts} x {args.completions} completions ({c['tokens']} tokens): "
          f"mean u {c['u_mean']:.4f} +- {c['u_mean_se']:.4f} (0.5 expected), KS distance {c['ks_distance']:.4f}, "
          f"p {c['ks_p_value']:.3f}; deciles {c['deciles']}; recorded logprobs within {c['max_abs_logprob_diff']:.1e}")
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": vars(args), **result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
