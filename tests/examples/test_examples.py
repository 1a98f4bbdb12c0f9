"""Smoke runs of the examples in examples/: each unchanged agent under ``lightspan rollout`` (real
``opentelemetry-instrument``, real collector, the session's real vLLM serving the tiny model), then
transitions and one training step; and ``lightspan experiment`` end to end for one of them.

The tiny model writes random bytes, so no task is ever solved: these tests assert the pipeline,
not learning. A grader's late reward (``POST /v1/rewards``, the collector's API) marks one rollout
of each task solved, so that each group has a nonzero advantage and the trainer takes its step.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.conftest import collector_process

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SAMPLES = 2
# (example, agent_match, LLM calls per rollout, trained calls per rollout, agent name of the trained calls)
CASES = {
    "calc_agent": ("", 2, 2, "calc_agent"),
    "sql_agent": ("", 1, 1, "agent"),        # no agent span: the service name (the runner's default)
    "multi_agent": ("^sql_writer$", 2, 1, "sql_writer"),
}


def lightspan(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "lightspan.cli", *args], check=True, text=True,
                         stdout=subprocess.PIPE).stdout
    return json.loads(out.strip().splitlines()[-1]) if out.strip() else {}


def grade_first_of_each_task(api: str, rollouts) -> None:
    """A grader marks the first rollout of each task solved (the tiny model never solves one), so every
    group of ``rollouts`` (rows of rollout key, task id, ...) has an advantage; then the collector flushes."""
    firsts = {}
    for key, task_id, *_ in rollouts:
        firsts.setdefault(task_id, key)
    for key in firsts.values():
        requests.post(f"{api}/v1/rewards", json={"rollout_id": key, "value": 1.0, "name": "grader"},
                      timeout=30).raise_for_status()
    requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()


def train_one_step(data: Path, model: Path, vllm_url: str) -> None:
    """One GRPO step of ``lightspan train --mode once`` on the built transitions, synced into the vLLM."""
    subprocess.run([sys.executable, "-m", "lightspan.cli", "train", "--mode", "once", "--data-dir", str(data),
                    "--model", str(model), "--vllm-url", vllm_url, "--learning-rate", "1e-3",
                    "--loss-type", "grpo", "--sync", "reload", "--seed", "0"], check=True)
    assert json.loads((data / "policy.json").read_text())["version"] == 1


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_tasks(example: str, tmp_path: Path, n: int) -> tuple[Path, Path]:
    """The example's own generator's tasks, cut to fit the tiny model's 512-byte context:
    no worked examples in the prompt (``shots: 0``) and 8 new tokens."""
    gen = load(EXAMPLES / ("sql_agent" if example == "multi_agent" else example) / "make_tasks.py")
    if example == "calc_agent":
        train, val = gen.make_splits(0, n, n)
    else:
        from_dir = EXAMPLES / "sql_agent" / "data"
        db = load(EXAMPLES / "sql_agent" / "spider_db.py").ensure_db(from_dir / gen.DB_NAME)
        train, val = gen.make_splits(db, 0, 0.3)
    files = []
    for name, rows in (("train", train[:n]), ("val", val[:n])):
        path = tmp_path / f"{example}-{name}.jsonl"
        path.write_text("".join(json.dumps({**t, "shots": 0, "max_tokens": 8, "temperature": 0.8}) + "\n"
                                for t in rows))
        files.append(path)
    return files[0], files[1]


@pytest.fixture
def collector(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    with collector_process(data, tmp_path / "collector.log") as running:
        yield running


@pytest.mark.parametrize("example", list(CASES))
def test_example_trains_from_its_traces(example, collector, vllm_server, tiny_model, tmp_path):
    from lightspan import store
    from lightspan.trainer.sync import ReloadSync

    if example != "sql_agent":  # the LangGraph examples need the 'examples' extra
        pytest.importorskip("langgraph", reason="pip install 'lightspan[examples]'")
        pytest.importorskip("opentelemetry.instrumentation.langchain", reason="pip install 'lightspan[examples]'")
    agent_match, calls_per_rollout, trained_per_rollout, trained_agent = CASES[example]
    data, ports = collector
    api = f"http://127.0.0.1:{ports['api']}"
    ReloadSync(vllm_server.url).push(str(tiny_model), 0)  # other tests may have left other weights
    tasks, _ = small_tasks(example, tmp_path, 2)
    out = lightspan("rollout", "--tasks", str(tasks), "--samples", str(SAMPLES), "--concurrency", "4",
                    "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}", "--openai-base-url",
                    f"{vllm_server.url}/v1", "--data-dir", str(data), "--timeout-s", "120",
                    "--", sys.executable, str(EXAMPLES / example / "agent.py"))
    assert out["ok"] == 2 * SAMPLES, out
    requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()
    con = store.connect(data)
    # every LLM call of the graph landed with its token ids; every rollout has its reward
    n_calls, n_with_ids = con.execute("""
        SELECT count(*), count(*) FILTER (WHERE len(completion_token_ids) > 0 AND len(prompt_token_ids) > 0)
        FROM llm_calls WHERE coalesce(capture_status, 'ok') = 'ok'""").fetchone()
    assert (n_calls, n_with_ids) == (2 * SAMPLES * calls_per_rollout,) * 2
    rollouts = con.execute("SELECT rollout_key, task_id, final_reward FROM rollouts WHERE task_id IS NOT NULL "
                           "ORDER BY rollout_key").fetchall()
    assert len(rollouts) == 2 * SAMPLES and all(r[2] is not None for r in rollouts), rollouts
    grade_first_of_each_task(api, rollouts)

    built = lightspan("transitions", "build", "--data-dir", str(data), "--agent-match", agent_match, "--grace-s", "0")
    assert built["transitions/calls"] == 2 * SAMPLES * trained_per_rollout, built
    assert built["transitions/nonzero_advantage"] > 0, built
    con = store.connect(data)
    agents = con.execute("SELECT agent_name, count(*) FROM transitions GROUP BY ALL").fetchall()
    assert agents == [(trained_agent, 2 * SAMPLES * trained_per_rollout)], agents
    if example == "multi_agent":
        # the trained calls are the writer's: under its graph's workflow span, never the checker's
        parents = con.execute("""
            SELECT DISTINCT a.name FROM transitions t
            JOIN spans c ON t.transition_id = c.rollout_id || '/' || c.span_id
            JOIN spans n ON n.trace_id = c.trace_id AND n.span_id = c.parent_span_id
            JOIN spans a ON a.trace_id = n.trace_id AND a.span_id = n.parent_span_id""").fetchall()
        assert parents == [("sql_writer.workflow",)], parents
        assert built["transitions/dropped_calls/agent_mismatch"] == 2 * SAMPLES, built

    subprocess.run([sys.executable, "-m", "lightspan.cli", "train", "--mode", "once", "--data-dir", str(data),
                    "--model", str(tiny_model), "--vllm-url", vllm_server.url, "--learning-rate", "1e-3",
                    "--loss-type", "grpo", "--sync", "reload", "--seed", "0"], check=True)
    assert json.loads((data / "policy.json").read_text())["version"] == 1
    steps = store.connect(data).execute("SELECT policy_version, num_transitions FROM train_steps").fetchall()
    assert steps == [(1, 2 * SAMPLES * trained_per_rollout)], steps


def test_experiment_writes_curve_and_results(vllm_server, tiny_model, tmp_path):
    """``lightspan experiment`` end to end on the SQL agent: validation, one step, validation."""
    pytest.importorskip("matplotlib", reason="pip install 'lightspan[examples]'")
    train, val = small_tasks("sql_agent", tmp_path, 2)
    out = tmp_path / "results"
    subprocess.run([sys.executable, "-m", "lightspan.cli", "experiment", "--agent",
                    str(EXAMPLES / "sql_agent" / "agent.py"), "--train-tasks", str(train), "--val-tasks", str(val),
                    "--steps", "1", "--tasks-per-step", "2", "--samples", "2", "--vllm-url", vllm_server.url,
                    "--model", str(tiny_model), "--data-dir", str(tmp_path / "data"), "--out-dir", str(out)],
                   check=True)
    results = json.loads((out / "results.json").read_text())
    assert [v["step"] for v in results["val"]] == [0, 1]
    assert [v["rollouts"] for v in results["val"]] == [2, 2]      # each validation counted once
    assert len(results["train"]) == 1 and results["train"][0]["rollouts"] == 4
    assert results["train"][0]["outcomes"]["ok"] == 4
    assert results["train"][0]["transitions"] == results["train"][0]["calls"] == 4   # per_call: a row a call
    png = (out / "curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 200_000
