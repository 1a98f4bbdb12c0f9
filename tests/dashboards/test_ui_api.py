"""The web UI's JSON endpoints on a real collector, against hand-built rollouts whose numbers are known."""

from __future__ import annotations

import json
import time
from urllib.parse import quote

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightspan.collector.server import Collector
from lightspan.dashboards import health, ui, web
from tests.collector.helpers import config, grpc_exporter, make_spans
from tests.dashboards.prometheus import parse_prometheus
from tests.dashboards.conftest import ROLLOUTS, TRAIN_STEPS, TOOL_CALL


def get(ui_store, path: str, **params) -> requests.Response:
    return requests.get(ui_store.url(path), params=params, timeout=30)


def keys(answer: requests.Response) -> set[str]:
    assert answer.status_code == 200, answer.text
    return {r["rollout_key"] for r in answer.json()["rollouts"]}


# --- rollouts list -------------------------------------------------------------------------------

def test_rollouts_lists_every_rollout_newest_first_with_its_reward(ui_store):
    doc = get(ui_store, "/api/ui/rollouts").json()
    assert doc["total"] == len(ROLLOUTS) and doc["with_reward"] == len(ROLLOUTS)
    assert doc["reward_mean"] == pytest.approx(sum(r.reward for r in ROLLOUTS) / len(ROLLOUTS))
    assert [r["rollout_key"] for r in doc["rollouts"]] == [r.key for r in reversed(ROLLOUTS)]   # sent in order
    by_key = {r["rollout_key"]: r for r in doc["rollouts"]}
    for r in ROLLOUTS:
        row = by_key[r.key]
        assert (row["task_id"], row["split"], row["final_reward"]) == (r.task, r.split, r.reward)
        assert row["model_version"] == r.version
        assert (row["num_spans"], row["num_llm_calls"], row["agents"]) == (5, 2, [r.agent])


@pytest.mark.parametrize("params, expected", [
    ({"task": "task-a"}, {"r-a1", "r-a2"}),
    ({"split": "val"}, {"r-v1"}),
    ({"agent": "coder"}, {"r-b1"}),
    ({"agent": "svc-coder"}, set()),                       # the agent is gen_ai.agent.name when calls have one
    ({"min_reward": "0.5"}, {"r-a1", "r-b1"}),
    ({"max_reward": "0.25"}, {"r-a2", "r-v1"}),
    ({"version": "2"}, {"r-b1", "r-v1"}),
    ({"task": "task-a", "min_reward": "0.5"}, {"r-a1"}),
    ({"since": "1h"}, {r.key for r in ROLLOUTS}),
    ({"until": "1h"}, set()),
    ({"since": "2000-01-01T00:00:00Z"}, {r.key for r in ROLLOUTS}),
    ({"task": "x' OR 1=1 --"}, set()),                     # bound as a value, never spliced into SQL
])
def test_rollout_filters(ui_store, params, expected):
    answer = get(ui_store, "/api/ui/rollouts", **params)
    assert keys(answer) == expected
    assert answer.json()["total"] == len(expected)


def test_rollouts_pages_with_limit_and_offset(ui_store):
    pages = [get(ui_store, "/api/ui/rollouts", limit=3, offset=offset).json() for offset in (0, 3)]
    assert [len(p["rollouts"]) for p in pages] == [3, 1] and {p["total"] for p in pages} == {4}
    assert {r["rollout_key"] for p in pages for r in p["rollouts"]} == {r.key for r in ROLLOUTS}


def test_facets_list_the_filter_values(ui_store):
    doc = get(ui_store, "/api/ui/facets").json()
    assert doc == {"tasks": ["task-a", "task-b", "task-v"], "splits": ["train", "val"], "agents": ["coder", "planner"],
                   "versions": [1, 2]}


# --- bad parameters: 400 with a JSON error, never 500 --------------------------------------------

