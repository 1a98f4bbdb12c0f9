"""An agent's calls to its policy, for a proxy in front of vLLM (the gateway): two pure functions.

With several policies (lightspan/store/policies.py) an agent reaches its policy by calling the
policy's name as its model. An agent that cannot be told which model to call (it hard-codes one,
or several agents share one base URL) can be routed instead: the proxy knows the caller's agent
(the ``x-lightspan-agent`` header, ``semconv.AGENT_HEADER``) and sends the call to the model of the
policy that owns it (:func:`served_model`). Either way the call's span records the policy and the
version that served it (:func:`call_attributes`), from the model name the call went to and
policy.json (``store.policy.read_all``).

Wiring, in the gateway's handler of a generation request (body parsed, before forwarding)::

    agent = headers.get(semconv.AGENT_HEADER)
    body["model"] = served_model(policies, agent, body.get("model"))   # policies: store.policies.load(...)
    span.set_attributes(call_attributes(store.policy.read_all(data_dir), body["model"]))

where the second line replaces the one served version it records today (``_PolicyVersion``) when a
policies file is configured; without one, nothing changes.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightspan.store.policies import PolicyConfig, owner
from lightspan.store.policy import Policy, served_by
from lightspan.tracing import semconv


def served_model(policies: tuple[PolicyConfig, ...], agent: str | None, requested: str | None) -> str | None:
    """The model a call of ``agent`` goes to: the name of the policy that owns the agent (whatever
    model it asked for: ownership decides what the call trains, so it must be served by that policy),
    else ``requested`` unchanged. ConfigError when two policies' patterns claim the agent."""
    if not agent or not policies:
        return requested
    policy = owner(policies, agent)
    return policy.name if policy is not None else requested


def call_attributes(published: Mapping[str, Policy], model: str | None) -> dict:
    """The span attributes of a call served as ``model``: the named policy serving that model name and
    its version (``lightspan.policy.name``, ``lightspan.model.version``); {} for any other model."""
    policy = served_by(published, model)
    if policy is None:
        return {}
    return {semconv.POLICY_NAME: policy.name, semconv.MODEL_VERSION: policy.version}
