"""The API's data endpoints: POST /v1/rewards (late, idempotent, durable) and read-only /v1/sql."""

from __future__ import annotations

import shutil
import time

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export import SpanExportResult

from lightspan.collector import api
from lightspan.store.sql import sql_connection
from lightspan.collector.server import Collector
from tests.collector.helpers import api_url, config, grpc_exporter, make_spans, query, raw_rows

KEY = bytes(range(32))       # a collector's reward-id secret (reward_integrity.load_key)


# --- rewards -------------------------------------------------------------------------------------

def test_reward_ids_are_deterministic_per_rollout_name_and_key_and_secret():
    request, recorded = api.reward_request([{"rollout_id": "r", "value": 1}, {"rollout_id": "r", "value": 0.5}], 7, KEY)
    assert recorded[0]["trace_id"] == recorded[1]["trace_id"]            # same key: same ids
    ids = {api.reward_ids(KEY, "r", "reward", None), api.reward_ids(KEY, "r", "reward", "2"),
           api.reward_ids(KEY, "r", "judge", None), api.reward_ids(KEY, "r2", "reward", None),
           api.reward_ids(bytes(32), "r", "reward", None)}
    assert len(ids) == 5                                                  # another collector's secret: other ids
    span = request.resource_spans[0].scope_spans[0].spans[0]
    assert span.name == "lightspan.reward" and span.end_time_unix_nano == 7
    assert {kv.key for kv in span.attributes} == {"lightspan.rollout.id", "lightspan.reward", "lightspan.reward.name",
                                                  "lightspan.reward.source"}
    assert {kv.key: kv.value.string_value for kv in span.attributes}["lightspan.reward.source"] == "api"


def test_a_reward_may_say_who_gave_it_and_which_call_it_scores():
    doc = {"rollout_id": "r", "value": 1, "name": "human", "source": "human", "comment": "ok", "span_id": "ab" * 8,
           "correction": "5"}
    request, (recorded,) = api.reward_request(doc, 7, KEY)
    attrs = {kv.key: kv.value.string_value for kv in request.resource_spans[0].scope_spans[0].spans[0].attributes}
    assert attrs["lightspan.reward.call_span_id"] == "ab" * 8 and attrs["lightspan.reward.correction"] == "5"
    assert recorded["call_span_id"] == "ab" * 8 and recorded["span_id"] != "ab" * 8     # the reward's own span
    # two calls of one rollout scored under one name are two rewards
    _, (other,) = api.reward_request({**doc, "span_id": "cd" * 8}, 7, KEY)
    assert other["span_id"] != recorded["span_id"]
    for bad, message in [({"source": "robot"}, "'source' must be one of"), ({"span_id": "XYZ"}, "16 lowercase hex"),
                         ({"comment": "x" * 5000}, "longer than 4096")]:
        with pytest.raises(api.BadRequest, match=message):
            api.reward_request({**doc, **bad}, 7, KEY)


@pytest.mark.parametrize("doc, message", [
    ({"value": 1.0}, "'rollout_id' is required"),
    ({"rollout_id": "r", "value": "1"}, "'value' must be a number"),
    ({"rollout_id": "r", "value": True}, "'value' must be a number"),
    ({"rollout_id": "r", "value": float("nan")}, "must be finite"),
    ({"rollout_id": "r", "value": 10 ** 400}, "must be finite"),
    ({"rollout_id": "r", "value": 1, "reward": 2}, "unknown field(s) ['reward']"),
    ({"rollout_id": "", "value": 1}, "'rollout_id' is empty"),
    ([{"rollout_id": "r", "value": 1}, 3], "reward[1] is not a JSON object"),
    ([], "no rewards"),
])
def test_reward_request_rejects_bad_input_with_a_clear_message(doc, message):
    with pytest.raises(api.BadRequest) as info:
        api.reward_request(doc, 0, KEY)
    assert message in str(info.value)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=12)
_reward = st.fixed_dictionaries({}, optional={k: _json for k in ("rollout_id", "value", "name", "id", "task_id", "x")})


