"""Attacks on the rewards: what an agent under training sends to set or outrank its own reward
(issue 28, section 3). The collector, not the sender, decides a reward's source and its order.

Every test runs the real collector (its OTLP receivers and its API on real ports) and sends what an
agent would: spans through the OpenTelemetry SDK's exporter, or raw OTLP protobuf over HTTP.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time

import pytest
import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightspan import store
from lightspan.collector.config import CollectorConfig
from lightspan.core.config import ConfigError
from lightspan.lightningrl.builder import build_transitions
from lightspan.lightningrl.config import TransitionsConfig
from lightspan.tracing import semconv as sc
from tests.collector.helpers import api_url, grpc_exporter, query, request_bytes, traces_url

SCOPE = "lightspan.collector.rewards"          # the scope the API writes its rewards in
KEY_FILE = "reward-ids.key"                     # the secret that keys a posted reward's ids
YEAR_2262 = int(dt.datetime(2262, 1, 1, tzinfo=dt.timezone.utc).timestamp()) * 10**9
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def agent_rollout(provider: TracerProvider, *, reward: float | None = None, reward_end_ns: int | None = None,
                  reward_attrs: dict | None = None) -> None:
    """One rollout as an instrumented agent records it: a captured chat call, optionally a reward
    span (ending when the agent says), and the runner's outcome span."""
    tracer = provider.get_tracer("agent")
    with tracer.start_as_current_span("agent.run"):
        with tracer.start_as_current_span("chat") as span:
            span.set_attribute(sc.GEN_AI_OPERATION_NAME, "chat")
            span.set_attribute(sc.PROMPT_TOKEN_IDS, sc.encode_ids([1, 2, 3]))
            span.set_attribute(sc.COMPLETION_TOKEN_IDS, [sc.encode_ids([4, 5])])
            span.set_attribute(sc.COMPLETION_LOGPROBS, [sc.encode_floats([-0.5, -0.25])])
        if reward is not None:
            span = tracer.start_span(sc.SPAN_REWARD)
            span.set_attribute(sc.REWARD, reward)
            for key, value in (reward_attrs or {}).items():
                span.set_attribute(key, value)
            span.end(end_time=reward_end_ns)
    with tracer.start_as_current_span(sc.SPAN_RUNNER) as span:
        span.set_attribute(sc.ROLLOUT_OUTCOME, "ok")


def provider_for(rollout: str, exporter) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": "agent", sc.ROLLOUT_ID: rollout,
                                                        sc.TASK_ID: "task-1", sc.SPLIT: "train"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def recorded_spans(rollout: str, **kwargs):
    """The spans of :func:`agent_rollout`, as the SDK hands them to an exporter."""
    memory = InMemorySpanExporter()
    provider = provider_for(rollout, memory)
    agent_rollout(provider, **kwargs)
    provider.shutdown()
    return memory.get_finished_spans()


def post_reward(collector, **reward) -> requests.Response:
    return requests.post(api_url(collector, "/v1/rewards"), json=reward, timeout=10)


def post_otlp(collector, payload: bytes) -> ExportTraceServiceResponse:
    answer = requests.post(traces_url(collector), data=payload, headers=PROTOBUF, timeout=10)
    assert answer.status_code == 200, answer.text
    return ExportTraceServiceResponse.FromString(answer.content)


def public_reward_ids(rollout_id: str, name: str = "reward", key: str | None = None) -> tuple[bytes, bytes]:
    """The ids today's main gives a posted reward: a hash anyone can compute."""
    digest = hashlib.sha256("\x00".join(["lightspan.reward", rollout_id, name, key or ""]).encode()).digest()
    return digest[:16], digest[16:24]


def forged_reward(rollout_id: str, scope: str, value: float = 1.0) -> bytes:
    """An OTLP request with one reward span that looks like a person's reward posted to the API."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = "agent"
    spans = rs.scope_spans.add()
    spans.scope.name = scope
    trace_id, span_id = public_reward_ids(rollout_id)
    now = time.time_ns()
    span = spans.spans.add(trace_id=trace_id, span_id=span_id, name=sc.SPAN_REWARD, kind=1,
                           start_time_unix_nano=now, end_time_unix_nano=now)
    for key, text in ((sc.ROLLOUT_ID, rollout_id), (sc.REWARD_NAME, "reward"), (sc.REWARD_SOURCE, "human")):
        span.attributes.add(key=key).value.string_value = text
    span.attributes.add(key=sc.REWARD).value.double_value = value
    return request.SerializeToString()


def build(data_dir) -> dict:
    """The transition builder's rewards per rollout: {rollout: reward}."""
    con = store.connect(data_dir)
    try:
        table, _ = build_transitions(con, TransitionsConfig(data_dir=str(data_dir), grace_s=0.0),
                                     now_unix_nano=time.time_ns())
    finally:
        con.close()
    return {row["rollout_id"]: row["reward"] for row in table.to_pylist()}


