"""examples/sandbox under ``lightspan rollout``: a task file missing a field is refused (the line and
the field named), a sandbox that cannot run fails its rollouts without a reward (never a 0 to train
on), and one training step from the agent's traces on the test suite's shared vLLM (the tiny model
writes random bytes, so a grader's late reward marks one rollout of each task solved, as in
tests/examples/test_examples.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests

from tests.examples.test_examples import (  # noqa: F401 (collector: a fixture)
    EXAMPLES, collector, lightspan, grade_first_of_each_task, load, train_one_step)

AGENT = EXAMPLES / "sandbox" / "agent.py"
ENV_MAP = "QUESTION=input.question,ANSWER=input.answer"
SAMPLES = 2


def tiny_tasks(tmp_path, n: int = 2):
    """The example's own tasks, cut to fit the tiny model's context: no worked dialogues, 8 new tokens
    a turn, two turns."""
    train, _ = load(AGENT.parent / "make_tasks.py").make_splits(0, n, n)   # by path: six examples have a make_tasks
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({**t, "shots": 0, "max_tokens": 8, "max_turns": 2, "temperature": 0.8}) + "\n"
                            for t in train))
    return path


def test_a_task_missing_a_field_is_refused_naming_the_line_and_the_field(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "a", "question": "What is 2 times 3?", "answer": "6"}) + "\n"
                     + json.dumps({"id": "b", "question": "What is 4 times 5?"}) + "\n")
    done = subprocess.run([sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(tasks), "--env-map", ENV_MAP,
                           "--data-dir", str(tmp_path / "data"), "--", sys.executable, str(AGENT)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"{tasks}:2" in done.stderr and "'answer'" in done.stderr, done.stderr
    assert not (tmp_path / "data" / "rollout-logs").exists() or not any((tmp_path / "data" / "rollout-logs").iterdir())


@pytest.mark.e2e
def test_a_sandbox_that_cannot_run_fails_its_rollouts_without_a_reward(collector, tmp_path, monkeypatch):  # noqa: F811
    from lightspan import store

    data, ports = collector
    monkeypatch.setenv("SANDBOX_BWRAP", str(tmp_path / "no-such-bwrap"))   # the example's config: bwrap missing
    out = lightspan("rollout", "--tasks", str(tiny_tasks(tmp_path)), "--samples", str(SAMPLES), "--env-map", ENV_MAP,
                    "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}", "--openai-base-url",
                    "http://127.0.0.1:9/v1", "--data-dir", str(data), "--timeout-s", "120",
                    "--retries", "0", "--", sys.executable, str(AGENT))
    # the agent exits EX_TEMPFAIL: an infrastructure failure (rollout/outcomes.py), never ok nor the policy's failure
    assert out["ok"] == 0 and out["failed"] == 0 and out["infra"] == 2 * SAMPLES, out
    requests.post(f"http://127.0.0.1:{ports['api']}/v1/flush", timeout=60).raise_for_status()
    rows = store.connect(data).execute(
        "SELECT exit_code, final_reward, status FROM rollouts WHERE task_id IS NOT NULL").fetchall()
    assert rows == [(os.EX_TEMPFAIL, None, "infra")] * 2 * SAMPLES, rows
    logs = [p.read_text() for p in (data / "rollout-logs").glob("*.log") if p.name != "worker.log"]
    assert logs and all("sandbox unavailable" in text and "apt-get install bubblewrap" in text for text in logs)
    built = lightspan("transitions", "build", "--data-dir", str(data), "--grace-s", "0")
    assert built.get("transitions/calls", 0) == 0 and built["transitions/dropped_rollouts/infra"] == 2 * SAMPLES, built


@pytest.mark.e2e
def test_the_sandbox_agent_trains_from_its_traces(collector, vllm_server, tiny_model, tmp_path):  # noqa: F811
    from lightspan import store
    from lightspan.trainer.sync import ReloadSync

    sbx_probe = subprocess.run([sys.executable, "-c", "import sandbox; sandbox.Sandbox().check()"], cwd=AGENT.parent,
                               capture_output=True, text=True)
    if sbx_probe.returncode != 0:
        pytest.skip(f"bubblewrap cannot run here: {sbx_probe.stderr.strip().splitlines()[-1:]}")
    data, ports = collector
    api = f"http://127.0.0.1:{ports['api']}"
    ReloadSync(vllm_server.url).push(str(tiny_model), 0)  # other tests may have left other weights
    out = lightspan("rollout", "--tasks", str(tiny_tasks(tmp_path)), "--samples", str(SAMPLES), "--concurrency", "4",
                    "--env-map", ENV_MAP, "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}",
                    "--openai-base-url", f"{vllm_server.url}/v1", "--data-dir", str(data), "--timeout-s", "120",
                    "--", sys.executable, str(AGENT))
    assert out["ok"] == 2 * SAMPLES, out
    requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()
    con = store.connect(data)
    # two turns a rollout (random bytes hold no program and no answer: a reminder, then the turn budget)
    n_calls, n_with_ids = con.execute("""
        SELECT count(*), count(*) FILTER (WHERE len(completion_token_ids) > 0 AND len(prompt_token_ids) > 0)
        FROM llm_calls WHERE coalesce(capture_status, 'ok') = 'ok'""").fetchone()
    assert (n_calls, n_with_ids) == (2 * SAMPLES * 2,) * 2
    rollouts = con.execute("SELECT rollout_key, task_id, final_reward FROM rollouts WHERE task_id IS NOT NULL "
                           "ORDER BY rollout_key").fetchall()
    assert len(rollouts) == 2 * SAMPLES and all(r[2] == 0.0 for r in rollouts), rollouts
    grade_first_of_each_task(api, rollouts)

    built = lightspan("transitions", "build", "--data-dir", str(data), "--grace-s", "0")
    assert built["transitions/calls"] == 2 * SAMPLES * 2 and built["transitions/nonzero_advantage"] > 0, built
    train_one_step(data, tiny_model, vllm_server.url)
    steps = store.connect(data).execute("SELECT policy_version, num_transitions FROM train_steps").fetchall()
    assert steps == [(1, 2 * SAMPLES * 2)], steps
