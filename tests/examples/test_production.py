"""examples/production: the hosted-model stand-in, the order assistant under ``opentelemetry-instrument``
and the traffic generator, against a real collector (no model: the stand-in answers).

One stack for the module (collector, stand-in, service: real processes on loopback); each test reads
what it sent back from the store.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import requests

from lightspan.runs import free_ports
from tests.conftest import collector_process

starlette = pytest.importorskip("starlette", reason="pip install 'lightspan[production]'")
pytest.importorskip("uvicorn", reason="pip install 'lightspan[production]'")

HERE = Path(__file__).resolve().parents[2] / "examples" / "production"
standin = importlib.import_module("examples.production.hosted_standin")
service = importlib.import_module("examples.production.service")
traffic = importlib.import_module("examples.production.traffic")
UNANSWERABLE = "What does all of it cost?"      # no amounts: the stand-in cannot tell, the service asks again


def _process(args, log: Path, env=None) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(data dir, collector API URL, service URL): the collector, the stand-in and the service traced
    into the collector by configuration alone."""
    from lightspan import inference
    from lightspan.runs import wait_http

    tmp = tmp_path_factory.mktemp("production")
    (tmp / "data").mkdir()
    with ExitStack() as stack, collector_process(tmp / "data", tmp / "collector.log") as (data, ports):
        standin_port, service_port = free_ports(2)
        proc = _process([sys.executable, str(HERE / "hosted_standin.py"), "--port", str(standin_port)],
                        tmp / "standin.log")
        stack.callback(inference.stop, proc)
        wait_http(f"http://127.0.0.1:{standin_port}/v1/models", proc, 30, tmp / "standin.log")
        env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{standin_port}/v1", "OPENAI_API_KEY": "x",
               "AGENT_MODEL": "hosted-model", "OTEL_SERVICE_NAME": "order-assistant",
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{ports['http']}",
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "200",
               "OTEL_RESOURCE_ATTRIBUTES": "lightspan.task.id=order_total", "LIGHTSPAN_CAPTURE_URLS": "none",
               "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "langchain"}
        bin_dir = Path(sys.executable).parent
        proc = _process([str(bin_dir / "opentelemetry-instrument"), sys.executable, str(HERE / "service.py"),
                         "--port", str(service_port)], tmp / "service.log", env)
        stack.callback(inference.stop, proc)
        wait_http(f"http://127.0.0.1:{service_port}/healthz", proc, 60, tmp / "service.log")
        yield data, f"http://127.0.0.1:{ports['api']}", f"http://127.0.0.1:{service_port}"


def _wait_rows(data: Path, api: str, sql: str, expected: int, timeout_s: float = 30) -> list:
    """The rows of ``sql`` once there are ``expected`` of them (spans reach the store when the
    service's exporter sends its batch and the collector writes it)."""
    from lightspan import store

    deadline = time.monotonic() + timeout_s
    while True:
        requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()
        rows = store.connect(data).execute(sql).fetchall()
        if len(rows) >= expected or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


def test_standin_answers_like_a_hosted_model_without_token_ids():
    from starlette.testclient import TestClient

    client = TestClient(standin.make_app(standin.StandinConfig(mistake_share=0.0)))
    question = "How much is a desk lamp for $47 plus a mug for $38?"
    # what lightspan's capture asks a vLLM for: a hosted API ignores it, and so does the stand-in
    r = client.post("/v1/chat/completions", json={"model": "hosted-model", "messages": [
        {"role": "user", "content": question}], "logprobs": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["choices"][0]["message"] == {"role": "assistant", "content": "47 + 38 = 85"}
    assert doc["choices"][0]["logprobs"] is None
    assert "token_ids" not in r.text                       # neither prompt_token_ids nor token_ids
    wrong = TestClient(standin.make_app(standin.StandinConfig(mistake_share=1.0)))
    assert wrong.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": question}]}
                      ).json()["choices"][0]["message"]["content"] == "47 + 38 = 95"
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": UNANSWERABLE}]}
                       ).json()["choices"][0]["message"]["content"] == standin.CANNOT_TELL
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400


def test_service_reads_the_sum_its_working_ends_in():
    assert service.last_number("47 + 38 = 85") == 85
    assert service.last_number("You pay $47 + $38 = $1,085.50.") == 1085.5
    assert service.last_number("I can't tell.") is None


def test_each_request_is_one_rollout_of_its_calls(stack):
    data, api, url = stack
    questions = ["How much is a desk lamp for $47 plus a mug for $38?", UNANSWERABLE,
                 "What's the total for one umbrella ($12) and one yoga mat ($61)?"]
    answers = [requests.post(f"{url}/ask", json={"question": q}, timeout=60).json() for q in questions]
    assert [a["calls"] for a in answers] == [1, 2, 1], answers
    assert answers[1]["total"] is None and answers[2]["total"] in (73, 83)   # 83: the stand-in's mistake
    ids = [a["request_id"] for a in answers]
    rows = _wait_rows(data, api, f"""
        SELECT rollout_key, task_id, prompt_token_ids IS NULL, input_messages FROM llm_calls
        WHERE rollout_key IN ({", ".join(f"'{i}'" for i in ids)})""", 4)
    by_rollout = {}
    for key, task, no_ids, messages in rows:
        by_rollout.setdefault(key, []).append(messages)
        assert task == "order_total" and no_ids     # the task from the resource; a hosted call has no ids
    assert {k: len(v) for k, v in by_rollout.items()} == {ids[0]: 1, ids[1]: 2, ids[2]: 1}
    assert questions[0] in by_rollout[ids[0]][0]    # the messages are captured (the SFT stage needs them)
    assert all(service.REMINDER in m or UNANSWERABLE in m for m in by_rollout[ids[1]])


