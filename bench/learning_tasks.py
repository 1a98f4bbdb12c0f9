"""The tasks bench/learning_vs_trl.py compares lightspan's loop and TRL's ``GRPOTrainer`` on (``TASKS``).

Each task says, for one seed's run (the bench's parsed arguments):

- ``experiment``: lightspan's side, the ``ExperimentConfig`` that :func:`lightspan.experiment.loop`
  runs (its agent, its task files, its settings), with the bench's budget, validation cadence, seed,
  model, group size and prompts per step;
- ``tasks``: TRL's side, the training tasks in the order lightspan's side uses them (step k gets
  tasks k x per_step ... (k + 1) x per_step - 1) and the held-out tasks, the same as lightspan's;
- ``prompt``: the chat messages TRL's side sends for a task (what the agent's first call sends);
- ``reward``: a completion's reward for a task, the agent's own scoring; ``solved_at``: a reward at
  least this counts as solved (held-out).

``addition``: the demo's two-digit additions (``lightspan.demo``): its preset, its agent's wording and
``score``. ``gsm8k``: examples/gsm8k, the agent with a calculator tool (multi-turn) on lightspan's side;
on TRL's a single turn that has no calculator: the prompt is the agent's first call (its instruction,
its worked dialogue as earlier turns, the question), the reward the agent's: the number in the
completion's ``<answer>`` scored by the agent's ``score`` against the gold answer, 0 for a completion
whose first action is a ``<calc>`` (no result comes back: the episode ends without an answer) or that
has neither tag (the agent's invalid action).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GSM8K = ROOT / "examples" / "gsm8k"


@dataclass(frozen=True)
class Task:
    noun: str                                       # what a held-out task is, in the printed summary
    experiment: Callable                            # (args, tasks_dir) -> ExperimentConfig
    tasks: Callable                                 # args -> (train, val): TRL's tasks, lightspan's order
    prompt: Callable[[dict], list[dict]]            # task -> chat messages
    reward: Callable[[str, object], float]          # (completion, the task's answer) -> reward
    solved_at: float = 1.0


def _module(name: str, path: Path):
    """A file loaded as a module (bench/ and examples/ are folders, not packages)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module                  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def _ports_and_budget(exp, args):
    """The bench's settings over a side's experiment: its budget, validation cadence, context, the
    trainer's ``zero_advantage``, KL coefficient, learning rate and its schedule, mini-batches and the rollouts
    at once if given, the LoRA targets, and ports picked free (nothing fixed, so two runs never collide)."""
    zero, lr = getattr(args, "zero_advantage", None), getattr(args, "lightspan_lr", None)
    schedule, concurrency = getattr(args, "lightspan_lr_schedule", None), getattr(args, "lightspan_concurrency", None)
    mini = getattr(args, "lightspan_mini_batches", None)
    return dataclasses.replace(exp, cpu_budget_s=args.cpu_budget_s, val_every=args.eval_every,
                               max_model_len=max_model_len(args.model),
                               lora_target_modules=getattr(args, "lora_targets", exp.lora_target_modules),
                               beta=getattr(args, "beta", exp.beta),
                               **({} if zero is None else {"zero_advantage": zero}),
                               **({} if lr is None else {"learning_rate": lr}),
                               **({} if concurrency is None else {"concurrency": concurrency}),
                               **({} if mini is None else {"mini_batches": mini}),
                               **({} if schedule is None else {"lr_schedule": schedule,
                                                               "lr_decay_steps": args.lightspan_lr_decay_steps}),
                               grpc_port=0, http_port=0, api_port=0, vllm_port=0)


def lightspan_tasks_per_step(args) -> int:
    """lightspan's prompts per step: ``--lightspan-tasks-per-step`` if given, else both sides'
    ``--tasks-per-step``. Its tasks stay TRL's in TRL's order (the same list, consumed faster)."""
    return getattr(args, "lightspan_tasks_per_step", None) or args.tasks_per_step


def lightspan_samples(args) -> int:
    """lightspan's group size: ``--lightspan-samples`` if given, else both sides' ``--samples``."""
    return getattr(args, "lightspan_samples", None) or args.samples


def max_model_len(model: str) -> int:
    """vLLM's context: 1024, or less for a model that has fewer positions (the tiny test model)."""
    if not model:
        return 1024
    config = json.loads((Path(model) / "config.json").read_text())
    return min(1024, int(config.get("max_position_embeddings", 1024)))


# --- addition: the demo ---------------------------------------------------------------------------