# --- the order of rewards ---------------------------------------------------------------------------

def test_a_reward_dated_2262_does_not_outrank_a_later_human_score(collector_factory, data_dir):
    collector = collector_factory()
    for rollout, reward, end in (("r-forger", 1.0, YEAR_2262), ("r-honest", 0.5, None)):
        provider = provider_for(rollout, grpc_exporter(collector))
        agent_rollout(provider, reward=reward, reward_end_ns=end)
        provider.shutdown()
    collector.flush()
    # later, a person scores the forger's rollout 0.0 in the web UI
    assert post_reward(collector, rollout_id="r-forger", value=0.0, source="human").status_code == 200
    collector.flush()
    finals = dict(query(data_dir, "SELECT rollout_key, final_reward FROM rollouts ORDER BY 1"))
    assert finals == {"r-forger": 0.0, "r-honest": 0.5}
    drift = query(data_dir, "SELECT source, reward_mean FROM reward_drift ORDER BY source")
    assert drift == [("agent", 0.75), ("human", 0.0)]
    # the builder trains on what the views show: the person's score
    assert build(data_dir) == {"r-forger": 0.0, "r-honest": 0.5}


# --- who gave a reward --------------------------------------------------------------------------------

def test_an_otlp_span_in_the_api_scope_cannot_take_a_persons_reward(collector_factory, data_dir):
    collector = collector_factory()
    provider = provider_for("r-1", grpc_exporter(collector))
    agent_rollout(provider)
    provider.shutdown()
    # the agent sends first what the person's reward would be: the API's scope and ids, "human", 1.0
    forged = post_otlp(collector, forged_reward("r-1", SCOPE))
    collector.flush()
    human = post_reward(collector, rollout_id="r-1", value=0.0, source="human")
    assert human.status_code == 200, human.text                             # main: 409, "already stored"
    collector.flush()
    assert query(data_dir, "SELECT reward, source FROM rewards") == [(0.0, "human")]
    assert query(data_dir, "SELECT final_reward FROM rollouts") == [(0.0,)]
    # refused, counted and said so; the agent's other spans are stored
    assert forged.partial_success.rejected_spans == 1 and SCOPE in forged.partial_success.error_message
    assert collector.health()["reward_forgeries_total"] == 1
    assert query(data_dir, "SELECT count(*) FROM spans WHERE rollout_id = 'r-1' AND reward IS NULL") == [(3,)]


def test_a_posted_rewards_ids_cannot_be_predicted_and_taken_first(collector_factory, data_dir):
    collector = collector_factory()
    # the ids main's public hash gives the person's reward, taken by an agent span of its own scope
    assert post_otlp(collector, forged_reward("r-1", "agent.rewards")).partial_success.rejected_spans == 0
    collector.flush()
    human = post_reward(collector, rollout_id="r-1", value=0.0, source="human")
    assert human.status_code == 200, human.text
    posted = human.json()["rewards"][0]
    collector.flush()
    rewards = query(data_dir, "SELECT reward, source FROM rewards ORDER BY reward DESC")
    assert rewards == [(1.0, "agent"), (0.0, "human")]        # main: the person's score dropped as a copy
    assert (bytes.fromhex(posted["trace_id"]), bytes.fromhex(posted["span_id"])) != public_reward_ids("r-1")
    again = post_reward(collector, rollout_id="r-1", value=0.0, source="human")     # idempotent still
    assert again.status_code == 200 and again.json()["rewards"][0]["status"] == "already_stored"
    assert again.json()["rewards"][0]["span_id"] == posted["span_id"]
    # the secret that keys the ids stays out of the SQL endpoint's reach
    assert (data_dir / KEY_FILE).is_file()
    read = requests.post(api_url(collector, "/v1/sql"), json={"sql": f"SELECT * FROM read_text('{data_dir / KEY_FILE}')"},
                         timeout=10)
    assert read.status_code == 400, read.text


