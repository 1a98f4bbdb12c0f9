"""The services that run beside agents: the rollout runner (``lightspan rollout``), the
Kubernetes Job per rollout (``lightspan jobs``) and the gateway
(``lightspan gateway``), a capturing proxy in front of vLLM for agents lightspan does not
instrument. They stand on the store's layout and on the agent library's vocabulary
(:mod:`lightspan.tracing.semconv`, the protocol table :mod:`lightspan.tracing.protocols`).
"""
