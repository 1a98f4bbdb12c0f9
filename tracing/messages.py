"""A call's messages in the OpenTelemetry GenAI shape, for the spans lightspan opens itself.

``gen_ai.input.messages`` / ``gen_ai.output.messages`` are JSON lists of
``{"role", "parts": [...]}`` (output messages add ``finish_reason``), whatever the protocol:

- ``{"type": "text", "content": …}``, ``{"type": "reasoning", "content": …}``;
- ``{"type": "tool_call", "id", "name", "arguments"}``: a chat ``tool_calls`` entry, a Responses
  ``function_call`` item, an Anthropic ``tool_use`` block (arguments decoded when they are JSON);
- ``{"type": "tool_call_response", "id", "response"}``, in a ``tool`` message: a chat ``tool``
  message, a Responses ``function_call_output`` item, an Anthropic ``tool_result`` block;
- anything else as ``{"type": <its type>, "content": <the item>}``.

Each protocol module converts its own requests and answers into this shape (``inputs`` and
``outputs`` of its row, :mod:`lightspan.tracing.protocols`) with the helpers here. The web UI's
rollout view shows these parts (dashboards/static/app.js).
"""

from __future__ import annotations

import json

import orjson


def _arguments(value):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _text_of(content) -> str:
    """The text of a content list (chat parts, Responses parts, Anthropic blocks) or a string."""
    if isinstance(content, str):
        return content
    texts = []
    for part in content or ():
        if isinstance(part, dict):
            text = part.get("text")
            if isinstance(text, str):
                texts.append(text)
    return "\n".join(texts)


def _append(messages: list, role: str, parts: list) -> None:
    """Add parts to the conversation, in the previous message when it has the same role."""
    if not parts:
        return
    if messages and messages[-1]["role"] == role and role != "tool":
        messages[-1]["parts"].extend(parts)
    else:
        messages.append({"role": role, "parts": parts})


def dumps(messages: list) -> str:
    """The attribute's JSON text (orjson: several times ``json``'s speed on a long prompt)."""
    return orjson.dumps(messages, default=str).decode()
