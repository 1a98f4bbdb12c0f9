"""Several policies on the agent's side: the runner hands each rollout the served policies'
versions, the instrumentor records the policy and version of each call from the model name it
used, and a proxy can route an agent's calls to its policy (lightspan/rollout/routing.py)."""

from __future__ import annotations

import json

import pytest

from lightspan import store
from lightspan.core.config import ConfigError
from lightspan.rollout import runner
from lightspan.rollout.routing import served_attributes, served_model
from lightspan.store.policies import PolicyConfig, validate
from lightspan.tracing import calls, semconv

POLICIES = validate([PolicyConfig(name="writer", agents=("sql_writer",)),
                     PolicyConfig(name="checker", agent_match="check")])


def _cfg(tmp_path, **kw):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t1"}) + "\n")
    return runner.RolloutConfig(tasks=str(tasks), data_dir=str(tmp_path), **kw)


def test_a_rollout_gets_every_named_policys_version_and_no_single_one(tmp_path):
    cfg = _cfg(tmp_path)
    assert runner.agent_environment(cfg, {"id": "t1"}, "r", 0)["LIGHTSPAN_MODEL_VERSION"] == "0"
    store.policy.write(tmp_path, 3, tmp_path / "w3", name="writer")
    store.policy.write(tmp_path, 1, tmp_path / "c1", name="checker")
    env = runner.agent_environment(cfg, {"id": "t1"}, "r", 0)
    assert env[semconv.POLICY_VERSIONS_ENV] == "checker=1,writer=3"
    # a call to none of them (the base model) records no version rather than a wrong one
    assert "LIGHTSPAN_MODEL_VERSION" not in env


def test_the_instrumentor_reads_the_policy_and_version_from_the_model_name(monkeypatch):
    monkeypatch.setenv(semconv.POLICY_VERSIONS_ENV, "checker=1,writer=3")
    monkeypatch.delenv("LIGHTSPAN_MODEL_VERSION", raising=False)
    assert calls.served_policy("writer") == ("writer", 3)
    assert calls.served_policy("checker") == ("checker", 1)
    assert calls.served_policy("policy-base") == (None, None)
    monkeypatch.setenv(semconv.POLICY_VERSIONS_ENV, "")
    monkeypatch.setenv("LIGHTSPAN_MODEL_VERSION", "7")
    assert calls.served_policy("writer") == (None, 7)      # one policy: the run's version


def test_a_proxy_routes_an_agents_calls_to_the_policy_that_owns_it(tmp_path):
    assert served_model(POLICIES, "sql_writer", "gpt-4o-mini") == "writer"
    assert served_model(POLICIES, "sql_checker", "writer") == "checker"     # ownership decides
    assert served_model(POLICIES, "planner", "gpt-4o-mini") == "gpt-4o-mini"
    assert served_model(POLICIES, None, "policy") == "policy" and served_model((), "sql_writer", "x") == "x"
    store.policy.write(tmp_path, 2, tmp_path / "w2", name="writer")
    published = store.policy.read_all(tmp_path)
    assert served_attributes(published, "writer") == {semconv.POLICY_NAME: "writer", semconv.MODEL_VERSION: 2}
    assert served_attributes(published, "writer-v1") == {semconv.POLICY_NAME: "writer", semconv.MODEL_VERSION: 1}
    assert served_attributes(published, "policy-base") == {}


def test_an_agent_two_patterns_claim_is_a_config_error():
    policies = validate([PolicyConfig(name="a", agent_match="^x"), PolicyConfig(name="b", agent_match="y$")])
    with pytest.raises(ConfigError, match="owned by policies 'a' and 'b'"):
        served_model(policies, "xy", "m")


def test_the_gateway_refuses_a_call_it_cannot_route_and_reaches_no_upstream(tmp_path):
    """Two policies' patterns claim the caller's agent: 400 naming both, before anything is sent (the
    upstream here does not exist: a forwarded call would be a 502)."""
    import requests
    from opentelemetry.sdk.trace import TracerProvider

    from lightspan.rollout.gateway import Gateway, GatewayConfig

    file = tmp_path / "policies.toml"
    file.write_text('[[policies]]\nname = "a"\nagent_match = "^x"\n\n[[policies]]\nname = "b"\nagent_match = "y$"\n')
    gw = Gateway(GatewayConfig(upstream="http://127.0.0.1:9", port=0, data_dir=str(tmp_path), policies=str(file)),
                 TracerProvider())
    url = gw.start()
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        resp = requests.post(f"{url}/v1/chat/completions", json=body, headers={"x-lightspan-agent": "xy"}, timeout=30)
        assert resp.status_code == 400 and "owned by policies 'a' and 'b'" in resp.json()["error"]["message"]
        # an agent one policy owns is routed and forwarded (the missing upstream answers 502)
        resp = requests.post(f"{url}/v1/chat/completions", json=body, headers={"x-lightspan-agent": "xa"}, timeout=30)
        assert resp.status_code == 502
    finally:
        gw.stop()