@pytest.mark.parametrize("path, params, names", [
    ("/api/ui/rollouts", {"limit": "0"}, "'limit'"),
    ("/api/ui/rollouts", {"limit": "1001"}, "'limit'"),
    ("/api/ui/rollouts", {"limit": "ten"}, "'limit'"),
    ("/api/ui/rollouts", {"offset": "-1"}, "'offset'"),
    ("/api/ui/rollouts", {"min_reward": "high"}, "'min_reward'"),
    ("/api/ui/rollouts", {"max_reward": "nan"}, "'max_reward'"),
    ("/api/ui/rollouts", {"min_reward": "inf"}, "'min_reward'"),
    ("/api/ui/rollouts", {"version": "1.5"}, "'version'"),
    ("/api/ui/rollouts", {"version": "-1"}, "'version'"),
    ("/api/ui/rollouts", {"since": "yesterday"}, "'since'"),
    ("/api/ui/rollouts", {"until": "2026-13-45"}, "'until'"),
    ("/api/ui/rollouts", {"since": "99999999999999999999"}, "'since'"),
    ("/api/ui/rollouts", {"since": "0001-01-01T00:00:00+01:00"}, "'since'"),
    ("/api/ui/rollouts", {"since": "100000000d"}, "'since'"),
    ("/api/ui/rollouts", {"task": "x" * 201}, "'task'"),
    ("/api/ui/rollouts", {"colour": "red"}, "colour"),
    ("/api/ui/rollouts", {"task": ["a", "b"]}, "'task'"),
    ("/api/ui/facets", {"task": "a"}, "task"),
    ("/api/ui/training", {"run": "no-such-run"}, "no-such-run"),
    ("/api/ui/training", {"steps": "3"}, "steps"),
    ("/api/ui/health", {"x": "1"}, "x"),
    ("/api/ui/rollouts/r-a1", {"x": "1"}, "x"),
])
def test_bad_parameters_are_400_naming_the_parameter(ui_store, path, params, names):
    answer = get(ui_store, path, **params)
    assert answer.status_code == 400, answer.text
    assert answer.headers["Content-Type"] == "application/json"
    assert names in answer.json()["error"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(ui.ROLLOUT_PARAMS), value=st.text(max_size=30))
def test_any_rollouts_parameter_value_is_answered_200_or_400(ui_store, name, value):
    answer = requests.get(ui_store.url("/api/ui/rollouts?") + f"{name}={quote(value)}", timeout=30)
    assert answer.status_code in (200, 400), answer.text
    assert isinstance(answer.json(), dict)


def test_unknown_rollout_and_endpoint_are_404(ui_store):
    answer = get(ui_store, "/api/ui/rollouts/no-such-rollout")
    assert answer.status_code == 404 and "no-such-rollout" in answer.json()["error"]
    assert get(ui_store, "/api/ui/nothing").status_code == 404


# --- one rollout ---------------------------------------------------------------------------------

def test_rollout_has_its_span_tree_calls_rewards_and_transitions(ui_store):
    doc = get(ui_store, "/api/ui/rollouts/r-a1").json()
    assert (doc["rollout_key"], doc["task_id"], doc["final_reward"], doc["num_llm_calls"]) == ("r-a1", "task-a", 1.0, 2)
    spans = {s["name"]: s for s in doc["spans"]}
    assert sorted(spans) == ["agent.run", "chat 0", "chat 1", "lightspan.reward", "tool search"]
    root = spans["agent.run"]
    assert root["is_root"] and root["parent_span_id"] is None
    for name in ("chat 0", "chat 1", "tool search", "lightspan.reward"):
        assert spans[name]["parent_span_id"] == root["span_id"] and not spans[name]["is_root"]
    calls = [spans["chat 0"], spans["chat 1"]]
    assert [c["call_index"] for c in calls] == [0, 1] and spans["tool search"]["call_index"] is None
    assert [c["span_id"] for c in calls] == ui_store.calls["r-a1"]
    # the reward ended after the second call: credit assignment matches it to call 1
    assert [c["matched_reward"] for c in calls] == [0.0, 1.0]
    assert [(c["transition"]["credit"], c["transition"]["advantage"]) for c in calls] == [(1.0, 0.5), (1.0, 0.5)]
    assert calls[0]["completion_token_ids"] == [52, 33, 65]
    assert calls[0]["completion_logprobs"] == [-0.25, -3.0, -0.5]
    assert calls[0]["output_messages"] == [{"role": "assistant", "parts": [TOOL_CALL]}]
    assert calls[0]["input_messages"][0]["parts"][0]["content"] == "<b>question</b> 0"
    assert [r["reward"] for r in doc["rewards"]] == [1.0]
    assert len(doc["transitions"]) == 2 and doc["truncated"] is False


