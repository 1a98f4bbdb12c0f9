"""The web UI's feedback and quality endpoints (dashboards/quality.py) and the rollouts' status, on a
real collector holding rollouts whose outcomes, rewards and judge and human scores are known."""

from __future__ import annotations

import pytest
import requests

from tests.dashboards.conftest import QUALITY_STEPS as STEPS
from tests.dashboards.conftest import REASON


def get(base: str, path: str, **params) -> dict:
    answer = requests.get(base + path, params=params, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_each_rollout_says_its_status_and_why_a_call_was_not_captured(quality_store):
    rows = {r["rollout_key"]: r for r in get(quality_store, "/api/ui/rollouts")["rollouts"]}
    assert {k: r["status"] for k, r in rows.items()} == {
        "f-ok1": "rewarded", "f-ok2": "rewarded", "f-fail": "failed", "f-new1": "unrewarded", "f-new2": "unrewarded"}
    assert (rows["f-fail"]["outcome"], rows["f-fail"]["exit_code"], rows["f-fail"]["final_reward"]) == ("failed", 3, None)
    assert (rows["f-new2"]["num_uncaptured_calls"], rows["f-new2"]["capture_problem"],
            rows["f-new2"]["capture_reason"]) == (1, "no_token_ids", REASON)
    assert rows["f-ok1"]["num_uncaptured_calls"] == 0 and rows["f-ok1"]["capture_reason"] is None
    one = get(quality_store, "/api/ui/rollouts/f-new2")
    assert (one["status"], one["capture_problem"], one["capture_reason"]) == ("unrewarded", "no_token_ids", REASON)
    assert get(quality_store, "/api/ui/rollouts/f-fail")["status"] == "failed"


@pytest.mark.parametrize("status, expected", [("unrewarded", {"f-new1", "f-new2"}), ("failed", {"f-fail"}),
                                              ("rewarded", {"f-ok1", "f-ok2"}), ("timeout", set())])
def test_rollouts_filter_by_status(quality_store, status, expected):
    assert {r["rollout_key"] for r in get(quality_store, "/api/ui/rollouts", status=status)["rollouts"]} == expected


def test_a_rollouts_rewards_say_who_gave_them_and_why(quality_store):
    rewards = get(quality_store, "/api/ui/rollouts/f-ok2")["rewards"]
    got = [(r["reward_name"], r["reward"], r["source"], r["comment"], r["correction"], r["judge_model"]) for r in rewards]
    assert got == [("reward", 0.0, "agent", None, None, None), ("judge", 1.0, "judge", None, None, "m"),
                   ("human", 0.0, "human", "wrong sum", "2 + 2 = 4", None)]


def test_the_queue_is_the_unrewarded_rollouts_newest_first_and_steps_past_the_skipped(quality_store):
    first = get(quality_store, "/api/ui/queue")
    assert (first["total"], first["remaining"], first["next"]["rollout_key"]) == (2, 2, "f-new2")
    cursor = first["next"]["cursor"]
    assert isinstance(cursor["after_time"], str) and int(cursor["after_time"]) == first["next"]["start_time_unix_nano"]
    second = get(quality_store, "/api/ui/queue", **cursor)
    assert (second["total"], second["remaining"], second["next"]["rollout_key"]) == (2, 1, "f-new1")
    last = get(quality_store, "/api/ui/queue", **second["next"]["cursor"])
    assert (last["total"], last["remaining"], last["next"]) == (2, 0, None)
    assert get(quality_store, "/api/ui/queue", task="task-f")["next"]["rollout_key"] == "f-new1"
    assert get(quality_store, "/api/ui/queue", split="val")["total"] == 1


def test_pass_at_k_counts_a_failure_against_and_an_unrewarded_rollout_not_at_all(quality_store):
    # version 1: f-ok1 (1.0), f-ok2 (0.0), f-fail: n = 3, c = 1; version 2 has no known outcome yet
    doc = get(quality_store, "/api/ui/quality", k="2")
    assert doc["k"] == 2 and doc["threshold"] == 1.0
    assert [(t["task_id"], t["model_version"], t["n"], t["c"]) for t in doc["tasks"]] == [("task-f", 1, 3, 1)]
    assert doc["tasks"][0]["pass_at_k"] == pytest.approx(1 - 1 / 3) and doc["tasks"][0]["pass_hat_k"] == 0.0
    by = {(r["model_version"], r["k"]): (r["tasks"], r["pass_at_k"], r["pass_hat_k"]) for r in doc["by_version"]}
    assert by == {(1, 1): (1, pytest.approx(1 / 3), pytest.approx(1 / 3)), (1, 2): (1, pytest.approx(2 / 3), 0.0)}
    low = get(quality_store, "/api/ui/quality", threshold="0")           # every known outcome but the failure succeeds
    assert [(t["n"], t["c"]) for t in low["tasks"]] == [(3, 2)]


def test_judge_and_human_agreement_and_drift(quality_store):
    doc = get(quality_store, "/api/ui/quality")
    a = doc["agreement"]
    assert (a["rollouts"], a["mean_abs_difference"], a["success_agreement"]) == (2, 0.5, 0.5)
    assert a["correlation"] is None                       # the judge gave 1.0 twice: no variance, no correlation
    assert doc["judge_drift"] == [{"model_version": 1, "rollouts": 2, "judge_minus_human": 0.5}]
    assert [(p["rollout_key"], p["judge"], p["human"]) for p in doc["pairs"]] == [("f-ok2", 1.0, 0.0), ("f-ok1", 1.0, 1.0)]


def test_training_shows_the_entropy_floor_and_each_sources_reward(quality_store):
    doc = get(quality_store, "/api/ui/training")
    assert [(s["step"], s["entropy"], s["entropy_floor"]) for s in doc["steps"]] == STEPS
    assert doc["entropy_warnings"] == [2]                 # step 3 ran without a floor
    by = {(r["policy_version"], r["source"]): (r["rollouts"], r["reward_mean"]) for r in doc["reward_by_source"]}
    assert by == {(1, "agent"): (2, 0.5), (1, "judge"): (2, 1.0), (1, "human"): (2, 0.5)}


@pytest.mark.parametrize("path, params, names", [
    ("/api/ui/rollouts", {"status": "done"}, "'status'"),
    ("/api/ui/queue", {"after_time": "12"}, "'after_key'"),
    ("/api/ui/queue", {"after_key": "f-new2"}, "'after_time'"),
    ("/api/ui/queue", {"after_time": "soon", "after_key": "k"}, "'after_time'"),
    ("/api/ui/queue", {"limit": "3"}, "limit"),
    ("/api/ui/quality", {"k": "0"}, "'k'"),
    ("/api/ui/quality", {"k": "1001"}, "'k'"),
    ("/api/ui/quality", {"threshold": "nan"}, "'threshold'"),
    ("/api/ui/quality", {"run": "x"}, "run"),
])
def test_bad_parameters_are_400_naming_the_parameter(quality_store, path, params, names):
    answer = requests.get(quality_store + path, params=params, timeout=30)
    assert answer.status_code == 400, answer.text
    assert names in answer.json()["error"]
