"""The gateway's pure pieces: which upstream paths it serves, and how calls become span content.

:data:`ENDPOINTS` is the table from an upstream path (vLLM's, under ``/v1``) to what the gateway
does with it: capture it as a generation call of an operation (``chat``, ``text_completion``), or
pass it through untouched and untraced. A path that is not in the table is answered 404 and never
reaches vLLM: vLLM's unauthenticated routes (``/pause``, ``/collective_rpc``, ``/sleep``,
``/v1/load_lora_adapter``, …) are not in it, and a path with dot segments (``/v1/../sleep``, which
an HTTP client would normalise into ``/sleep``) is refused before the table is read. To capture a
further protocol, add its path here with its operation, and its conversions to
:func:`input_messages` and :class:`OutputTexts`.

:func:`route` reads the rollout, task and split from a URL prefix (``/rollouts/{id}/tasks/{id}/
splits/{split}/v1/...``, in any order); :func:`call_attributes` lets headers win over it.
Everything here is a function of its arguments: no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from lightspan.tracing import semconv
from lightspan.tracing.capture import CHAT, TEXT_COMPLETION

HEADER_ROLLOUT_ID = "x-lightspan-rollout-id"
HEADER_TASK_ID = "x-lightspan-task-id"
HEADER_SPLIT = "x-lightspan-split"
_PREFIX = re.compile(r"^((?:/(?:rollouts|tasks|splits)/[^/]+)*)(/v1(?:/.*)?)$")
_PREFIX_KEYS = {"rollouts": semconv.ROLLOUT_ID, "tasks": semconv.TASK_ID, "splits": semconv.SPLIT}
_HEADER_KEYS = {HEADER_ROLLOUT_ID: semconv.ROLLOUT_ID, HEADER_TASK_ID: semconv.TASK_ID, HEADER_SPLIT: semconv.SPLIT}
dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


@dataclass(frozen=True)
class Endpoint:
    methods: tuple[str, ...]
    operation: str | None = None      # captured as this GenAI operation; None: passed through


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint(("POST",), CHAT),
    "/v1/completions": Endpoint(("POST",), TEXT_COMPLETION),
    "/v1/models": Endpoint(("GET",)),
    "/v1/embeddings": Endpoint(("POST",)),
    # passed through, not captured yet: their spans come from the instrumentor
    "/v1/responses": Endpoint(("POST",)),
    "/v1/messages": Endpoint(("POST",)),
}


def unsafe(raw_path: str) -> str | None:
    """Why a request path may not be routed (dot segments, backslashes), or None."""
    if "\\" in raw_path or "%5c" in raw_path.lower():
        return "backslashes are not allowed in the path"
    if any(unquote(segment) in (".", "..") for segment in raw_path.split("/")):
        return "dot segments ('.' and '..') are not allowed in the path"
    return None


def route(path: str) -> tuple[dict[str, str], str] | None:
    """(rollout/task/split attributes from the URL prefix, upstream path and query), or None if
    the path is not under ``/v1`` (``path`` is the request target as sent, percent-encoded)."""
    parts = urlsplit(path)
    m = _PREFIX.match(parts.path)
    if m is None:
        return None
    attrs, segments = {}, m.group(1).strip("/").split("/") if m.group(1) else []
    for key, value in zip(segments[::2], segments[1::2]):
        attrs[_PREFIX_KEYS[key]] = unquote(value)
    return attrs, m.group(2) + (f"?{parts.query}" if parts.query else "")


def endpoint(upstream: str) -> Endpoint | None:
    """The table entry of an upstream path (its query string ignored), or None."""
    return ENDPOINTS.get(upstream.split("?", 1)[0])


def call_attributes(path_attrs: dict[str, str], headers) -> dict[str, str]:
    """Rollout, task and split of a call: headers first, then the URL prefix."""
    attrs = dict(path_attrs)
    for header, key in _HEADER_KEYS.items():
        value = headers.get(header)
        if value:
            attrs[key] = value
    return attrs


# --- span content --------------------------------------------------------------------------------
# The request body is the caller's: any JSON object. What vLLM will refuse (a malformed `messages`)
# it answers itself; the conversions below only must not fail on it.

def _text_part(content) -> dict:
    return {"type": "text", "content": content}


def _chat_parts(message: dict) -> list:
    content = message.get("content")
    if isinstance(content, list):   # OpenAI content parts: text stays text, anything else as it came
        parts = [_text_part(p.get("text")) if isinstance(p, dict) and p.get("type") == "text" else p
                 for p in content]
    elif content is None:
        parts = []
    else:
        parts = [_text_part(content)]
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        if isinstance(call, dict):
            fn = call.get("function") if isinstance(call.get("function"), dict) else {}
            parts.append({"type": "tool_call", "id": call.get("id"), "name": fn.get("name"),
                          "arguments": fn.get("arguments")})
    return parts


def input_messages(body: dict, op: str) -> str:
    """``gen_ai.input.messages`` (GenAI semantic conventions: role + parts) of a request."""
    if op != CHAT:
        return dumps([{"role": "user", "parts": [_text_part(body.get("prompt"))]}])
    messages = body.get("messages")
    out = []
    for m in messages if isinstance(messages, list) else [messages] if messages is not None else []:
        if isinstance(m, dict):
            out.append({"role": m.get("role"), "parts": _chat_parts(m)})
        else:
            out.append({"role": None, "parts": [_text_part(m)]})
    return dumps(out)


class OutputTexts:
    """Completion text per choice, from a response or stream chunks (for gen_ai.output.messages)."""

    def __init__(self, op: str):
        self.op, self.texts, self.reasons = op, {}, {}

    def add(self, payload: dict) -> None:
        choices = payload.get("choices") if isinstance(payload, dict) else None
        for c in choices if isinstance(choices, list) else ():
            if not isinstance(c, dict):
                continue
            i = c.get("index") if isinstance(c.get("index"), int) else 0
            if self.op == CHAT:
                msg = c.get("message") or c.get("delta") or {}
                text = msg.get("content") if isinstance(msg, dict) else None
            else:
                text = c.get("text")
            if isinstance(text, str) and text:
                self.texts[i] = self.texts.get(i, "") + text
            if isinstance(c.get("finish_reason"), str):
                self.reasons[i] = c["finish_reason"]

    def messages(self) -> str:
        return dumps([{"role": "assistant", "parts": [_text_part(self.texts.get(i, ""))],
                       "finish_reason": self.reasons.get(i)}
                      for i in sorted(set(self.texts) | set(self.reasons))])
