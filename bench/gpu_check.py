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
5. Where vllm is importable and a second GPU exists (NCCL refuses two ranks of one group on one
   device), times lightspan's ``nccl`` weight sync (trainer/nccl.py ``NcclSync``): starts a vLLM
   server on the second GPU (``--load-format dummy``, float32, dev mode, ``--weight-transfer-config
   '{"backend": "nccl"}'``), joins its NCCL group, pushes the trained model ``--nccl-syncs`` times
   and checks that vLLM's prompt logprobs of a fixed sequence then match the trainer's (fp32).
   Otherwise the JSON says why it was skipped.

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
import signal
import socket
import subprocess
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


def nccl_skip_reason(cuda: bool) -> str | None:
    """Why NCCL weight sync cannot be timed here, or None."""
    import torch

    if not cuda:
        return "no GPU"
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not importable (the trainer end of vLLM's NCCL group is vllm's own code)"
    problem = importlib.import_module("lightspan.trainer.nccl").nccl_problem()
    if problem:
        return problem
    if torch.cuda.device_count() < 2:
        return "one GPU: NCCL refuses two ranks of one group on one device, so vLLM needs a second GPU"
    return None


def full_vocab_tokenizer(vocab_size: int):
    """A word-level tokenizer with one token per id (``<t0>`` .. ``<tN-1>``), built offline, so vLLM
    can detokenize any id a random model samples."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>", eos_token="<t1>", pad_token="<t2>")


def start_dummy_vllm(config, tmp: Path, gpu: str, python: str = sys.executable) -> tuple[subprocess.Popen, str, Path]:
    """A vLLM server on GPU ``gpu`` for ``config`` with random (dummy) weights, in dev mode with the
    NCCL weight-transfer engine; returns (process, url, log path) once it is healthy."""
    import requests

    served = tmp / "served"
    config.save_pretrained(served)                   # --load-format dummy: the config is all vLLM reads
    full_vocab_tokenizer(config.vocab_size).save_pretrained(served)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, log_path = f"http://127.0.0.1:{port}", tmp / "vllm.log"
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(served),
           "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--enforce-eager", "--load-format", "dummy",
           "--max-model-len", str(min(1024, config.max_position_embeddings)),
           "--gpu-memory-utilization", "0.5", "--weight-transfer-config", '{"backend": "nccl"}']
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1"}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {proc.returncode} before it was healthy")
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM was not healthy within 240 s")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    return proc, url, log_path
            except requests.RequestException:
                pass
            time.sleep(1)
    except BaseException as exc:
        _stop(proc)
        exc.add_note(log_path.read_text(errors="replace")[-3000:])
        raise


def time_nccl_sync(model, tmp: Path, syncs: int) -> dict:
    """Start vLLM on the second visible GPU with dummy weights, then push ``model`` (on the first)
    ``syncs`` times with NcclSync; returns timings and the logprob check, or the error."""
    import torch

    from lightspan.trainer.nccl import NcclSync
    from lightspan.trainer.sync import prompt_logprobs

    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    gpu = visible[1] if len(visible) > 1 else "1"
    proc = None
    try:
        t0 = time.monotonic()
        proc, url, _ = start_dummy_vllm(model.config, tmp, gpu)
        startup_s = time.monotonic() - t0
        ids = list(range(10, 42))
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=next(model.parameters()).device)).logits[0].float()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()

        def diff():
            return max(abs(a - b) for a, b in zip(prompt_logprobs(url, "policy", ids), expected))

        before = diff()
        sync = NcclSync(url, lambda: model)
        pushes = [sync.push(tmp / "unused", version) for version in range(1, syncs + 1)]
        after = diff()
        sync.close()
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        transfer = [p["sync_rpc_seconds"] for p in pushes]
        return {"vllm": importlib.import_module("vllm").__version__, "server_gpu": gpu,
                "server": "float32, --load-format dummy, --enforce-eager", "vllm_startup_seconds": round(startup_s, 1),
                "bytes_per_sync": nbytes, "syncs": syncs, "init_seconds": round(pushes[0]["sync_init_seconds"], 4),
                "sync_seconds": [round(p["sync_seconds"] - p.get("sync_init_seconds", 0.0), 4) for p in pushes],
                "transfer_seconds": [round(t, 4) for t in transfer],
                "gb_per_second": round(nbytes / min(transfer) / 1e9, 3),
                "max_abs_logprob_diff_before": before, "max_abs_logprob_diff_after": after}
    except Exception as exc:  # noqa: BLE001 -- the report says what failed; the training figures stand
        return {"error": f"{type(exc).__name__}: {exc}", "notes": getattr(exc, "__notes__", [])}
    finally:
        if proc is not None:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM vLLM's process group (its engine runs in child processes), SIGKILL after 30 s."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run(args) -> dict:
    import torch
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightspan.trainer.config import TrainerConfig
    from lightspan.trainer.batches import Batch, Cursor, as_table
    from lightspan.trainer.loop import Trainer

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
            batch = Batch(table=as_table(rows), cursor=Cursor(step, f"t{step}"), reward_mean=0.5)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.monotonic()
            metrics = trainer.step(batch)
            if cuda:
                torch.cuda.synchronize()
            if step >= args.warmup:
                step_times.append(time.monotonic() - t0)
                losses.append(metrics["loss"])
        peak_memory = torch.cuda.max_memory_allocated() if cuda else None

        skip = nccl_skip_reason(cuda) if args.nccl_syncs > 0 else "--nccl-syncs 0"
        # fp32 forward for the logprob check: without accelerate's bf16 autocast wrapper
        nccl = {"skipped": skip} if skip else time_nccl_sync(
            trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False), Path(tmp), args.nccl_syncs)

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
        "peak_memory_gib": round(peak_memory / 2**30, 3) if cuda else None,
        "achieved_tflops": round(achieved, 3),
        "peak_bf16_tflops": peak,
        "mfu": round(achieved / peak, 4) if peak else None,
        "mfu_formula": "6 * flop_parameters * tokens_per_step / mean_seconds / peak_bf16_tflops",
        "nccl_weight_sync": nccl,
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
    p.add_argument("--nccl-syncs", type=int, default=3,
                   help="NCCL weight syncs to time where vllm and a second GPU exist (0: none)")
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
