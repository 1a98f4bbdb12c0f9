"""Benchmark: held-out learning per CPU-minute, lightspan's loop against TRL's ``GRPOTrainer``, in one run.

    .venv/bin/python bench/learning_vs_trl.py [--task addition|gsm8k] [--seeds 0,1,2] [--cpu-budget-s 1800]
    .venv/bin/python bench/learning_vs_trl.py --summarise bench/learning_vs_trl.json [more.json ...]   # saved runs' summary

Both sides get the same model (SmolLM2-135M-Instruct as ``lightspan model smollm2`` makes it, or
``--model``), the same task (the demo's two-digit additions in the demo agent's wording, "What is
A + B? End your reply with 'Answer: <number>'.", scored by the demo agent's ``score``: 1 for the
right last integer, 1.2 with the format), the same training tasks in the same order, the same
held-out 48 additions answered greedily (``--max-tokens`` new tokens), the same prompts per step
(unless ``--lightspan-tasks-per-step`` gives lightspan more: the same task list, consumed faster),
group size (unless ``--lightspan-samples`` gives lightspan another), sampling temperature (0.7), KL
coefficient (``--beta``, default 0) and the same CPU budget.

- **lightspan**: the demo's preset (``lightspan.demo.preset``: its agent run by ``lightspan rollout``,
  vLLM, the collector, ``lightspan transitions build``, the continuous trainer overlapped with the
  rollouts), as ``lightspan demo`` runs it, with a CPU budget and a validation every ``--eval-every``
  steps. CPU: every process the run starts (vLLM and its engine, collector, trainer, rollouts,
  builds), from before vLLM starts (``lightspan.runs.CpuClock``).
- **TRL**: ``GRPOTrainer`` (transformers generation, ``use_cpu=True, bf16=False``, which its CPU
  defaults need) with LoRA r ``--trl-lora-r`` on q/k/v/o and learning rate ``--trl-lr`` (the
  settings that learned fastest per minute in the probe of docs/architecture.md), a constant
  learning rate (TRL's default decays it over ``max_steps``, which a budget makes arbitrary), no
  gradient checkpointing (TRL's default, which recomputes activations to save memory), its loss
  ``--loss-type``, KL ``--beta`` (default 0: none; the same on both sides); held-out evaluation by
  greedy ``generate`` in its own process, every ``--eval-every`` optimizer steps. CPU: the process's
  own (all its threads), from its start.

``--task gsm8k`` (bench/learning_tasks.py): examples/gsm8k's problems instead. Equal on both sides: the
model, the training problems (data/train.jsonl in file order, cycled, ``--tasks-per-step`` a step), the
held-out ones (the first ``--val-tasks`` of data/val.jsonl, greedy), group size, temperature 0.7, 24
new tokens a model call, LoRA r 16 and lr 3e-4 (TRL's defaults here, the example's settings), the loss,
the CPU budget, the prompt of the first model call (the agent's ``shot_turns`` + ``first_turn``, built
by the agent's own code) and the scoring (the agent's ``parse_action`` and ``score``). Different:
lightspan's side runs the agent unchanged, multi-turn with its calculator (up to 6 calls, each stopped
at ``</calc>`` or ``</answer>``), with the example's documented settings (bench/examples.py's
``EXAMPLES["gsm8k"]``: rollout timeout 1200 s, langchain instrumentation off, ...); TRL's side is one
completion per problem, no tool and no stop string: its reward is the agent's score of the
completion's ``<answer>``, 0 for a completion that calls the calculator or has neither tag. The base
SmolLM2 starts nearly every reply with ``<calc>`` (examples/gsm8k/README.md), so TRL's side starts
near 0 reward. TRL's prompts are the agent's first call only; lightspan trains on every call.

Evaluation is not charged to either budget: its CPU time is measured and left out on both sides.
A side starts no new step once its budget is spent, then evaluates a last time. The sides run one
after the other, seed by seed (lightspan, TRL, lightspan, ...), so they never share the cores.
Printed: per seed and side the held-out solved count against CPU-minutes and the policy's entropy at
the last training step (nats per token over the sampled completion tokens, at the sampling
temperature: lightspan's train_steps.entropy, TRL's logged ``entropy``), a run that ends below
``ENTROPY_FLOOR`` (0.2) flagged with the warning the demo's trainer logs; per side the mean gain
(last - first evaluation) per CPU-minute over the seeds (and its range); the ratio lightspan / TRL;
the same on the best evaluation (best - first solved count, per CPU-minute at the first evaluation that
reached the best: 0 when the first is the best); per seed both ratios, and whether every seed is at
least 1.0x on each; per side the CPU-seconds a step, in all and by part (``parts`` in the JSON: lightspan's
services and ``rest``, TRL's ``generate``, ``score`` and ``train``; bench/learning_summary.py), and the host.
Everything also goes to ``--out`` as JSON (``task``; the summary's older keys kept).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/learning_tasks.py (the table of tasks: each side's settings, prompt and reward) and
# bench/learning_summary.py (the reading of a run), loaded from beside this file: bench/ is not put on
# sys.path, where its examples.py would shadow the examples/ folder
for _name in ("learning_tasks", "learning_summary"):
    if _name not in sys.modules:
        _spec = importlib.util.spec_from_file_location(_name, Path(__file__).resolve().parent / f"{_name}.py")
        sys.modules[_name] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(sys.modules[_name])
TASKS = sys.modules["learning_tasks"].TASKS
from learning_summary import (ENTROPY_FLOOR, SIDES, best_evaluation, best_gain_per_cpu_minute,  # noqa: E402,F401
                              cpu_per_step, entropy_flag, gain_per_cpu_minute, parts_per_step, report,
                              summarise)


def host() -> str:
    """This machine's CPU model (/proc/cpuinfo's first ``model name``): a side's CPU a step moves with it
    (TRL's median step 41.2 CPU-s on one host of this bench, 28.4 on another), so a run records it and a
    reading across files names it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


# --- lightspan ------------------------------------------------------------------------------------

def lightspan_side(args) -> list[dict]:
    from lightspan.experiment import loop

    with tempfile.TemporaryDirectory() as tasks:
        exp = TASKS[args.task].experiment(args, Path(tasks))
        results = loop(exp, section="demo" if args.task == "addition" else "experiment")
    curve = [{"step": v["step"], "cpu_s": v["cpu_seconds"], "wall_s": v["wall_seconds"],
              "solved": round(v["solved"] * v["rollouts"]), "of": v["rollouts"]} for v in results["val"]]
    # the trainer's mean per-token entropy over the sampled completion tokens of its first and last step
    trainer = results["trainer"]
    train = [{"step": t["step"], "reward": round(t["reward_mean"], 4)} for t in results["train"]]
    # each part's CPU over the steps: training's less what came before the first step (the services' start)
    by_part = results["cpu_seconds_by_part"]
    steps = {k: round(v - by_part["start_up"].get(k, 0.0), 1) for k, v in by_part["training"].items()}
    return {"curve": curve, "train": train, "parts": {"cpu_s": steps, "steps": len(results["train"])},
            "entropy": {"first": trainer.get("entropy_first"), "last": trainer.get("entropy_last")}}


# --- TRL ------------------------------------------------------------------------------------------

def _own_cpu() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def trl_side(args) -> list[dict]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from lightspan.models import DEFAULT_SMOLLM2_DIR

    t0, excluded = time.monotonic(), [0.0]
    torch.set_num_threads(args.trl_threads)
    model_dir = args.model or str(DEFAULT_SMOLLM2_DIR)
    task = TASKS[args.task]
    train, val = task.tasks(args)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    prompt = task.prompt
    dataset = Dataset.from_list([{"prompt": prompt(t), "answer": t["answer"]} for t in train])

    def reward(completions, answer, **_):
        return [task.reward(c[0]["content"], a) for c, a in zip(completions, answer)]

    curve: list[dict] = []

    def evaluate(policy, step: int) -> None:
        before = _own_cpu()
        was_training = policy.training
        policy.eval()
        solved = 0
        with torch.no_grad():
            for i in range(0, len(val), 16):
                batch = val[i:i + 16]
                texts = [tokenizer.apply_chat_template(prompt(t), tokenize=False, add_generation_prompt=True)
                         for t in batch]
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
                out = policy.generate(**enc, max_new_tokens=args.max_tokens, do_sample=False,
                                      pad_token_id=tokenizer.pad_token_id)
                replies = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                solved += sum(task.reward(r, t["answer"]) >= task.solved_at for r, t in zip(replies, batch))
        policy.train(was_training)
        excluded[0] += _own_cpu() - before
        curve.append({"step": step, "cpu_s": round(_own_cpu() - excluded[0], 1),
                      "wall_s": round(time.monotonic() - t0, 1), "solved": int(solved), "of": len(val)})
        print(f"trl seed {args.seed} step {step}: {solved}/{len(val)} at {curve[-1]['cpu_s']:.0f} CPU-s",
              file=sys.stderr, flush=True)

    class Budget(TrainerCallback):
        def on_train_begin(self, targs, state, control, model=None, **kw):
            evaluate(model, 0)

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "reward" in logs:     # the step's training reward (its sampled completions')
                print(f"trl seed {args.seed} step {state.global_step}: train reward {logs['reward']:.4f}",
                      file=sys.stderr, flush=True)

        def on_step_end(self, targs, state, control, model=None, **kw):
            spent = _own_cpu() - excluded[0] > args.cpu_budget_s
            if spent:
                control.should_training_stop = True
            if spent or state.global_step % args.eval_every == 0:
                evaluate(model, state.global_step)

    config, lora = trl_config(args, Path(args.work))
    callbacks = [Budget()]
    spent = {"generate": 0.0, "generate_and_score": 0.0}   # CPU-s inside these two of TRL's methods, all steps

    def timed(name: str, method):
        def run(*a, **kw):
            before = _own_cpu()
            try:
                return method(*a, **kw)
            finally:
                spent[name] += _own_cpu() - before
        return run

    if args.trl_sampling_seed is not None:
        callbacks.append(sampling_seed_callback(args.trl_sampling_seed + args.seed))
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=callbacks)
    trainer._generate = timed("generate", trainer._generate)
    trainer._generate_and_score_completions = timed("generate_and_score", trainer._generate_and_score_completions)
    trainer.train()
    if curve[-1]["step"] != trainer.state.global_step:     # max_steps reached before the budget
        evaluate(trainer.model, trainer.state.global_step)
    # TRL's own entropy metric: the same quantity as lightspan's train_steps.entropy (mean over the
    # step's completion tokens, logits divided by the sampling temperature)
    entropies = [h["entropy"] for h in trainer.state.log_history if "entropy" in h]
    train = [{"step": h["step"], "reward": round(h["reward"], 4)} for h in trainer.state.log_history if "reward" in h]
    steps = curve[-1]["cpu_s"] - curve[0]["cpu_s"]      # the steps' CPU: start-up and evaluations left out
    parts = {"generate": spent["generate"], "score": spent["generate_and_score"] - spent["generate"],
             "train": steps - spent["generate_and_score"]}
    return {"curve": curve, "train": train, "parts": {"cpu_s": {k: round(v, 1) for k, v in parts.items()},
                                                      "steps": trainer.state.global_step},
            "entropy": {"first": entropies[0] if entropies else None, "last": entropies[-1] if entropies else None}}


