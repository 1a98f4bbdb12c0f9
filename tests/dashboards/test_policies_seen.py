"""Several policies, seen: the ``rollouts`` and ``policy_rollouts`` views, the web UI's training page
and ``lightspan status`` on a store two policies wrote (a writer and a checker)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from lightspan import store
from lightspan.cli import main
from lightspan.dashboards import quality, status

T0 = 1_800_000_000 * 10**9


def span(rid, i, **cols):
    row = {f.name: None for f in store.SPAN_SCHEMA}
    row.update(trace_id=f"{abs(hash(rid)) % 16**32:032x}", span_id=f"{abs(hash((rid, i))) % 16**16:016x}",
               name="chat", kind="CLIENT", service_name="agent", start_time_unix_nano=T0 + 10 * i,
               end_time_unix_nano=T0 + 10 * i + 5, status_code="UNSET", rollout_id=rid, task_id="t1",
               split="train", received_unix_nano=T0)
    row.update(cols)
    return row


@pytest.fixture
def two_policy_store(tmp_path):
    rows = []
    for rid, reward, writer_version in (("r1", 1.0, 0), ("r2", 0.0, 1), ("r3", 0.5, 1)):
        rows += [span(rid, 0, operation_name="chat", agent_name="writer", policy="writer",
                      model_version=writer_version, prompt_token_ids=[1], completion_token_ids=[2],
                      completion_logprobs=[-1.0]),
                 span(rid, 1, operation_name="chat", agent_name="checker", policy="checker", model_version=0,
                      prompt_token_ids=[1], completion_token_ids=[3], completion_logprobs=[-1.0]),
                 span(rid, 2, name="lightspan.reward", reward=reward)]
    rows += [span("solo", 0, operation_name="chat", model_version=4, prompt_token_ids=[1],
                  completion_token_ids=[2], completion_logprobs=[-1.0]), span("solo", 1, reward=0.25)]
    store.write_table(tmp_path, "spans", pa.Table.from_pylist(rows, schema=store.SPAN_SCHEMA),
                      partition="date=2026-11-30")
    steps = [("run-w", "writer", 1, T0 + 100, 0.5), ("run-c", "checker", 1, T0 + 200, 0.4),
             ("run-w", "writer", 2, T0 + 300, 0.3)]
    store.write_table(tmp_path, "train_steps", pa.Table.from_pylist(
        [{"run_id": r, "policy": p, "step": s, "policy_version": s, "time_unix_nano": t, "loss": loss}
         for r, p, s, t, loss in steps], schema=store.TRAIN_STEP_SCHEMA))
    store.policy.write(tmp_path, 2, tmp_path / "ckpt-w2", name="writer")
    store.policy.write(tmp_path, 1, tmp_path / "ckpt-c1", name="checker")
    return tmp_path


def test_views_show_rollouts_per_policy(two_policy_store):
    con = store.connect(two_policy_store)
    assert con.execute("SELECT rollout_key, policies FROM rollouts ORDER BY 1").fetchall() == [
        ("r1", ["checker", "writer"]), ("r2", ["checker", "writer"]), ("r3", ["checker", "writer"]), ("solo", [])]
    rows = con.execute("SELECT policy, model_version, count(*), avg(final_reward) FROM policy_rollouts "
                       "GROUP BY ALL ORDER BY ALL").fetchall()
    assert rows == [("checker", 0, 3, 0.5), ("writer", 0, 1, 1.0), ("writer", 1, 2, 0.25)]
    assert con.execute("SELECT policy, max(policy_version) FROM train_steps GROUP BY ALL ORDER BY 1").fetchall() == [
        ("checker", 1), ("writer", 2)]


def test_training_page_has_a_run_per_policy_and_rewards_per_policy_version(two_policy_store):
    con = store.connect(two_policy_store)
    doc = quality.training(con, {})
    assert [(r["run_id"], r["policy"], r["steps"]) for r in doc["runs"]] == [("run-w", "writer", 2),
                                                                              ("run-c", "checker", 1)]
    assert doc["policy"] == "writer" and [s["loss"] for s in doc["steps"]] == [0.5, 0.3]
    assert {s["policy"] for s in doc["steps"]} == {"writer"}
    by = {(r["policy"], r["policy_version"]): (r["rollouts"], r["reward_mean"]) for r in doc["reward_by_version"]}
    assert by == {(None, 4): (1, 0.25), ("writer", 0): (1, 1.0), ("writer", 1): (2, 0.25), ("checker", 0): (3, 0.5)}
    checker = quality.training(con, {"run": ["run-c"]})
    assert checker["policy"] == "checker" and [s["step"] for s in checker["steps"]] == [1]


def test_status_lists_the_policies(two_policy_store, capsys):
    d = status.data_summary(two_policy_store)
    assert d["policy"] is None
    assert [(p["name"], p["version"]) for p in d["policies"]] == [("checker", 1), ("writer", 2)]
    assert {name: r["step"] for name, r in d["latest_by_policy"].items()} == {"writer": 2, "checker": 1}
    assert main(["status", "--data-dir", str(two_policy_store)]) == 0
    out = capsys.readouterr().out
    assert "policy        checker: version 1 at" in out and "policy        writer: version 2 at" in out
    assert "none published" not in out
    assert "latest run      writer: run-w: 2 steps, last step 2" in out
    assert "latest run      checker: run-c: 1 steps, last step 1" in out
    assert main(["status", "--data-dir", str(two_policy_store), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["policies"][0]["name"] == "checker"
