"""An agent's calls to its policy, for a proxy in front of vLLM (the gateway): two pure functions.

With several policies (lightspan/store/policies.py) an agent reaches its policy by calling the
policy's name as its model. An agent that cannot be told which model to call (it hard-codes one,
or several agents share one base URL) can be routed instead: the proxy knows the caller's agent
(the ``x-lightspan-agent`` header, ``semconv.AGENT_HEADER``) and sends the call to the model of the
policy that owns it (:func:`served_model`). Either way the call's span records the policy and the
version that served it (:func:`served_attributes`), from the model name the call went to and
policy.json (``store.policy.read_all``).

The gateway (rollout/gateway.py) does both for each generation call: the model it sends is
:func:`served_model` of the agent its caller names, and the call's span gets
:func:`served_attributes` of that model and policy.json (read when it changes).
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


def served_attributes(published: Mapping[str, Policy], model: str | None) -> dict:
    """The span attributes of a call served as ``model``: the named policy serving that model name and
    its version (``lightspan.policy.name``, ``lightspan.model.version``); {} for any other model."""
    policy = served_by(published, model)
    if policy is None:
        return {}
    return {semconv.POLICY_NAME: policy.name, semconv.MODEL_VERSION: policy.version}
