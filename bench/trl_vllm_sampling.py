"""Benchmark: TRL's ``GRPOTrainer`` with its completions sampled by vLLM, per step (issue 33).

    .venv/bin/python bench/trl_vllm_sampling.py --seeds 0,1,2 --steps 20 --out /tmp/trl_vllm.json

Why TRL learns more per step than lightspan's loop: both trainers' steps agree on the same batch
(bench/grpo_step_compare.py), and vLLM samples the trainer's distribution (bench/vllm_sampling.py), yet
TRL's training reward per step stays above lightspan's. This closes the loop the other way round: TRL's
trainer exactly as bench/learning_vs_trl.py's TRL side runs it (``trl_config``: the same model, task
list, seed, LoRA, learning rate, group size, temperature and loss), except where its completions come
from. Before each generation batch after an optimizer step, TRL's adapter is merged into the base
(``lightspan.trainer.lora.save_merged``) and a vLLM server, started as lightspan's demo starts it
(``lightspan.inference.command``: float32, processed logprobs), reloads it in place
(``lightspan.trainer.sync.ReloadSync``), as lightspan's trainer publishes with sync 'reload'. The batch's
prompts (TRL's token ids, its chat template) then go to vLLM's completions endpoint, one completion a
prompt row at temperature 0.7 and the task's new-token bound, and TRL trains on the token ids vLLM sampled
(each ends at its end-of-sequence token, or at the bound, as TRL's own generation ends them).

If TRL learns per step here as it does with its own generation (bench/learning_vs_trl.json's
``train_reward``: TRL's runs are deterministic per seed), vLLM's sampling and the merged reload are not
where lightspan's per-step gap comes from; if it learns as lightspan does, they are.

Printed: per seed the training reward of every step (the mean over its completions, TRL's logged
``reward``), and its mean per block of 5 steps. No held-out evaluation and no CPU budget: the measure is
learning per step. ``--out``: the same as JSON, with argv.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from learning_tasks import TASKS  # noqa: E402
from learning_vs_trl import add_shared_options, trl_config  # noqa: E402


def vllm_completions(url: str, prompt_ids: list[list[int]], *, temperature: float, max_tokens: int) -> list[list[int]]:
    """One sampled completion per prompt row, as vLLM's token ids (its end-of-sequence token kept)."""
    import requests

    response = requests.post(f"{url}/v1/completions", timeout=600, json={
        "model": "policy", "prompt": prompt_ids, "n": 1, "temperature": temperature, "max_tokens": max_tokens,
        "return_token_ids": True, "skip_special_tokens": False})
    response.raise_for_status()
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]


def run_seed(args, seed: int, work: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from lightspan import inference
    from lightspan.models import DEFAULT_SMOLLM2_DIR
    from lightspan.trainer.lora import save_merged
    from lightspan.trainer.sync import ReloadSync, verify

    args = argparse.Namespace(**{**vars(args), "seed": seed})
    torch.set_num_threads(args.trl_threads)
    model_dir = Path(args.model or DEFAULT_SMOLLM2_DIR)
    task = TASKS[args.task]
    train, _ = task.tasks(args)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": task.prompt(t), "answer": t["answer"]} for t in train])

    def reward(completions, answer, **_):
        return [task.reward(c[0]["content"], a) for c, a in zip(completions, answer)]

    vcfg = inference.VLLMConfig(model=str(model_dir), port=args.vllm_port, seed=seed, threads=args.vllm_threads,
                                max_model_len=1024)
    proc = inference.start(vcfg, work / "vllm.log")
    rewards: list[dict] = []
    checks: list[dict] = []      # after each reload: vLLM's prompt logprobs against TRL's policy's

    def served_against_trained(policy, ids) -> float:
        ids = [int(t) for t in ids]
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        trained = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        return verify(vcfg.url, "policy", ids, trained)

    try:
        inference.wait_healthy(vcfg.url, proc, vcfg.startup_timeout_s, work / "vllm.log")
        sync = ReloadSync(vcfg.url, serving=model_dir)
        served = {"step": 0, "dir": None}

        def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            step = self.state.global_step
            if step != served["step"]:       # an optimizer step since the last batch: publish it
                out = save_merged(self.accelerator.unwrap_model(self.model), "default", work / f"v{step}", model_dir)
                sync.push(out, step)
                if served["dir"] is not None:
                    shutil.rmtree(served["dir"], ignore_errors=True)
                served.update(step=step, dir=out)
                checks.append({"step": step, "max_abs_logprob_diff": served_against_trained(self.model, prompt_ids[0])})
            ids = vllm_completions(vcfg.url, [list(p) for p in prompt_ids], temperature=0.7,
                                   max_tokens=args.max_tokens)
            return ids, None

        class Steps(TrainerCallback):
            def on_log(self, targs, state, control, logs=None, **kw):
                if logs and "reward" in logs:
                    rewards.append({"step": state.global_step, "reward": round(logs["reward"], 4)})
                    print(f"trl+vllm seed {seed} step {state.global_step}: train reward {logs['reward']:.4f}",
                          file=sys.stderr, flush=True)

            def on_step_end(self, targs, state, control, **kw):
                if state.global_step >= args.steps:
                    control.should_training_stop = True

        config, lora = trl_config(args, work)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, peft_config=lora, callbacks=[Steps()])
        trainer._generate_single_turn = types.MethodType(generate, trainer)
        trainer.train()
    finally:
        inference.stop(proc)
    return {"train": rewards, "sync_check": checks}


def blocks(train: list[dict], size: int = 5) -> list[float]:
    """The mean training reward of each block of ``size`` steps (the last block may be shorter)."""
    values = [r["reward"] for r in sorted(train, key=lambda r: r["step"])]
    return [round(sum(values[i:i + size]) / len(values[i:i + size]), 3) for i in range(0, len(values), size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shared_options(parser)
    parser.add_argument("--task", default="addition", choices=list(TASKS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps a seed")
    parser.add_argument("--max-steps", type=int, default=200,
                        help="the task list's length in steps (bench/learning_vs_trl.py's default: its task list)")
    parser.add_argument("--val-tasks", type=int, default=48, help="as bench/learning_vs_trl.py's (it sets the task list)")
    parser.add_argument("--model", default="", help="model directory (default: lightspan model smollm2's)")
    parser.add_argument("--trl-threads", type=int, default=2)
    parser.add_argument("--vllm-threads", type=int, default=2)
    parser.add_argument("--vllm-port", type=int, default=8731)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runs: dict = {}
    checks: dict = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        with tempfile.TemporaryDirectory(prefix=f"trl-vllm-{seed}-") as work:
            result = run_seed(args, seed, Path(work))
        runs[str(seed)], checks[str(seed)] = result["train"], result["sync_check"]
        worst = max((c["max_abs_logprob_diff"] for c in checks[str(seed)]), default=None)
        print(f"seed {seed} trl+vllm: train reward per 5 steps {blocks(runs[str(seed)])}, first {len(runs[str(seed)])} "
              f"steps {sum(r['reward'] for r in runs[str(seed)]) / max(1, len(runs[str(seed)])):.3f}; served against "
              f"trained, largest logprob difference after a reload: {worst}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"task": args.task, "train_reward": runs, "sync_check": checks,
                                                 "argv": sys.argv[1:]},
                                                 indent=1) + "\n")


if __name__ == "__main__":
    main()
