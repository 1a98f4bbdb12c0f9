"""The gateway's session reward route, ``POST /rollouts/{id}/reward`` (rollout/rewards.py), against a real
collector: the collector's rules (one value per key, 409 on another, idempotent) and its source."""

from __future__ import annotations

import pytest
import requests

from lightspan.core.config import ConfigError
from lightspan.rollout.gateway import Gateway, GatewayConfig
from lightspan.rollout.paths import reward_route
from lightspan.tracing import semconv
from tests.collector.conftest import collector_factory, data_dir  # noqa: F401 (fixtures)
from tests.collector.helpers import query
from tests.conftest import free_port


@pytest.fixture
def gateway_to(tmp_path):
    started = []

    def make(collector_api_url: str, **overrides) -> Gateway:
        # no generation call is made: the upstream is never reached
        gw = Gateway(GatewayConfig(upstream="http://127.0.0.1:9", port=0, data_dir=str(tmp_path / "gw"),
                                   collector_api_url=collector_api_url, **overrides))
        gw.start()
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()


def test_reward_route_reads_the_rollout_and_task_from_the_prefix():
    assert reward_route("/rollouts/r%201/reward") == {semconv.ROLLOUT_ID: "r 1"}
    assert reward_route("/tasks/t7/rollouts/r1/reward?x=1") == {semconv.TASK_ID: "t7", semconv.ROLLOUT_ID: "r1"}
    assert reward_route("/reward") == {}
    for path in ("/rollouts/r1/v1/reward", "/rollouts/r1/rewards", "/rollouts/reward", "/rollouts/r1/reward/x"):
        assert reward_route(path) is None, path


def test_a_harness_reports_its_reward_next_to_its_base_url(collector_factory, data_dir, gateway_to):
    collector = collector_factory()
    gw = gateway_to(f"http://127.0.0.1:{collector.api_port}")
    url = f"{gw.url}/rollouts/r-1/tasks/t-1/reward"
    first = requests.post(url, json={"value": 0.75}, timeout=10)
    assert first.status_code == 200, first.text
    assert [r["status"] for r in first.json()["rewards"]] == ["stored"]
    again = requests.post(url, json={"value": 0.75}, timeout=10)            # the same value: idempotent
    assert again.status_code == 200 and again.json()["rewards"][0]["status"] == "already_stored"
    other = requests.post(url, json={"value": 1.0}, timeout=10)             # another value for the key: 409
    assert other.status_code == 409, other.text
    assert other.json()["conflicts"][0]["stored_value"] == 0.75
    named = requests.post(url, json={"value": 1, "name": "tests_passed"}, timeout=10)   # another key
    assert named.status_code == 200, named.text
    collector.flush()
    rows = query(data_dir, "SELECT rollout_key, task_id, reward_name, source, reward FROM rewards ORDER BY 3")
    assert rows == [("r-1", "t-1", "reward", "agent", 0.75), ("r-1", "t-1", "tests_passed", "agent", 1.0)]
    assert gw.status()["rewards_posted"] == 3 and gw.status()["rewards_refused"] == 1


def test_bad_reward_requests_are_refused_with_the_field_named(collector_factory, gateway_to):
    collector = collector_factory()
    gw = gateway_to(f"http://127.0.0.1:{collector.api_port}")
    url = f"{gw.url}/rollouts/r-1/reward"
    for body, field in (({}, "value"), ({"value": "1"}, "value"), ({"value": True}, "value"),
                        ({"value": 1, "name": ""}, "name"), ({"value": 1, "rollout_id": "r-2"}, "rollout_id"),
                        ([1], "body")):
        answer = requests.post(url, json=body, timeout=10)
        assert answer.status_code == 400, (body, answer.text)
        assert answer.json()["param"] == field
    assert requests.post(url, data=b'{"value": 1}', headers={"Content-Type": "text/plain"},
                         timeout=10).status_code == 415
    assert requests.post(url, json={"value": 1, "name": "x" * 8000}, timeout=10).status_code == 413
    assert requests.get(url, timeout=10).status_code == 405
    assert requests.post(f"{gw.url}/reward", json={"value": 1}, timeout=10).status_code == 400    # no rollout
    assert requests.post(url, json={"value": 1}, headers={"Origin": "http://attacker.example"},
                         timeout=10).status_code == 403
    assert collector.health().get("rewards_accepted_total", 0) == 0          # nothing reached the store


def test_a_collector_that_cannot_be_reached_is_retryable(gateway_to):
    gw = gateway_to(f"http://127.0.0.1:{free_port()}")
    answer = requests.post(f"{gw.url}/rollouts/r-1/reward", json={"value": 1.0}, timeout=30)
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
    assert "not stored" in answer.json()["error"]


def test_a_collector_with_a_token_needs_the_gateways(collector_factory, data_dir, gateway_to):
    collector = collector_factory(auth_token="ingest-token")
    api = f"http://127.0.0.1:{collector.api_port}"
    refused = requests.post(f"{gateway_to(api).url}/rollouts/r-1/reward", json={"value": 1.0}, timeout=10)
    assert refused.status_code == 502 and "collector_token" in refused.json()["error"]
    ok = requests.post(f"{gateway_to(api, collector_token='ingest-token').url}/rollouts/r-1/reward",
                       json={"value": 1.0}, timeout=10)
    assert ok.status_code == 200, ok.text


def test_config_rejects_a_non_http_collector_url():
    with pytest.raises(ConfigError, match="collector_api_url"):
        GatewayConfig(collector_api_url="localhost:8321")