@settings(max_examples=300, deadline=None)
@given(doc=_json | _reward | st.lists(_reward, max_size=3))
def test_reward_request_answers_any_json_with_a_request_or_bad_request(doc):
    try:
        request, recorded = api.reward_request(doc, 1, KEY)
    except api.BadRequest:
        return
    assert len(request.resource_spans[0].scope_spans[0].spans) == len(recorded) > 0


def test_posted_rewards_are_durable_idempotent_and_show_in_the_views(collector_factory, data_dir, tmp_path):
    collector = collector_factory()
    assert grpc_exporter(collector).export(make_spans("r1")) == SpanExportResult.SUCCESS   # the agent's spans
    url = api_url(collector, "/v1/rewards")
    first = requests.post(url, json={"rollout_id": "r1", "value": 1.0}, timeout=5)
    assert first.status_code == 200 and first.json()["accepted"] == 1
    crashed = tmp_path / "crashed"
    shutil.copytree(data_dir / "wal", crashed / "wal")      # what a crash right after the 200 leaves
    again = requests.post(url, json={"rollout_id": "r1", "value": 1.0}, timeout=5)   # re-post, same key and value
    assert again.status_code == 200 and again.json()["rewards"][0]["span_id"] == first.json()["rewards"][0]["span_id"]
    assert (again.json()["stored"], again.json()["rewards"][0]["status"]) == (0, "already_stored")
    changed = requests.post(url, json={"rollout_id": "r1", "value": 0.0}, timeout=5)  # same key, another value
    assert changed.status_code == 409 and changed.json()["conflicts"][0]["stored_value"] == 1.0
    judged = requests.post(url, json=[{"rollout_id": "r1", "value": 0.25, "name": "judge", "id": "a"},
                                      {"rollout_id": "r1", "value": 0.75, "name": "judge", "id": "b"},
                                      {"rollout_id": "r2", "value": -1, "task_id": "t9"}], timeout=5)
    assert judged.status_code == 200 and judged.json()["accepted"] == 3
    bad = requests.post(url, json={"rollout_id": "r1"}, timeout=5)
    assert bad.status_code == 400 and "'value' must be a number" in bad.json()["error"]
    not_json = requests.post(url, data=b"{oops", headers={"Content-Type": "application/json"}, timeout=5)
    assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]
    collector.flush()
    assert raw_rows(data_dir) == 3 + 4                        # the re-post is not stored again...
    assert query(data_dir, """SELECT rollout_key, reward_name, reward FROM rewards
                              ORDER BY rollout_key, reward_name, reward""") == [
        ("r1", "judge", 0.25), ("r1", "judge", 0.75), ("r1", "reward", 1.0), ("r2", "reward", -1.0)]  # ...once
    assert query(data_dir, "SELECT num_spans, num_llm_calls, task_id FROM rollouts WHERE rollout_key = 'r1'") == [
        (3 + 3, 2, "task-1")]
    assert query(data_dir, "SELECT task_id, final_reward FROM rollouts WHERE rollout_key = 'r2'") == [("t9", -1.0)]
    assert collector.metrics.snapshot()["rewards_accepted_total"] == 4
    assert collector.metrics.snapshot()["spans_deduplicated_total"] == 0     # the re-post never reached the WAL
    replayed = Collector(config(crashed)).start()              # durable before the 200
    try:
        assert query(crashed, "SELECT rollout_key, reward FROM rewards") == [("r1", 1.0)]
    finally:
        replayed.stop()


# --- SQL ---------------------------------------------------------------------------------------

def sql(collector, statement: str, method: str = "POST"):
    if method == "GET":
        return requests.get(api_url(collector, "/v1/sql"), params={"q": statement}, timeout=30)
    return requests.post(api_url(collector, "/v1/sql"), json={"sql": statement}, timeout=30)


