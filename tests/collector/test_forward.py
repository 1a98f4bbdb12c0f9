"""[collector.forward]: a collector forwards what it acknowledges to a second real collector (its
OTLP/HTTP port), lightspan's own rewards as gen_ai.evaluation.result events; with the target down it
keeps acknowledging, retries with backoff, and counts what its bounded queue drops."""

from __future__ import annotations

import json

import pytest
import requests

from lightspan.core.config import ConfigError
from lightspan.collector.config import CollectorConfig
from lightspan.tracing import semconv as sc
from tests.collector.helpers import make_spans, query, request_bytes, traces_url, wait_for
from tests.collector.test_evaluations import EVENT, agent_run, evaluate, http_logs
from tests.conftest import free_port


def forwarding(port: int, **extra) -> dict:
    return {"endpoint": f"http://127.0.0.1:{port}", "backoff_s": 0.05, "backoff_max_s": 0.2, **extra}


def test_forwarded_to_a_second_collector(collector_factory, data_dir, tmp_path):
    target_dir = tmp_path / "target"
    target = collector_factory(data_dir=target_dir)
    source = collector_factory(forward=forwarding(target.http_port))
    ids = agent_run(source, "r-fwd")
    evaluate(http_logs(source), [({"trace": ids["trace"], "span": ids["chat"]},
                                  {sc.GEN_AI_EVALUATION_NAME: "Relevance", sc.GEN_AI_EVALUATION_SCORE_VALUE: 0.5})])
    source.flush()                                   # the scored call is stored: the human's event is parented to it
    posted = requests.post(f"http://127.0.0.1:{source.api_port}/v1/rewards", timeout=5, json={
        "rollout_id": "r-fwd", "value": 1.0, "name": "human", "source": "human", "comment": "good",
        "span_id": ids["chat"]})
    assert posted.status_code == 200
    wait_for(lambda: source.metrics.snapshot()["forward_sent_total"] == 4, what="4 requests forwarded")
    target.flush()
    # the agent's spans, as they were sent; no span of the source's reward scope (the target's own
    # reward spans are those it made of the events below)
    assert query(target_dir, "SELECT name FROM spans WHERE scope_name IS DISTINCT FROM 'lightspan.collector.rewards' "
                             "ORDER BY name") == [("chat policy",), ("invoke_agent solver",)]
    # the evaluator's own event, and the person's score as an evaluation event on the call it scores
    events = query(target_dir, f"""SELECT trace_id, span_id, attributes FROM logs WHERE event_name = '{EVENT}'
                                  ORDER BY received_unix_nano""")
    assert [(t, s) for t, s, _ in events] == [(ids["trace"], ids["chat"])] * 2
    human = {k: json.loads(v) for k, v in events[1][2].items()}
    assert human[sc.GEN_AI_EVALUATION_NAME] == "human" and human[sc.GEN_AI_EVALUATION_SCORE_VALUE] == 1.0
    assert human[sc.GEN_AI_EVALUATION_EXPLANATION] == "good"
    # which the target, a lightspan collector, takes for a reward (never a person's: the sender says so)
    assert query(target_dir, "SELECT reward_name, source FROM rewards ORDER BY 1") == [
        ("Relevance", "phoenix-evals"), ("human", "agent")]
    assert source.metrics.snapshot()["forward_dropped_total"] == 0


def test_a_target_down_never_holds_up_ingest(collector_factory, data_dir, tmp_path):
    port = free_port()
    payload = request_bytes(make_spans("r-down", calls=1))
    source = collector_factory(forward=forwarding(port, queue_bytes=len(payload) + 10))
    for _ in range(3):                              # acknowledged at once; the queue holds one request
        answer = requests.post(traces_url(source), data=payload, timeout=5,
                               headers={"Content-Type": "application/x-protobuf"})
        assert answer.status_code == 200
    snapshot = source.metrics.snapshot()
    assert snapshot["forward_dropped_total"] >= 1 and snapshot["spans_accepted_total"] == 6
    wait_for(lambda: source.metrics.snapshot()["forward_retries_total"] >= 2, what="retries")
    target_dir = tmp_path / "target"
    target = collector_factory(data_dir=target_dir, http_port=port)    # the target comes up: the retry lands
    wait_for(lambda: source.metrics.snapshot()["forward_sent_total"] >= 1, what="the queued request delivered")
    target.flush()
    assert query(target_dir, "SELECT rollout_id, count(*) FROM spans GROUP BY 1") == [("r-down", 2)]


def test_forward_config():
    cfg = CollectorConfig(forward={"endpoint": "http://h:4318", "headers": {"authorization": "Bearer x"}})
    assert cfg.forward["endpoint"] == "http://h:4318"
    with pytest.raises(ConfigError, match="collector.forward.endpoint"):
        CollectorConfig(forward={"endpoint": "h:4318"})
    with pytest.raises(ConfigError, match="collector.forward.queue"):
        CollectorConfig(forward={"endpoint": "http://h:4318", "queue": 1})
