"""GPU check: lightspan's trainer step on a ~0.5B Qwen2 with random weights, no network.

    bench/gpu_check.sh [--out FILE.json] [--steps 10] [--batch 16] [--prompt-len 512]
                       [--completion-len 512] [--micro-batch 4] [--peak-tflops T]
    bench/gpu_check.sh --smoke          # tiny config on the CPU, seconds (what the test runs)

1. Checks what is importable (torch with CUDA, transformers, accelerate, trl, duckdb, pyarrow,
   the trainer from this checkout) and exits 2 naming what is missing; downloads nothing.
2. Builds the model from a Qwen2.5-0.5B-shaped ``Qwen2Config`` (24 layers, hidden 896, 14 heads,
   2 KV heads, vocabulary 151,936, untied embeddings as vLLM's reload needs: 0.63B parameters)
   with random weights; token ids are synthetic, so no tokenizer is needed.
3. Runs ``lightspan.trainer.loop.Trainer.step`` itself (collate -> token logprobs -> the GRPO
   loss of trainer/loss.py -> backward -> clip -> AdamW) on synthetic transitions, with
   accelerate's bf16 mixed precision (fp32 master weights and AdamW state, bf16 autocast), as
   ``accelerate launch --config_file deploy/accelerate/ddp.yaml`` runs it. Warm-up steps are
   not timed; each timed step ends with ``torch.cuda.synchronize()``.
4. Records tokens/s (prompt + completion tokens through forward and backward), peak memory
   (``torch.cuda.max_memory_allocated``, from model creation on) and model FLOPs utilisation:
   MFU = 6 N tokens / step time / peak, with N the parameters less the input embedding (a
   lookup, not a matmul) and the peak the GPU's dense bf16 tensor-core rate from ``PEAK_TFLOPS``
   (H100/H200 SXM: 989 TFLOP/s). 6N ignores attention's own FLOPs and counts the LM head on
   prompt positions that the trainer skips (``logits_to_keep``): both small at these lengths.
5. NCCL weight sync is timed only where vLLM is importable and lightspan has an NCCL backend;
   otherwise the JSON says why it was skipped.

Writes one JSON object to --out (default ``$OUT/gpu_check.json``, else ``bench/gpu_check.json``)
and prints it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("gpu_check")

# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, from NVIDIA's data sheets; matched on the
# device name in order, so the more specific names come first.
PEAK_TFLOPS = (
    ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("GH200", 989.4), ("B200", 2250.0),
    ("A100", 312.0), ("L40S", 362.1), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0),
    ("RTX 4090", 165.2), ("RTX 6000 Ada", 364.2), ("A6000", 154.8),
)

QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
             tie_word_embeddings=False)
REQUIRED = ("torch", "transformers", "accelerate", "trl", "safetensors", "duckdb", "pyarrow")


def peak_tflops(device_name: str) -> float | None:
    for key, tflops in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def check_imports() -> list[str]:
    """The missing modules, after making this checkout's trainer importable as lightspan.*."""
    missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if missing:
        return missing
    try:
        importlib.import_module("lightspan.trainer.loop")
    except ModuleNotFoundError as exc:
        if exc.name and not exc.name.startswith("lightspan"):
            return [exc.name]
        # not installed: map lightspan.<component> onto this checkout's folders, as pyproject's
        # package-dir does for an installed lightspan
        sys.path.insert(0, str(REPO))
        for name in [m for m in sys.modules if m == "lightspan" or m.startswith("lightspan.")]:
            del sys.modules[name]
        import lightspan

        lightspan.__path__.append(str(REPO))
        try:
            importlib.import_module("lightspan.trainer.loop")
        except ModuleNotFoundError as exc2:
            return [exc2.name or str(exc2)]
    return []