def test_sql_endpoint_answers_json_rows_and_caps_them(collector_factory):
    collector = collector_factory(sql_max_rows=5)
    assert grpc_exporter(collector).export(make_spans("q1")) == SpanExportResult.SUCCESS
    collector.flush()
    for method in ("POST", "GET"):
        answer = sql(collector, "SELECT name, prompt_token_ids FROM spans WHERE name = 'chat' "
                                "ORDER BY start_time_unix_nano", method)
        assert answer.status_code == 200, answer.text
        doc = answer.json()
        assert doc["columns"] == ["name", "prompt_token_ids"] and doc["types"] == ["VARCHAR", "INTEGER[]"]
        assert doc["rows"] == [["chat", [100, 101, 102]], ["chat", [101, 101, 102]]] and not doc["truncated"]
    capped = sql(collector, "SELECT range AS i FROM range(1000)").json()
    assert capped["rows"] == [[0], [1], [2], [3], [4]] and capped["truncated"] is True
    odd = sql(collector, "SELECT 'nan'::double AS x, '\\xAA'::blob AS b, MAP {'k': 1} AS m").json()
    assert odd["rows"] == [[None, "qg==", {"k": 1}]]   # JSON has no NaN: null (store.sql.jsonable)
    assert collector.metrics.snapshot()["sql_queries_total"] == 4


@pytest.mark.parametrize("statement, message", [
    ("SELEC 1", "Parser Error"),
    ("SELECT * FROM no_such_view", "Catalog Error"),
    ("SELECT 1; SELECT 2", "exactly one statement"),
    ("CREATE TABLE t AS SELECT 1", "read-only"),
    ("SET enable_external_access = true", "read-only"),
    ("", "no SQL"),
])
def test_sql_endpoint_answers_400_with_the_reason(collector_factory, statement, message):
    collector = collector_factory()
    answer = sql(collector, statement)
    assert answer.status_code == 400 and message in answer.json()["error"], answer.text


def test_sql_endpoint_refuses_files_outside_the_store(collector_factory, data_dir, tmp_path):
    collector = collector_factory()
    assert grpc_exporter(collector).export(make_spans("q2")) == SpanExportResult.SUCCESS
    collector.flush()
    secret = tmp_path / "secret.csv"
    secret.write_text("password\nhunter2\n")
    outside = tmp_path / "outside.parquet"
    pq.write_table(pa.table({"x": [1]}), outside)
    for statement in (f"SELECT * FROM read_csv('{secret}')", f"SELECT * FROM read_parquet('{outside}')",
                      f"SELECT * FROM read_text('{data_dir}/wal/*')", "SELECT * FROM glob('/etc/*')"):
        answer = sql(collector, statement)
        assert answer.status_code == 400 and "Permission Error" in answer.json()["error"], statement
    inside = sql(collector, f"SELECT count(*) FROM read_parquet('{data_dir}/spans/**/*.parquet')")
    assert inside.json()["rows"] == [[3]]                     # the store's own files stay readable
    # the connection itself refuses what the endpoint's read-only check would catch first
    con = sql_connection(data_dir)
    try:
        assert con.execute("SELECT count(*) FROM spans").fetchall() == [(3,)]
        for statement in (f"COPY (SELECT 1) TO '{tmp_path}/out.csv'", f"ATTACH '{tmp_path}/other.db'",
                          "INSTALL httpfs", f"CREATE TABLE t AS FROM read_csv('{secret}')"):
            with pytest.raises(duckdb.PermissionException):
                con.execute(statement)
        with pytest.raises(duckdb.Error, match="locked"):
            con.execute("SET enable_external_access = true")
        with pytest.raises(duckdb.Error, match="locked"):
            con.execute("SET allowed_directories = ['/']")
    finally:
        con.close()
    assert not (tmp_path / "out.csv").exists() and not (tmp_path / "other.db").exists()


def test_sql_endpoint_interrupts_a_query_past_the_time_limit(collector_factory):
    collector = collector_factory(sql_timeout_s=0.3)
    start = time.monotonic()
    answer = sql(collector, "SELECT sum(a.range * b.range) FROM range(1000000) a, range(1000000) b")
    assert answer.status_code == 400 and "sql_timeout_s=0.3" in answer.json()["error"]
    assert time.monotonic() - start < 15                      # ~1e12 rows: minutes without the timer
    assert sql(collector, "SELECT 42").json()["rows"] == [[42]]   # the server keeps answering
    assert collector.metrics.snapshot()["sql_errors_total"] == 1
