"""Train the writer and the checker of examples/multi_agent as two policies: two LoRA adapters over
one base model, served side by side by one vLLM, trained by one ``lightspan train``.

    python examples/multi_agent/two_policies.py --data-dir /tmp/two-policies \\
        --steps 4 --tasks-per-step 4 --samples 4 --val-limit 16

Each stage is a lightspan command, as a user would run them (examples/multi_agent/README.md):

1. ``lightspan collector``; ``lightspan vllm --policies policies.toml --lora-rank R`` (the base as
   ``policy-base``, the adapters ``writer`` and ``checker``); ``lightspan train --policies
   policies.toml --mode continuous --sync lora``, which publishes version 0 of both adapters.
2. Held-out validation: the first ``val_limit`` questions, greedy, one rollout each, the agent
   calling ``WRITER_MODEL=writer`` and ``CHECKER_MODEL=checker``. Per agent, from each rollout's
   last output line: the writer's execution accuracy (``writer_correct``), the checker's (its action
   was right: ``checker_right``) and the workflow's (the final query, the reward).
3. ``steps`` times: ``tasks_per_step`` training questions x ``samples`` rollouts at temperature 0.7
   → ``lightspan transitions build --policies policies.toml`` (each policy its agent's calls, its
   groups and its credit) → wait until every policy with trainable transitions has published
   its next version.
4. Validation again; ``results.json`` in ``out_dir``: per agent before and after, per step the
   train rewards, the transitions and the policy versions.

The model defaults to SmolLM2-135M-Instruct (``lightspan model smollm2``); ``--model`` takes any
untied model directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import requests

from lightspan import inference, store
from lightspan.runs import free_ports

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "sql_agent" / "data"
log = logging.getLogger("two_policies")


def lightspan(*args: str, env=None) -> dict:
    """Run a lightspan command; its last output line as JSON ({} if none)."""
    out = subprocess.run([sys.executable, "-m", "lightspan.cli", *args], check=True, text=True,
                         stdout=subprocess.PIPE, env=env).stdout.strip()
    return json.loads(out.splitlines()[-1]) if out else {}


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with code {proc.returncode}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def wait_versions(data: Path, wanted: dict[str, int], trainer: subprocess.Popen, timeout_s: float) -> None:
    """Until policy.json serves each policy at least at its wanted version."""
    deadline = time.monotonic() + timeout_s
    while True:
        served = store.policy.served_versions(data)
        if all(served.get(name, -1) >= v for name, v in wanted.items()):
            return
        if trainer.poll() is not None:
            raise RuntimeError(f"the trainer exited with code {trainer.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"policy versions {served}, waiting for {wanted}")
        time.sleep(0.5)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def outputs(logs: Path) -> list[dict]:
    """Each rollout's last output line (the agent's JSON summary)."""
    found = []
    for f in sorted(logs.glob("*.log")):
        lines = [line for line in f.read_text(errors="replace").splitlines() if line.startswith("{")]
        if lines:
            found.append(json.loads(lines[-1]))
    return found


def per_agent(rows: list[dict]) -> dict:
    n = len(rows)
    share = lambda key: sum(float(r[key]) for r in rows) / n if n else 0.0  # noqa: E731
    return {"rollouts": n, "writer_correct": share("writer_correct"), "checker_right": share("checker_right"),
            "workflow_correct": share("reward")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="emptied at start")
    p.add_argument("--model", default="", help="default: SmolLM2-135M-Instruct (lightspan model smollm2)")
    p.add_argument("--policies", default=str(HERE / "policies.toml"))
    p.add_argument("--train-tasks", default=str(DATA / "train.jsonl"))
    p.add_argument("--val-tasks", default=str(DATA / "val.jsonl"))
    p.add_argument("--val-limit", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--time-budget-s", type=float, default=0.0, help="start no step after this; 0: none")
    p.add_argument("--out-dir", default="", help="default: DATA_DIR/results")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t_start = time.monotonic()
    data = Path(args.data_dir).resolve()
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    out_dir = Path(args.out_dir).resolve() if args.out_dir else data / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model)
    else:
        from lightspan.models import prepare_smollm2
        model = prepare_smollm2(Path.home() / ".cache" / "lightspan" / "models" / "smollm2-135m-instruct")
    train_tasks = [json.loads(line) for line in Path(args.train_tasks).read_text().splitlines() if line.strip()]
    val_tasks = [json.loads(line) for line in Path(args.val_tasks).read_text().splitlines() if line.strip()]
    val_file = write_jsonl(data / "val.jsonl", [{**t, "temperature": 0.0} for t in val_tasks[:args.val_limit]])
    *picked, vllm_port = free_ports(4)
    ports = dict(zip(("grpc", "http", "api"), picked))
    api = f"http://127.0.0.1:{ports['api']}"
    vllm_cfg = inference.VLLMConfig(model=str(model), port=vllm_port, lora_rank=args.lora_r, policies=args.policies,
                                    max_model_len=1024)
    env = {**os.environ, "LIGHTSPAN_DATA_DIR": str(data), "WRITER_MODEL": "writer", "CHECKER_MODEL": "checker"}
    results: dict = {"model": model.name, "config": vars(args), "val": [], "train": []}

    def rollouts(tasks: Path, split: str, samples: int, logs: Path) -> dict:
        outcome = lightspan("rollout", "--tasks", str(tasks), "--split", split, "--samples", str(samples),
                            "--concurrency", str(args.concurrency), "--timeout-s", "300",
                            "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}",
                            "--openai-base-url", f"{vllm_cfg.url}/v1", "--data-dir", str(data), "--logs-dir", str(logs),
                            "--", sys.executable, str(HERE / "agent.py"), env=env)
        requests.post(f"{api}/v1/flush", timeout=120).raise_for_status()
        return outcome

    def validate(step: int) -> None:
        versions = store.policy.served_versions(data)
        logs = data / f"val-logs-{step:03d}"
        outcome = rollouts(val_file, "val", 1, logs)
        row = {"step": step, "versions": versions, **per_agent(outputs(logs)), "outcomes": outcome}
        results["val"].append(row)
        log.info("validation after %d steps (%s): writer %.3f, checker %.3f, workflow %.3f", step, versions,
                 row["writer_correct"], row["checker_right"], row["workflow_correct"])

    with ExitStack() as stack:
        def spawn(name: str, command: list[str], health: str | None, timeout_s: float, proc_env=None):
            out = open(data / f"{name}.log", "wb")
            proc = subprocess.Popen(command, env=proc_env or env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            stack.callback(inference.stop, proc)
            if health:
                wait_http(health, proc, timeout_s)
            return proc

        cli = [sys.executable, "-m", "lightspan.cli"]
        spawn("collector", [*cli, "collector", "--data-dir", str(data), "--grpc-port", str(ports["grpc"]),
                            "--http-port", str(ports["http"]), "--api-port", str(ports["api"])], f"{api}/healthz", 60)
        spawn("vllm", inference.command(vllm_cfg), f"{vllm_cfg.url}/health", vllm_cfg.startup_timeout_s,
              inference.environment(vllm_cfg))
        trainer = spawn("trainer", [*cli, "train", "--mode", "continuous", "--data-dir", str(data),
                                    "--model", str(model), "--vllm-url", vllm_cfg.url, "--sync", "lora",
                                    "--lora-r", str(args.lora_r),
                                    "--lora-alpha", str(2 * args.lora_r), "--learning-rate", str(args.learning_rate),
                                    "--policies", args.policies, "--metrics-port", "0"], None, 0)
        wait_versions(data, {"writer": 0, "checker": 0}, trainer, 600)
        validate(0)
        for step in range(args.steps):
            if args.time_budget_s and time.monotonic() - t_start > args.time_budget_s:
                log.info("time budget spent after %d steps", step)
                break
            before = store.policy.served_versions(data)
            k = step * args.tasks_per_step
            tasks = [{**train_tasks[(k + i) % len(train_tasks)], "temperature": args.temperature}
                     for i in range(args.tasks_per_step)]
            outcome = rollouts(write_jsonl(data / f"train-{step:03d}.jsonl", tasks), "train", args.samples,
                               data / f"train-logs-{step:03d}")
            rewards = per_agent(outputs(data / f"train-logs-{step:03d}"))
            built = lightspan("transitions", "build", "--data-dir", str(data), "--policies", args.policies, env=env)
            trainable = {name: built.get(f"transitions/policies/{name}/nonzero_advantage", 0) for name in before}
            wanted = {name: before[name] + 1 for name, n in trainable.items() if n}
            wait_versions(data, wanted, trainer, 900)
            row = {"step": step + 1, "versions_before": before, "versions_after": store.policy.served_versions(data),
                   **rewards, "outcomes": outcome, "trainable": trainable,
                   "transitions": {name: built.get(f"transitions/policies/{name}/calls", 0) for name in before}}
            results["train"].append(row)
            log.info("step %d: writer %.3f, checker %.3f, workflow %.3f; trainable %s -> versions %s", step + 1,
                     rewards["writer_correct"], rewards["checker_right"], rewards["workflow_correct"], trainable,
                     row["versions_after"])
        validate(len(results["train"]))
        steps = store.connect(data).execute(
            "SELECT policy, count(*), max(policy_version), avg(step_seconds), avg(sync_seconds), "
            "max(sync_max_abs_logprob_diff) FROM train_steps GROUP BY 1 ORDER BY 1").fetchall()
        results["trainer"] = {p: {"steps": n, "version": v, "step_seconds_mean": s, "sync_seconds_mean": y,
                                  "max_abs_logprob_diff": d} for p, n, v, s, y, d in steps}
    results["wall_seconds"] = round(time.monotonic() - t_start, 1)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    before, after = results["val"][0], results["val"][-1]
    sys.stdout.write(f"held-out ({before['rollouts']} questions, greedy)   before {before['versions']}   "
                     f"after {after['versions']}\n")
    for key in ("writer_correct", "checker_right", "workflow_correct"):
        sys.stdout.write(f"  {key:17} {before[key]:.3f} -> {after[key]:.3f}\n")
    sys.stdout.write(f"results: {out_dir / 'results.json'} ({results['wall_seconds']:.0f} s)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