def sampling_seed_callback(seed: int):
    """A ``TrainerCallback`` that reseeds torch's global generator, the one TRL's sampling draws from, as
    training begins: after the seed's LoRA initialisation and first evaluation, with the seed's task order
    untouched (TRL's sampler keeps its own generator). So one seed's TRL run can be drawn again."""
    import torch
    from transformers import TrainerCallback

    class SamplingSeed(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kw):
            torch.manual_seed(seed)

    return SamplingSeed()


def trl_config(args, work: Path):
    """TRL's side's ``GRPOConfig`` and LoRA config (also bench/grpo_step_compare.py's): one optimizer step
    per generation batch of ``tasks_per_step`` x ``samples`` completions, in micro-batches of up to 8."""
    from peft import LoraConfig
    from trl import GRPOConfig

    from lightspan.trainer.lora import target_modules

    completions = args.tasks_per_step * args.samples
    micro = next(m for m in (8, 4, 2, 1) if completions % m == 0)
    config = GRPOConfig(
        output_dir=str(work / "trl"), use_cpu=True, bf16=False, seed=args.seed,
        learning_rate=args.trl_lr, lr_scheduler_type="constant", num_generations=args.samples,
        per_device_train_batch_size=micro, gradient_accumulation_steps=completions // micro,
        max_completion_length=args.max_tokens, temperature=0.7, beta=args.beta, loss_type=args.loss_type,
        max_steps=args.max_steps, shuffle_dataset=False, remove_unused_columns=False, logging_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        gradient_checkpointing=False)   # TRL's default recomputes activations: memory is no concern here
    lora = LoraConfig(r=args.trl_lora_r, lora_alpha=2 * args.trl_lora_r, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=target_modules(args.lora_targets)) if args.trl_lora_r else None
    return config, lora