def test_rollout_of_val_split_has_no_transitions(ui_store):
    doc = get(ui_store, "/api/ui/rollouts/r-v1").json()
    assert doc["transitions"] == [] and all(s.get("transition") is None for s in doc["spans"])
    assert [s["matched_reward"] for s in doc["spans"] if s["call_index"] is not None] == [0.0, 0.25]


def test_tokens_are_ids_without_a_tokenizer_and_text_with_the_policys(ui_store, tmp_path):
    doc = get(ui_store, "/api/ui/rollouts/r-a1").json()
    assert doc["tokens_decoded"] is False
    assert all(s.get("completion_tokens") is None for s in doc["spans"])
    from lightspan.models import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    policy = ui_store.data_dir / "policy.json"
    policy.write_text(json.dumps({"version": 1, "path": str(model)}))
    try:
        doc = get(ui_store, "/api/ui/rollouts/r-a1").json()
    finally:
        policy.unlink()
    call = next(s for s in doc["spans"] if s["call_index"] == 0)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert doc["tokens_decoded"] is True
    assert call["completion_tokens"] == [tokenizer.decode([i], skip_special_tokens=False) for i in [52, 33, 65]]
    assert "".join(call["completion_tokens"]) == tokenizer.decode([52, 33, 65], skip_special_tokens=False)


# --- training ------------------------------------------------------------------------------------

def test_training_shows_the_latest_run_and_reward_per_version(ui_store):
    doc = get(ui_store, "/api/ui/training").json()
    assert [r["run_id"] for r in doc["runs"]] == ["run-new", "run-old"] and doc["run_id"] == "run-new"
    new = [s for s in TRAIN_STEPS if s[0] == "run-new"]
    assert [s["step"] for s in doc["steps"]] == [s[1] for s in new]
    assert [s["reward_mean"] for s in doc["steps"]] == [s[2] for s in new]
    assert [s["loss"] for s in doc["steps"]] == [s[3] for s in new]
    assert [s["tokens_per_second"] for s in doc["steps"]] == [s[4] / s[5] for s in new]
    assert [s["sync_seconds"] for s in doc["steps"]] == [s[6] for s in new]
    by = {(r["policy_version"], r["split"]): (r["rollouts"], r["reward_mean"]) for r in doc["reward_by_version"]}
    assert by == {(1, "train"): (2, 0.5), (2, "train"): (1, 0.5), (2, "val"): (1, 0.25)}
    old = get(ui_store, "/api/ui/training", run="run-old").json()
    assert old["run_id"] == "run-old" and [s["loss"] for s in old["steps"]] == [0.9]


# --- collector health ----------------------------------------------------------------------------

def test_health_reports_the_collectors_own_metrics(ui_store):
    doc = get(ui_store, "/api/ui/health").json()
    metrics = parse_prometheus(requests.get(ui_store.url("/metrics"), timeout=10).text)
    assert doc["running"] is True
    assert doc["counters"]["spans_accepted_total"] == metrics["lightspan_collector_spans_accepted_total"][0][1] == 20
    assert set(doc["refused"]) == {labels["reason"] for labels, _ in metrics["lightspan_collector_requests_refused_total"]}
    assert doc["queue_bytes"] == 0 and doc["wal_bytes"] is not None
    assert doc["limits"]["max_queue_bytes"] == ui_store.collector.config.max_queue_bytes


def test_health_ingest_rate_follows_accepted_spans(tmp_path):
    collector = Collector(routes=web.routes(), config=config(tmp_path / "data")).start()
    try:
        url = f"http://127.0.0.1:{collector.api_port}/api/ui/health"
        first = requests.get(url, timeout=10).json()
        assert first["rates"]["spans_per_second"] is None             # one sample: no rate yet
        grpc_exporter(collector).export(make_spans(calls=3))           # 4 spans
        second = requests.get(url, timeout=10).json()
        assert second["counters"]["spans_accepted_total"] == 4
        assert second["rates"]["spans_per_second"] > 0
        requests.post(f"http://127.0.0.1:{collector.api_port}/v1/traces", timeout=10)   # wrong port: 404, not counted
        requests.post(f"http://127.0.0.1:{collector.http_port}/v1/traces", data=b"x",
                      headers={"Content-Type": "text/plain"}, timeout=10)
        third = requests.get(url, timeout=10).json()
        assert third["refused"]["unsupported"] == 1 and third["refused_total"] == 1
    finally:
        collector.stop()