def _addition_experiment(args, tasks_dir: Path):
    from lightspan import demo

    cfg = demo.DemoConfig(seed=args.seed, steps=args.max_steps, tasks_per_step=lightspan_tasks_per_step(args),
                          samples=lightspan_samples(args), val_tasks=args.val_tasks, model=args.model,
                          data_dir=str(Path(args.work) / "lightspan"),
                          **({} if args.max_staleness is None else {"max_staleness": args.max_staleness}))
    return _ports_and_budget(demo.preset(cfg, tasks_dir), args)


def _addition_tasks(args) -> tuple[list[dict], list[dict]]:
    from lightspan.demo import make_tasks

    return make_tasks(args.seed, args.max_steps * args.tasks_per_step, args.val_tasks)


def _addition_prompt(task: dict) -> list[dict]:
    from lightspan.agents.math_agent import INSTRUCTION

    return [{"role": "user", "content": f"{task['question']} {INSTRUCTION}"}]


def _addition_reward(completion: str, answer) -> float:
    from lightspan.agents.math_agent import score

    return score(completion, answer)


# --- gsm8k: examples/gsm8k ------------------------------------------------------------------------

def gsm8k_agent():
    """examples/gsm8k/agent.py, imported (its prompt building and scoring are what both sides use)."""
    return _module("gsm8k_agent", GSM8K / "agent.py")


def documented_gsm8k():
    """The gsm8k example's documented run (bench/examples.py's ``EXAMPLES["gsm8k"]``, its README's
    "Run it"), parsed as ``lightspan experiment`` parses its command line; environment variables are
    not read."""
    from lightspan.core.config import add_arguments, cli_values, resolve
    from lightspan.experiment import ExperimentConfig

    ex = _module("bench_examples", ROOT / "bench" / "examples.py").EXAMPLES["gsm8k"]
    parser = argparse.ArgumentParser()
    add_arguments(parser, ExperimentConfig, "experiment")
    argv = ["--agent", str(ROOT / ex.agent), "--train-tasks", str(ROOT / ex.tasks / "data" / "train.jsonl"),
            "--val-tasks", str(ROOT / ex.tasks / "data" / "val.jsonl"), *ex.settings, "--env-map", ex.env_map]
    return resolve(ExperimentConfig, section="experiment", environ={},
                   cli=cli_values(parser.parse_args(argv), ExperimentConfig))


def _gsm8k_experiment(args, tasks_dir: Path):
    exp = dataclasses.replace(
        documented_gsm8k(), steps=args.max_steps, tasks_per_step=lightspan_tasks_per_step(args),
        samples=lightspan_samples(args),
        val_limit=args.val_tasks, seed=args.seed, model=args.model, data_dir=str(Path(args.work) / "lightspan"),
        **({} if args.max_staleness is None else {"max_staleness": args.max_staleness}))
    return _ports_and_budget(exp, args)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _gsm8k_tasks(args) -> tuple[list[dict], list[dict]]:
    """The training file in order, cycled as the experiment cycles it (``step_tasks``); the first
    ``val_tasks`` held-out problems (the experiment's ``val_limit``)."""
    train = _read(GSM8K / "data" / "train.jsonl")
    val = _read(GSM8K / "data" / "val.jsonl")[:args.val_tasks]
    return [train[k % len(train)] for k in range(args.max_steps * args.tasks_per_step)], val


def _gsm8k_prompt(task: dict) -> list[dict]:
    """The messages of the agent's first chat call for ``task`` (``solve``: the worked dialogues, then
    the instruction and question), with the task's ``shots`` as the agent reads it."""
    agent = gsm8k_agent()
    return [*agent.shot_turns(int(task.get("shots", 1))), {"role": "user", "content": agent.first_turn(task["question"])}]


def gsm8k_reward(completion: str, answer) -> float:
    """A single-turn episode's reward, the agent's: its first action parsed as the agent parses a
    reply; an ``<answer>`` scored by the agent's ``score``; a ``<calc>`` (no tool here) or no action: 0."""
    agent = gsm8k_agent()
    action, content = agent.parse_action(completion)
    return agent.score(content, str(answer)) if action == "answer" else 0.0


TASKS: dict[str, Task] = {
    "addition": Task("additions", _addition_experiment, _addition_tasks, _addition_prompt, _addition_reward),
    "gsm8k": Task("problems", _gsm8k_experiment, _gsm8k_tasks, _gsm8k_prompt, gsm8k_reward),
}