def lightspan_trainer_config(args, model_dir: str, work: Path):
    """The ``TrainerConfig`` lightspan's side trains with: what the demo's preset hands ``lightspan train``
    (lightspan/experiment.py's trainer command line), the trainer's defaults otherwise."""
    from lightspan import demo
    from lightspan.trainer.config import TrainerConfig

    exp = demo.preset(demo.DemoConfig(seed=args.seed, steps=1, tasks_per_step=args.tasks_per_step,
                                      samples=args.samples, val_tasks=1, model=model_dir), work)
    # batch_size 0 and sync as the experiment runs it; the staleness bound does not change one step
    return TrainerConfig(model=model_dir, data_dir=str(work / "lightspan-trainer"), seed=exp.seed,
                         learning_rate=exp.learning_rate, loss_type=exp.loss_type, beta=args.beta,
                         max_staleness=exp.max_staleness, batch_size=0, lora_r=exp.lora_r,
                         lora_alpha=exp.lora_alpha, lora_target_modules=args.lora_targets, sync="none")


def add_shared_options(parser: argparse.ArgumentParser) -> None:
    """The options both sides' settings are made of (also bench/grpo_step_compare.py's)."""
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8, help="the group size: completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=24, help="new tokens per completion (the agent's 24)")
    parser.add_argument("--loss-type", default="grpo")
    parser.add_argument("--beta", type=float, default=0.0,
                        help="both sides' KL coefficient to the initial model (k3 estimator; with LoRA the reference "
                             "is the base, adapters off: one more forward a step); default 0, no KL")
    parser.add_argument("--trl-lr", type=float, default=3e-4)
    parser.add_argument("--trl-lora-r", type=int, default=16, help="0: full fine-tuning")
    from lightspan.trainer.config import LORA_TARGETS

    parser.add_argument("--lora-targets", default=LORA_TARGETS,
                        help="both sides' LoRA target modules (lightspan train --lora-target-modules; "
                             "'all-linear': every linear layer but the head)")


# --- the comparison -------------------------------------------------------------------------------

def summarise_file(*paths: str) -> list[str]:
    """The printed summary of saved ``--out`` JSONs, old files (no best-evaluation keys, no task) too.
    Several files are read as one run: their seeds together (runs of one task, each seed of a side in one
    file only; the load is shown for a single file only, the host of each file that recorded one: several
    hosts make a cross-host reading, and the last line says so)."""
    saved = [json.loads(Path(path).read_text()) for path in paths]
    tasks = {s.get("task", "addition") for s in saved}
    if len(tasks) > 1:
        raise SystemExit(f"--summarise: the files hold different tasks ({', '.join(sorted(tasks))}); "
                         "summarise each task's files on their own")
    runs: dict = {}
    for path, s in zip(paths, saved):
        for side, seeds in s["runs"].items():
            for seed, curve in seeds.items():
                if str(seed) in runs.setdefault(side, {}):
                    raise SystemExit(f"--summarise: seed {seed} of {side} is in more than one file ({path}); "
                                     "give each seed once")
                runs[side][str(seed)] = curve
    load = saved[0].get("load_1m") if len(saved) == 1 else None
    hosts = [s.get("host", "host not recorded") for s in saved] if any("host" in s for s in saved) else None
    parts: dict = {}            # (files from before the parts were recorded have none)
    for s in saved:
        for side, seeds in s.get("parts", {}).items():
            parts.setdefault(side, {}).update(seeds)
    return report(summarise(runs), TASKS[tasks.pop()].noun, load, hosts, parts_per_step(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="addition", choices=list(TASKS),
                        help="addition: the demo's additions; gsm8k: examples/gsm8k (single-turn on TRL's side)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--sides", default="lightspan,trl")
    parser.add_argument("--cpu-budget-s", type=float, default=1800.0, help="CPU seconds each side may train for")
    parser.add_argument("--eval-every", type=int, default=5, help="evaluate every this many steps")
    parser.add_argument("--max-steps", type=int, default=200, help="a bound on steps beside the budget")
    parser.add_argument("--val-tasks", type=int, default=48)
    parser.add_argument("--model", default="", help="model directory (default: lightspan model smollm2's)")
    add_shared_options(parser)
    parser.add_argument("--trl-threads", type=int, default=2)
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="lightspan's max_staleness (default: the demo's, 1: rollouts overlap training, one "
                             "version stale; 0: lock-step, on-policy as TRL is)")
    parser.add_argument("--zero-advantage", choices=("exclude", "count"), default=None,
                        help="lightspan's zero_advantage (default: the experiment's, exclude; count: "
                             "zero-advantage sequences count in the loss's normaliser, as TRL's do)")
    parser.add_argument("--lightspan-lr", type=float, default=None,
                        help="lightspan's learning rate (default: the task's, the demo's 3e-4 for addition); "
                             "choose it on training reward (the output's train_reward), not held-out")
    parser.add_argument("--lightspan-lr-schedule", choices=("constant", "linear", "cosine"), default=None,
                        help="lightspan's learning-rate schedule (default: the experiment's, constant), decaying to a "
                             "tenth over --lightspan-lr-decay-steps; choose it on training reward, not held-out")
    parser.add_argument("--lightspan-lr-decay-steps", type=int, default=0,
                        help="steps the schedule decays over (0: --max-steps); a CPU budget ends a run first, so "
                             "give the steps the budget allows")
    parser.add_argument("--lightspan-tasks-per-step", type=int, default=None,
                        help="lightspan's prompts per step (default: --tasks-per-step); its tasks are TRL's, in "
                             "TRL's order; choose it on training reward, not held-out")
    parser.add_argument("--lightspan-samples", type=int, default=None,
                        help="lightspan's group size (default: --samples); with --lightspan-tasks-per-step it sets "
                             "lightspan's completions a step; choose it on training reward, not held-out")
    parser.add_argument("--lightspan-concurrency", type=int, default=None,
                        help="lightspan's rollouts at once (default: the task's preset's; the demo's is 32): what "
                             "vLLM batches, so it changes CPU, not what is learnt")
    parser.add_argument("--lightspan-mini-batches", type=int, default=None,
                        help="lightspan's optimizer steps per step's batch (lightspan train --mini-batches; "
                             "default 1): with 8 prompts a step, 2 is TRL's 32 completions an update")
    parser.add_argument("--trl-sampling-seed", type=int, default=None,
                        help="reseed TRL's sampling with this plus the seed as training begins (default: none, "
                             "the seed's own draw); the seed's task order and LoRA initialisation stay: "
                             "another draw of TRL's run for the same seed, to measure its spread")
    parser.add_argument("--out", default="", help="write every curve and the summary here (JSON)")
    parser.add_argument("--summarise", metavar="JSON", nargs="+", default=[],
                        help="run nothing: print the summary of saved --out files (old ones too); several "
                             "files: their seeds read as one run")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.summarise:
        print("\n".join(summarise_file(*args.summarise)))
        return
    if args.max_tokens != 24:
        parser.error("the agents ask for 24 new tokens a call: --max-tokens must be 24 for both sides to match")
    if args.side:                                       # one side of one seed, in its own process
        import logging
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        result = lightspan_side(args) if args.side == "lightspan" else trl_side(args)
        sys.stdout.write(json.dumps(result) + "\n")
        return

    runs: dict = {side: {} for side in args.sides.split(",")}
    entropy: dict = {}          # side -> seed -> first/last entropy (nats/token), the floor, the flag
    train: dict = {}            # side -> seed -> the training reward per step (what settings are chosen on)
    parts: dict = {}            # side -> seed -> each part's CPU-s over the steps, and the steps
    load = [os.getloadavg()[0]]
    machine = host()
    for seed in [int(s) for s in args.seeds.split(",")]:
        for side in runs:
            with tempfile.TemporaryDirectory(prefix=f"lightspan-vs-trl-{side}-{seed}-") as work:
                argv = [a for a in sys.argv[1:]]
                out = subprocess.run([sys.executable, __file__, *argv, "--side", side, "--seed", str(seed),
                                      "--work", work], check=True, stdout=subprocess.PIPE, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            runs[side][seed] = curve = result["curve"]
            train.setdefault(side, {})[seed] = result.get("train", [])
            parts.setdefault(side, {})[seed] = result["parts"]
            last = result["entropy"]["last"]
            flag = entropy_flag(last)
            entropy.setdefault(side, {})[seed] = {**result["entropy"], "floor": ENTROPY_FLOOR, "flag": flag}
            print(f"seed {seed} {side:>9}: " + "  ".join(f"{p['solved']}/{p['of']} @ {p['cpu_s'] / 60:.1f}"
                                                        for p in curve) + "   (solved @ CPU-min)"
                  + ("" if last is None else f"; final entropy {last:.2f} nats/token"), flush=True)
            if flag:
                print(f"seed {seed} {side:>9}: {flag}", flush=True)
            if args.out:   # after every run, so a run stopped early keeps what it measured
                Path(args.out).write_text(json.dumps({
                    "task": args.task, "runs": runs, "summary": summarise(runs), "entropy": entropy,
                    "train_reward": train, "parts": parts, "load_1m": [*load, os.getloadavg()[0]],
                    "argv": sys.argv[1:], "host": machine}, indent=1) + "\n")
    load.append(os.getloadavg()[0])
    print("\n".join(report(summarise(runs), TASKS[args.task].noun, load, [machine], parts_per_step(parts))),
          flush=True)


if __name__ == "__main__":
    main()