def test_rate_of_a_counter():
    assert health.rate([(0.0, 5.0)], 60) is None
    assert health.rate([(0.0, 0.0), (2.0, 10.0), (4.0, 30.0)], 60) == 7.5
    assert health.rate([(0.0, 0.0), (100.0, 50.0), (102.0, 60.0)], 60) == 5.0     # only the window before the newest
    assert health.rate([(0.0, 100.0), (10.0, 20.0)], 60) == 2.0                   # a reset counts from zero


def test_parse_prometheus_reads_labels_and_skips_comments():
    text = '# HELP x y\n# TYPE x counter\nx_total 3\nr_total{reason="disk",a="b"} 2.5\n'
    assert parse_prometheus(text) == {"x_total": [({}, 3.0)], "r_total": [({"reason": "disk", "a": "b"}, 2.5)]}


@pytest.mark.parametrize("text, expected_s", [
    ("1767225600", 1767225600.0), ("1767225600.5", 1767225600.5), ("2026-01-01T00:00:00Z", 1767225600.0),
    ("2026-01-01T01:00:00+01:00", 1767225600.0), ("2026-01-01", 1767225600.0)])
def test_parse_time(text, expected_s):
    assert ui.parse_time(text, "since", 0) == int(expected_s * 1e9)


def test_parse_time_relative_is_before_now():
    now = time.time_ns()
    assert ui.parse_time("15m", "since", now) == now - 15 * 60 * 10**9


# --- static files and the token ------------------------------------------------------------------

def test_static_pages_are_served_with_a_content_security_policy(ui_store):
    root = requests.get(ui_store.url("/"), allow_redirects=False, timeout=10)
    assert root.status_code == 302 and root.headers["Location"] == "/ui/"
    page = requests.get(ui_store.url("/ui/"), timeout=10)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert '<script type="module" src="app.js"' in page.text
    # a browser runs an ES module only when it is served as JavaScript
    modules = sorted(p.name for p in web.STATIC_DIR.glob("*.js"))
    assert "app.js" in modules and len(modules) > 1
    for name, kind in [*((m, "javascript") for m in modules), ("style.css", "text/css")]:
        answer = requests.get(ui_store.url(f"/ui/{name}"), timeout=10)
        assert answer.status_code == 200 and kind in answer.headers["Content-Type"]
    for path in ("/ui/missing.js", "/ui/..%2F__init__.py", "/ui/%2e%2e/ui.py", "/ui/../web.py"):
        assert requests.get(ui_store.url(path), timeout=10).status_code == 404, path


def test_static_never_leaves_its_folder():
    assert web.static("/ui/../ui.py").status == 404
    assert web.static("/ui/.hidden.js").status == 404
    assert web.static("/ui/index.html").status == 200


def test_with_a_token_the_data_needs_it_and_the_pages_do_not(tmp_path):
    collector = Collector(routes=web.routes(), config=config(tmp_path / "data", auth_token="s3cret")).start()
    try:
        base = f"http://127.0.0.1:{collector.api_port}"
        assert requests.get(f"{base}/ui/", timeout=10).status_code == 200
        assert requests.get(f"{base}/api/ui/rollouts", timeout=10).status_code == 401
        answer = requests.get(f"{base}/api/ui/rollouts", headers={"Authorization": "Bearer s3cret"}, timeout=10)
        assert answer.status_code == 200 and answer.json()["total"] == 0
    finally:
        collector.stop()


def test_query_past_the_time_limit_is_503_not_500(ui_store, monkeypatch):
    def slow(con, filters):   # a query that runs until interrupted
        con.execute("SELECT count(*) FROM range(100000000000) a, range(10) b").fetchall()

    monkeypatch.setattr(ui, "rollouts", slow)
    monkeypatch.setattr(ui_store.collector, "config", config(ui_store.data_dir, sql_timeout_s=0.2))
    answer = get(ui_store, "/api/ui/rollouts")
    assert answer.status_code == 503 and "sql_timeout_s=0.2" in answer.json()["error"]
