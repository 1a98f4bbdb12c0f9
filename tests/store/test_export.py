"""``lightspan export``: what comes out is what the store holds, in both formats, filtered."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from lightspan import cli
from lightspan.core.config import ConfigError
from lightspan.store import export
from tests.collector.helpers import query


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_calls_round_trip_through_jsonl_and_parquet(known_store, tmp_path, capsys):
    data, _ = known_store
    stored = query(data, "SELECT span_id, prompt_token_ids, completion_token_ids, input_messages FROM llm_calls ORDER BY span_id")
    for suffix in ("jsonl", "parquet"):
        out = tmp_path / f"calls.{suffix}"
        assert cli.main(["export", "--what", "calls", "--out", str(out), "--data-dir", str(data)]) == 0
        assert json.loads(capsys.readouterr().out)["rows"] == len(stored)
        rows = _jsonl(out) if suffix == "jsonl" else pq.read_table(out).to_pylist()
        got = sorted((r["span_id"], r["prompt_token_ids"], r["completion_token_ids"],
                      r["input_messages"] if suffix == "parquet" else json.dumps(r["input_messages"]))
                     for r in rows)
        assert [g[:3] for g in got] == [s[:3] for s in stored]
        assert [json.loads(g[3]) for g in got] == [json.loads(s[3]) for s in stored]   # messages: parsed in JSONL


def test_rollouts_carry_their_messages_and_every_reward(known_store, tmp_path):
    data, _ = known_store
    out = tmp_path / "rollouts.jsonl"
    export.write(export.ExportConfig(what="rollouts", out=str(out), data_dir=str(data), status="rewarded"))
    rows = {r["rollout_key"]: r for r in _jsonl(out)}
    assert set(rows) == {"x1", "x2", "x3", "y1", "y2"}       # not the failed or the unrewarded rollout
    y1 = rows["y1"]
    assert [m["output_messages"] for m in y1["messages"]][0].startswith("[{")   # the call's messages, as recorded
    assert [(r["source"], r["value"]) for r in y1["rewards"]] == [("agent", 1.0), ("judge", 1.0), ("human", 0.25)]
    assert y1["rewards"][2]["correction"] == "The answer is 5." and y1["final_reward"] == 0.25


def test_filters_select_what_they_say(known_store, tmp_path):
    data, transitions = known_store
    out = tmp_path / "t.parquet"
    export.write(export.ExportConfig(what="transitions", out=str(out), data_dir=str(data), policy_version=1,
                                     min_reward=0.5))
    assert sorted(r["transition_id"] for r in pq.read_table(out).to_pylist()) == ["x1/t", "x3/t"]
    export.write(export.ExportConfig(what="calls", out=str(out), data_dir=str(data), agent="^check"))
    assert [r["rollout_key"] for r in pq.read_table(out).to_pylist()] == ["x3"]
    export.write(export.ExportConfig(what="calls", out=str(out), data_dir=str(data), limit=2))
    assert pq.read_table(out).num_rows == 2
    with pytest.raises(ConfigError, match="export.format"):
        export.ExportConfig(out=str(tmp_path / "x.csv"))
    with pytest.raises(ConfigError, match="export.out"):
        export.ExportConfig()
