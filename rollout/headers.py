"""What a caller's request headers say about its LLM call, as attributes of the call's span.

The gateway sees only HTTP: an agent it serves (any language, no instrumentation) names itself
with the ``x-lightspan-agent`` header (:data:`lightspan.tracing.semconv.AGENT_HEADER`), and the
call's span gets ``gen_ai.agent.name``, so ``--agent-match`` selects its calls as it does an
instrumented framework's. A value that cannot be a name (empty, too long, control characters) is
ignored rather than refused: the call itself is the agent's and must go through.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lightspan.tracing import semconv

MAX_AGENT_NAME = 256     # characters; an agent name is a label, not a payload


def header_attributes(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> dict[str, str]:
    """Span attributes from request ``headers`` (a mapping or (name, value) pairs; names in any
    case, as HTTP allows). The first valid ``x-lightspan-agent`` value wins."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    for name, value in pairs:
        if name.lower() != semconv.AGENT_HEADER:
            continue
        agent = value.strip() if isinstance(value, str) else ""
        if agent and len(agent) <= MAX_AGENT_NAME and agent.isprintable():
            return {semconv.GEN_AI_AGENT_NAME: agent}
    return {}