def test_traffic_posts_late_feedback_for_its_share(stack):
    data, api, url = stack
    cfg = traffic.TrafficConfig(service_url=url, collector_url=api, hours=3, requests_per_hour=8,
                                feedback_share=0.4, feedback_delay_min_h=0.5, feedback_delay_max_h=1.5, seed=3)
    planned = traffic.plan(cfg)
    assert planned == traffic.plan(cfg)                               # the seed alone decides
    assert [v.order for v in traffic.plan(traffic.TrafficConfig(seed=3, feedback_share=0.0, hours=3,
                                                                requests_per_hour=8))] == [v.order for v in planned]
    givers = {v.index for v in planned if v.feedback_at_h is not None}
    assert 0 < len(givers) < len(planned)
    records = []
    hours = traffic.Users(cfg, records.append).run()
    assert [h["requests"] for h in hours] == [8, 8, 8]
    requests_seen, answers = 0, {}
    for record in records:     # in the order things happened
        if record["kind"] == "request":
            requests_seen += 1
            answers[record["index"]] = record
        elif record["kind"] == "feedback":
            visit = planned[record["index"]]
            # late: the simulated clock had passed the answer's time + the delay, and as many requests
            # as that much time holds had been served before it
            assert record["posted_at_h"] >= visit.feedback_at_h >= visit.at_h + cfg.feedback_delay_min_h
            assert requests_seen >= min(len(planned), int(visit.feedback_at_h * cfg.requests_per_hour))
            assert record["value"] == float(answers[record["index"]]["right"])
    posted = {r["index"]: r for r in records if r["kind"] == "feedback"}
    assert set(posted) == givers                                     # the share, and only it
    stored = _wait_rows(data, api, "SELECT rollout_key, reward FROM rewards WHERE source = 'human' "
                                   "AND reward_name = 'feedback'", len(givers))
    assert sorted(stored) == sorted((r["request_id"], r["value"]) for r in posted.values())
    assert {r["value"] for r in posted.values()} <= {0.0, 1.0}
    assert sum(h["right"] for h in hours) == sum(r["right"] for r in answers.values())


def test_bad_config_fails_at_start_naming_the_field_and_the_fix():
    run = subprocess.run([sys.executable, str(HERE / "traffic.py"), "--feedback-share", "1.5"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert "feedback_share" in run.stderr and "between 0 and 1" in run.stderr
    with pytest.raises(ValueError, match="feedback_delay_min_h"):
        traffic.TrafficConfig(feedback_delay_min_h=2.0, feedback_delay_max_h=1.0)
    with pytest.raises(ValueError, match="AGENT_MAX_ATTEMPTS"):
        service.ServiceConfig.from_env({"AGENT_MAX_ATTEMPTS": "0"})
    with pytest.raises(ValueError, match="mistake_share"):
        standin.StandinConfig(mistake_share=-0.1)
    assert json.loads(json.dumps(traffic.TrafficConfig().__dict__))["feedback_share"] == 0.3


def test_summary_over_seeds_gives_mean_and_range_and_skips_what_a_run_lacks(tmp_path):
    summarize = importlib.import_module("examples.production.summarize")

    def run(sft, rl_by_version, bad):
        return {"stages": {"hosted": {"reward": 0.9, "reward_per_hour": [0.8 if sft < 0.7 else 0.9, 0.9]}, "sft": {"reward": sft, "by_version": {"1": {}}},
                           "rl": {"reward": 0.5, "by_version": rl_by_version}},
                "sft": {"val/exact_match_before": 0.4, "val/exact_match_after": 0.6},
                "bad_version": bad, "cost": {"wall_min": 30.0, "cpu_min": 20.0}}

    seeds = []
    for i, summary in enumerate([
            run(0.6, {"1": {"requests": 30, "reward": 0.6}, "2": {"requests": 10, "reward": 0.5},
                      "3": {"requests": 30, "reward": 0.7}},
                {"decision": "rollback", "share_of_traffic": 0.5, "served_by_bad_version": 12}),
            run(0.8, {"1": {"requests": 40, "reward": 0.8}}, None)]):
        (tmp_path / f"seed{i}").mkdir()
        (tmp_path / f"seed{i}" / "summary.json").write_text(json.dumps(summary))
        seeds.append(str(tmp_path / f"seed{i}"))
    assert summarize.main(["--seeds", *seeds, "--out", str(tmp_path / "seeds.json")]) == 0
    result = json.loads((tmp_path / "seeds.json").read_text())
    assert result["reward"]["sft"] == {"mean": 0.7, "min": 0.6, "max": 0.8, "seeds": 2}
    # the RL versions' requests only (v2 and v3 of the first run), weighted by requests; the second run had none
    assert result["rl_trained_versions_reward"] == {"mean": 0.65, "min": 0.65, "max": 0.65, "seeds": 1}
    assert result["bad_version"]["decisions"] == ["rollback", None]
    assert result["reward_per_hour"]["hosted"] == [0.85, 0.9]
    assert result["bad_version"]["share_of_traffic"]["seeds"] == 1
    with pytest.raises(SystemExit):
        summarize.main(["--out", str(tmp_path / "x")])        # one run needs its records and data dir
