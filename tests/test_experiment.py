"""The experiment loop with training overlapped: never a transition trained staler than max_staleness.

``TrainerQueue``'s accounting is checked on train_steps rows written as the trainer writes them; the
loop itself runs for real (collector, the session's vLLM with the tiny model, the continuous
trainer with in-place reload, the letters agent, whose reward varies from rollout to rollout so
every group has an advantage to train on).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from lightspan import store
from lightspan.runs import TrainerQueue
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent


class _Running:
    """Stands in for the trainer's Popen in the accounting test: a process that is still running."""
    returncode = None

    def poll(self):
        return None


def _train_step(data: Path, version: int, trained: int, stale: int = 0) -> None:
    row = {"run_id": "r", "step": version, "policy_version": version, "num_transitions": trained,
           "skipped_stale": stale, "time_unix_nano": version}
    store.write_table(data, "train_steps", pa.Table.from_pylist(
        [{k: row.get(k) for k in store.TRAIN_STEP_SCHEMA.names}], schema=store.TRAIN_STEP_SCHEMA))
    store.policy.write(data, version, data)


def test_steps_count_as_trained_by_their_transitions_even_when_merged(tmp_path):
    queue = TrainerQueue(tmp_path, _Running())
    for trainable in (5, 0, 3, 4):           # a step without trainable transitions never waits
        queue.submit(trainable)
    assert queue.untrained() == 3
    _train_step(tmp_path, 1, 5)
    assert queue.untrained() == 2
    _train_step(tmp_path, 2, 6, stale=1)      # the next two steps in one trainer step, one transition stale
    assert queue.untrained() == 0
    queue.wait(0)                             # returns at once


def _staleness_of_trained(data: Path) -> list[int]:
    """Reconstruct which transitions each trainer step took (oldest first, the nonzero-advantage ones,
    as many as its row says) and return policy version before the step minus the serving version."""
    con = store.connect(data)
    transitions = con.execute("""
        SELECT model_version FROM transitions WHERE advantage != 0
        ORDER BY created_unix_nano, transition_id""").fetchall()
    steps = con.execute("SELECT policy_version, num_transitions, skipped_stale FROM train_steps "
                        "ORDER BY policy_version").fetchall()
    assert all(stale == 0 for _, _, stale in steps), steps      # the loop produced nothing too stale
    out, i = [], 0
    for version, n, _ in steps:
        out += [version - 1 - served for (served,) in transitions[i:i + n]]
        i += n
    assert i == len(transitions), (i, len(transitions))          # every trainable transition was trained
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("lora", [[], ["--lora-r", "8"]], ids=["full", "lora-merged"])
def test_overlapped_loop_trains_nothing_staler_than_max_staleness(vllm_server, tiny_model, tmp_path, lora):
    tasks = tmp_path / "train.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"Letters {i}", "max_tokens": 8}) + "\n"
                             for i in range(12)))
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"id": f"v{i}", "prompt": f"Say {i}", "max_tokens": 8}) + "\n" for i in range(2)))
    data = tmp_path / "data"
    metrics_port = free_port()
    subprocess.run([sys.executable, "-m", "lightspan.cli", "experiment", "--agent",
                    str(ROOT / "tests" / "agents" / "letters_agent.py"), "--train-tasks", str(tasks),
                    "--val-tasks", str(val), "--steps", "4", "--tasks-per-step", "2", "--samples", "3",
                    "--max-staleness", "1", "--learning-rate", "1e-3", "--vllm-url", vllm_server.url,
                    "--model", str(tiny_model), "--data-dir", str(data), "--out-dir", str(tmp_path / "out"),
                    "--metrics-port", str(metrics_port), *lora],
                   check=True, stdout=subprocess.DEVNULL)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["step"] for r in results["train"]] == [1, 2, 3, 4]
    # a step whose every group scored alike has nothing to train (GRPO's advantage is zero): at
    # least two steps trained, so the overlap with max_staleness 1 was exercised
    trained = [r["step"] for r in results["train"] if r["trained"]]
    assert len(trained) >= 2, results["train"]
    assert results["trainer"]["steps"] >= len(trained) - 1        # steps may merge, none is lost
    staleness = _staleness_of_trained(data)
    assert len(staleness) == sum(r["trainable"] for r in results["train"]) > 0
    assert max(staleness) <= 1 and min(staleness) >= 0, staleness
    # validation waited for the trainer: the last one evaluated the newest policy
    assert results["val"][-1]["policy_version"] == results["trainer"]["steps"]
    assert results["val"][-1]["cpu_seconds"] > results["val"][0]["cpu_seconds"] > 0
    # the CPU by part: the services it started (vLLM was the tests' own) and the rest; training's
    # parts add up to what the budget counted
    by_part = results["cpu_seconds_by_part"]
    assert set(by_part["training"]) == {"collector", "trainer", "rest"} == set(by_part["validation"])
    assert by_part["training"]["trainer"] > 0 and by_part["validation"]["rest"] > 0
    assert abs(sum(by_part["training"].values()) - results["val"][-1]["cpu_seconds"]) < 5
    # what of training came before the first step (the services' start): each part's, within its training CPU
    assert set(by_part["start_up"]) == set(by_part["training"])
    assert all(0 <= by_part["start_up"][k] <= by_part["training"][k] + 0.1 for k in by_part["training"])
    assert by_part["training"]["trainer"] > by_part["start_up"]["trainer"]
    # every sync was checked against vLLM; with LoRA, vLLM (no --enable-lora) serves it merged
    diffs = store.connect(data).execute("SELECT sync_max_abs_logprob_diff FROM train_steps").fetchall()
    assert diffs and all(d is not None and d < 1e-3 for (d,) in diffs), diffs
    if lora:
        assert store.policy.read(data).path.endswith("/merged")
    # the trainer's metrics were served on the port asked for (--metrics-port)
    assert results["ports"]["metrics"] == metrics_port
    assert f"metrics on http://127.0.0.1:{metrics_port}/metrics" in (data / "logs" / "trainer.log").read_text()