def synthetic_rows(n: int, prompt_len: int, completion_len: int, vocab: int, seed: int) -> list[dict]:
    """Transitions as the store holds them: random token ids, half advantage +1, half -1, and
    behaviour logprobs near a uniform policy's, so the IS weights stay near 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, vocab, (prompt_len + completion_len,), generator=g).tolist()
        rows.append({"transition_id": f"t{i}", "rollout_id": f"r{i}", "task_id": f"task{i // 8}",
                     "prompt_token_ids": ids[:prompt_len], "completion_token_ids": ids[prompt_len:],
                     "completion_logprobs": [-float(torch.log(torch.tensor(float(vocab))))] * completion_len,
                     "completion_mask": None, "advantage": 1.0 if i % 2 == 0 else -1.0, "temperature": 1.0,
                     "reward": float(i % 2 == 0), "model_version": 0, "created_unix_nano": i})
    return rows


def nccl_sync_status() -> dict:
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not importable"}
    sync = importlib.import_module("lightspan.trainer.sync")
    if not any("nccl" in name.lower() for name in dir(sync)):
        return {"skipped": "vllm is importable, but trainer/sync.py has no NCCL backend yet"}
    return {"skipped": "an NCCL backend exists, but timing it needs a vLLM server on a second GPU: "
                       "not part of this single-GPU check"}


def run(args) -> dict:
    import torch
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightspan.trainer.config import TrainerConfig
    from lightspan.trainer.loop import Batch, Cursor, Trainer

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("gpu_check: torch.cuda.is_available() is False: no usable NVIDIA GPU "
                         "(run with --smoke for the CPU self-test)")
    # the trainer's Accelerator reads this, as under accelerate launch --mixed_precision bf16
    os.environ["ACCELERATE_MIXED_PRECISION"] = args.precision
    device_name = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"
    shape = SMOKE if args.smoke else QWEN2_05B
    config = Qwen2Config(**shape)

    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainerConfig(model=tmp, data_dir=tmp, sync="none", micro_batch_size=args.micro_batch,
                            batch_size=args.batch, learning_rate=1e-6, **_metrics_off(TrainerConfig))
        trainer = Trainer(cfg)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        t0 = time.monotonic()
        model = Qwen2ForCausalLM(config)            # fp32 master weights, random
        build_s = time.monotonic() - t0
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        trainer.model, trainer.optimizer = trainer.accelerator.prepare(model, optimizer)

        params = sum(p.numel() for p in model.parameters())
        flop_params = params - model.get_input_embeddings().weight.numel()
        step_times, losses = [], []
        for step in range(args.warmup + args.steps):
            rows = synthetic_rows(args.batch, args.prompt_len, args.completion_len, config.vocab_size, seed=step)
            batch = Batch(rows=rows, cursor=Cursor(step, f"t{step}"), reward_mean=0.5)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.monotonic()
            metrics = trainer.step(batch)
            if cuda:
                torch.cuda.synchronize()
            if step >= args.warmup:
                step_times.append(time.monotonic() - t0)
                losses.append(metrics["loss"])

    tokens = args.batch * (args.prompt_len + args.completion_len)
    mean_s = sum(step_times) / len(step_times)
    peak = args.peak_tflops or (peak_tflops(device_name) if cuda else None)
    achieved = 6 * flop_params * tokens / mean_s / 1e12
    return {
        "mode": "smoke (CPU, tiny config)" if args.smoke else "gpu",
        "device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "model": {"config": "tiny Qwen2" if args.smoke else "Qwen2.5-0.5B shape, random weights, untied",
                  "parameters": params, "flop_parameters": flop_params, "build_seconds": round(build_s, 2)},
        "precision": f"accelerate mixed_precision={args.precision} (fp32 master weights and AdamW state)",
        "batch": {"sequences": args.batch, "prompt_len": args.prompt_len, "completion_len": args.completion_len,
                  "micro_batch": args.micro_batch, "tokens_per_step": tokens},
        "steps": {"warmup": args.warmup, "timed": args.steps, "seconds": [round(s, 6) for s in step_times],
                  "mean_seconds": round(mean_s, 6), "min_seconds": round(min(step_times), 6)},
        "losses": losses,
        "tokens_per_second": round(tokens / mean_s, 1),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
        "achieved_tflops": round(achieved, 3),
        "peak_bf16_tflops": peak,
        "mfu": round(achieved / peak, 4) if peak else None,
        "mfu_formula": "6 * flop_parameters * tokens_per_step / mean_seconds / peak_bf16_tflops",
        "nccl_weight_sync": nccl_sync_status(),
    }


def _metrics_off(config_cls) -> dict:
    # no Prometheus endpoint for a benchmark, where the config has one
    return {"metrics_port": 0} if "metrics_port" in config_cls.__dataclass_fields__ else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny config on the CPU: a self-test in seconds")
    p.add_argument("--out", default=None, help="JSON file (default $OUT/gpu_check.json, else bench/gpu_check.json)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; smoke 1)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 16; smoke 4)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; smoke 24)")
    p.add_argument("--completion-len", type=int, default=None, help="completion tokens (default 512; smoke 16)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward (default 4; smoke 2)")
    p.add_argument("--precision", default=None, choices=["bf16", "no"],
                   help="accelerate mixed precision (default bf16; smoke no)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not in PEAK_TFLOPS")
    args = p.parse_args(argv)
    defaults = dict(steps=(2, 10), warmup=(1, 2), batch=(4, 16), prompt_len=(24, 512), completion_len=(16, 512),
                    micro_batch=(2, 4), precision=("no", "bf16"))
    for name, (smoke, gpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else gpu)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    missing = check_imports()
    if missing:
        sys.stderr.write(f"gpu_check: cannot import {', '.join(missing)}; this check downloads nothing. "
                         f"Install them (pip install -e {REPO}) or run where they are installed.\n")
        return 2
    if args.smoke:
        import torch

        torch.set_num_threads(1)          # a self-test, not a CPU benchmark: stay light on a shared machine
    result = run(args)
    out = Path(args.out or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT")
                            else REPO / "bench" / "gpu_check.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write(json.dumps(result) + "\n")
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
