"""Canaries in ``lightspan status`` and the web UI's API: the serving version, the candidate with its
share and each arm's rewarded rollouts, rolled-back versions and the latest decisions with their
evidence, from a store whose spans and decisions are written here."""

from __future__ import annotations

import json

import pyarrow as pa

from lightspan import store
from lightspan.cli import main
from lightspan.store import deployments as dep

T0 = 1_800_000_000 * 10**9


def _rollout(i: int, version: int, reward: float) -> list[dict]:
    """One rollout: an LLM call served by ``version`` and its reward span, after the canary began."""
    base = {"trace_id": f"{i:032x}", "rollout_id": f"r{i}", "kind": "INTERNAL", "service_name": "agent",
            "status_code": "UNSET"}
    call = {**base, "span_id": f"{2 * i + 1:016x}", "name": "chat policy", "operation_name": "chat",
            "start_time_unix_nano": T0 + 100 + i, "end_time_unix_nano": T0 + 200 + i, "model_version": version,
            "prompt_token_ids": [1, 2], "completion_token_ids": [3], "capture_status": "ok"}
    reward_span = {**base, "span_id": f"{2 * i + 2:016x}", "name": "reward", "start_time_unix_nano": T0 + 300 + i,
                   "end_time_unix_nano": T0 + 300 + i, "reward": reward, "reward_name": "reward"}
    return [call, reward_span]


def _store(tmp_path):
    rows = [s for i in range(6) for s in _rollout(i, 1, 1.0)] + [s for i in range(6, 10) for s in _rollout(i, 2, 0.0)]
    store.write_table(tmp_path, "spans", pa.Table.from_pylist(rows, schema=store.SPAN_SCHEMA),
                      partition="date=2027-01-15")
    dep.record(tmp_path, [dep.row("", 1, "serve", time_unix_nano=T0 - 10, checkpoint="/ck/v1"),
                          dep.row("", 0, "rollback", time_unix_nano=T0 - 5, actor="manual", reason="by hand"),
                          dep.row("", 2, "canary", time_unix_nano=T0, share=0.25, serving_version=1,
                                  checkpoint="/ck/v2", reason="published by training")])
    return tmp_path


def test_status_shows_versions_shares_decisions_and_evidence(tmp_path, capsys):
    d = str(_store(tmp_path))
    assert main(["status", "--data-dir", d, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)["data"]["deployments"]
    (policy,) = doc["policies"]
    assert (policy["serving"], policy["candidate"], policy["share"], policy["rolled_back"]) == (1, 2, 0.25, [0])
    assert policy["arms"] == {"2": {"rollouts": 4, "reward_mean": 0.0}, "1": {"rollouts": 6, "reward_mean": 1.0}}
    assert [r["action"] for r in doc["decisions"]] == ["canary", "rollback", "serve"]       # newest first
    assert main(["status", "--data-dir", d]) == 0
    out = capsys.readouterr().out
    assert ("deployment    serving v1, canary v2 on 25% of rollouts since 2027-01-15 08:00:00Z "
            "(v2: 4 rewarded, mean 0.000, v1: 6 rewarded, mean 1.000); rolled back: v0") in out
    assert "rollback v0 (manual): by hand" in out


def test_status_without_canaries_says_nothing_of_them(tmp_path, capsys):
    assert main(["status", "--data-dir", str(tmp_path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["deployments"] == {"policies": [], "decisions": []}


def test_the_web_uis_training_page_gets_the_canaries(tmp_path):
    from lightspan.dashboards import quality
    from lightspan.store.sql import sql_connection

    con = sql_connection(_store(tmp_path))        # the UI's read-only connection
    try:
        doc = quality.training(con, {})["deployments"]
    finally:
        con.close()
    assert [(p["serving"], p["candidate"], p["arms"]["2"]["rollouts"]) for p in doc["policies"]] == [(1, 2, 4)]
    assert doc["decisions"][0]["action"] == "canary" and doc["decisions"][0]["reason"] == "published by training"
