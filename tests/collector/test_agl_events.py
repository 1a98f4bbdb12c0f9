"""Agent Lightning's reward events (``POST /v1/rollouts/ID/events``, the ``AGL_EVENT_URL`` that
``lightspan rollout`` gives its agents) are stored as rewards of the rollout in their URL."""

from __future__ import annotations

import pytest
import requests
from opentelemetry.sdk.trace.export import SpanExportResult

from lightspan.collector import api
from tests.collector.helpers import api_url, grpc_exporter, make_spans, query


def test_a_reward_event_is_the_reward_the_rewards_route_takes():
    reward = api.event_reward("r 1", {"event_type": "reward", "data": {"value": 0.5, "message": "solved"}}, 42)
    assert reward == {"rollout_id": "r 1", "value": 0.5, "name": "reward", "id": "event-42", "source": "agent",
                      "comment": "solved"}
    request, recorded = api.reward_request(reward, 42, bytes(32))
    assert recorded[0]["rollout_id"] == "r 1" and recorded[0]["value"] == 0.5 and recorded[0]["source"] == "agent"
    # another event type is not a reward; the events path carries the rollout id, percent-encoded
    assert api.event_reward("r", {"event_type": "note", "data": {"text": "hi"}}, 1) is None
    assert api.event_rollout("/v1/rollouts/t%2F1-abc/events") == "t/1-abc"
    assert api.event_rollout("/v1/rollouts/x/events/more") is None and api.event_rollout("/v1/rewards") is None


@pytest.mark.parametrize("doc, message", [
    ([1], "event is not a JSON object"),
    ({"event_type": "reward", "data": {"value": 1}, "rollout_id": "r"}, "unknown field(s) ['rollout_id']"),
    ({"data": {"value": 1}}, "'event_type' must be a non-empty string"),
    ({"event_type": "reward", "data": [1]}, "'data' must be an object"),
    ({"event_type": "reward", "data": {}}, "'data' has no 'value'"),
])
def test_malformed_events_are_refused_with_a_clear_message(doc, message):
    with pytest.raises(api.BadRequest) as info:
        api.event_reward("r", doc, 0)
    assert message in str(info.value)


def test_reward_events_are_stored_as_the_rollouts_rewards_and_the_last_is_final(collector_factory, data_dir):
    collector = collector_factory()
    assert grpc_exporter(collector).export(make_spans("r1")) == SpanExportResult.SUCCESS   # the agent's spans
    url = api_url(collector, "/v1/rollouts/r1/events")
    headers = {"Authorization": "Bearer lightspan"}   # what Agent Lightning's agents send (AGL_KEY)
    first = requests.post(url, json={"event_type": "reward", "data": {"value": 0.0}}, headers=headers, timeout=5)
    assert first.status_code == 200, first.text
    assert first.json()["accepted"] == 1 and first.json()["rewards"][0]["rollout_id"] == "r1"
    last = requests.post(url, json={"event_type": "reward", "data": {"value": 1.0}}, headers=headers, timeout=5)
    assert last.status_code == 200
    other = requests.post(url, json={"event_type": "custom", "data": {"x": 1}}, timeout=5)
    assert other.status_code == 200 and other.json() == {"accepted": 0, "ignored": "custom"}
    bad = requests.post(url, json={"event_type": "reward", "data": {"value": "high"}}, timeout=5)
    assert bad.status_code == 400 and "'value' must be a number" in bad.json()["error"]
    collector.flush()
    assert query(data_dir, "SELECT rollout_key, reward FROM rewards ORDER BY time_unix_nano") == [
        ("r1", 0.0), ("r1", 1.0)]
    assert query(data_dir, "SELECT final_reward FROM rollouts WHERE rollout_key = 'r1'") == [(1.0,)]
    metrics = collector.metrics.snapshot()
    assert metrics["rewards_accepted_total"] == 2 and metrics["events_ignored_total"] == 1


def test_events_need_the_collectors_token_when_it_has_one(collector_factory):
    collector = collector_factory(auth_token="s3cret")
    url = api_url(collector, "/v1/rollouts/r1/events")
    event = {"event_type": "reward", "data": {"value": 1.0}}
    assert requests.post(url, json=event, headers={"Authorization": "Bearer lightspan"}, timeout=5).status_code == 401
    assert requests.post(url, json=event, headers={"Authorization": "Bearer s3cret"}, timeout=5).status_code == 200