def test_a_source_claimed_on_an_agent_span_is_not_a_person_or_a_judge(collector_factory, data_dir):
    collector = collector_factory()
    spans = recorded_spans("r-1", reward=1.0, reward_attrs={sc.REWARD_SOURCE: "human", sc.REWARD_COMMENT: "great"})
    answer = post_otlp(collector, request_bytes(spans))
    assert answer.partial_success.rejected_spans == 0                       # nothing the agent sent is lost
    assert sc.REWARD_SOURCE in answer.partial_success.error_message          # but it is told
    judged = post_reward(collector, rollout_id="r-1", value=0.25, name="judge", source="judge", judge_model="m")
    assert judged.status_code == 200
    collector.flush()
    assert query(data_dir, "SELECT reward, source FROM rewards ORDER BY reward") == [(0.25, "judge"), (1.0, "agent")]
    assert query(data_dir, "SELECT count(*) FROM rewards WHERE source = 'human'") == [(0,)]
    assert query(data_dir, "SELECT * FROM reward_agreement") == []          # no person scored it
    attrs = query(data_dir, "SELECT attributes FROM spans WHERE name = 'lightspan.reward' AND scope_name = 'agent'")
    assert {k: json.loads(v) for k, v in attrs[0][0].items()}[sc.REWARD_CLAIMED_SOURCE] == "human"
    assert collector.health()["reward_claims_total"] == 1


def test_the_sdk_exporter_of_an_agent_that_claims_a_source_still_succeeds(collector_factory, data_dir):
    collector = collector_factory()
    exported = grpc_exporter(collector).export(recorded_spans("r-2", reward=1.0, reward_attrs={sc.REWARD_SOURCE: "api"}))
    assert exported == SpanExportResult.SUCCESS
    collector.flush()
    assert query(data_dir, "SELECT source FROM rewards") == [("agent",)]


# --- a posted reward's source is the credential's, not the sender's word ------------------------------

def test_an_agent_holding_the_ingest_token_cannot_post_a_persons_or_the_judges_score(collector_factory, data_dir):
    """An agent knows the collector's API (lightspan rollout gives it AGL_EVENT_URL) and the ingest
    token its exporter sends. With ``reward_token`` set, a reward it posts as a person, the judge or
    a tool is refused and nothing of it is stored; its own score (source agent) is taken; the web UI
    and the judge, which carry the reward token, post any source and read the API with it."""
    collector = collector_factory(auth_token="ingest-token", reward_token="reward-token")
    url = api_url(collector, "/v1/rewards")
    agent = {"Authorization": "Bearer ingest-token"}
    for source in ("human", "judge", "api", None):       # no source is the API's default, "api"
        reward = {"rollout_id": "r-1", "value": 1.0, "name": f"score-{source}"}
        answer = requests.post(url, json=reward if source is None else {**reward, "source": source},
                               headers=agent, timeout=10)
        assert answer.status_code == 403, answer.text
        assert "reward_token" in answer.json()["error"]
    # a list that hides one person's score among the agent's own is refused whole
    mixed = [{"rollout_id": "r-1", "value": 0.5, "source": "agent"}, {"rollout_id": "r-1", "value": 1.0,
                                                                       "name": "h", "source": "human"}]
    assert requests.post(url, json=mixed, headers=agent, timeout=10).status_code == 403
    assert collector.health()["reward_source_refusals_total"] == 5
    own = requests.post(url, json={"rollout_id": "r-1", "value": 0.25, "source": "agent"}, headers=agent, timeout=10)
    assert own.status_code == 200, own.text
    person = {"Authorization": "Bearer reward-token"}
    human = requests.post(url, json={"rollout_id": "r-1", "value": 0.0, "name": "ui", "source": "human"},
                          headers=person, timeout=10)
    assert human.status_code == 200, human.text
    sql = requests.get(api_url(collector, "/v1/sql"), params={"q": "SELECT 1"}, headers=person, timeout=10)
    assert sql.status_code == 200, sql.text                      # the UI reads with the same token
    assert requests.post(url, json={"rollout_id": "r-1", "value": 1.0, "source": "human"},
                         timeout=10).status_code == 401          # and no token is still no entry
    collector.flush()
    assert sorted(query(data_dir, "SELECT source, reward FROM rewards")) == [("agent", 0.25), ("human", 0.0)]


def test_a_reward_token_equal_to_the_ingest_token_refuses_to_start(tmp_path):
    with pytest.raises(ConfigError, match="reward_token"):
        CollectorConfig(data_dir=str(tmp_path), auth_token="same", reward_token="same")
