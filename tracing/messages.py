"""A call's messages in the OpenTelemetry GenAI shape, for the spans lightspan opens itself.

``gen_ai.input.messages`` / ``gen_ai.output.messages`` are JSON lists of
``{"role", "parts": [...]}`` (output messages add ``finish_reason``), whatever the protocol:

- ``{"type": "text", "content": …}``, ``{"type": "reasoning", "content": …}``;
- ``{"type": "tool_call", "id", "name", "arguments"}``: a chat ``tool_calls`` entry, a Responses
  ``function_call`` item, an Anthropic ``tool_use`` block (arguments decoded when they are JSON);
- ``{"type": "tool_call_response", "id", "response"}``, in a ``tool`` message: a chat ``tool``
  message, a Responses ``function_call_output`` item, an Anthropic ``tool_result`` block;
- anything else as ``{"type": <its type>, "content": <the item>}``.

The web UI's rollout view shows these parts (dashboards/static/app.js). Pure functions over the
request bodies and response dicts.
"""

from __future__ import annotations

import json

import orjson

from lightspan.tracing.capture import _get


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


# --- chat completions ---------------------------------------------------------------------------

def chat_input(body: dict) -> list:
    messages: list = []
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        role = m.get("role") or "user"
        if role == "tool":
            messages.append({"role": "tool", "parts": [
                {"type": "tool_call_response", "id": m.get("tool_call_id"), "response": _text_of(m.get("content"))}]})
            continue
        parts = []
        text = _text_of(m.get("content"))
        if text:
            parts.append({"type": "text", "content": text})
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            parts.append({"type": "tool_call", "id": call.get("id"), "name": fn.get("name"),
                          "arguments": _arguments(fn.get("arguments"))})
        messages.append({"role": role, "parts": parts})
    prompt = body.get("prompt")
    if prompt is not None and not messages:   # completions
        messages.append({"role": "user", "parts": [{"type": "text", "content": prompt if isinstance(prompt, str)
                                                    else json.dumps(prompt)}]})
    return messages


class ChatOutput:
    """The assistant turn of a chat completion or of its stream chunks (choice 0), in order."""

    __slots__ = ("text", "reasoning", "calls", "finish_reason")

    def __init__(self):
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict] = {}
        self.finish_reason: str | None = None

    def add(self, payload) -> None:
        for choice in (payload.get("choices") if type(payload) is dict else _get(payload, "choices")) or ():
            if type(choice) is dict:
                self._add_json(choice)
            else:
                self._add(choice)

    def _add_json(self, choice: dict) -> None:
        """:meth:`_add` with plain dict lookups (it runs per stream chunk)."""
        if (choice.get("index") or 0) != 0:
            return
        part = choice.get("message") or choice.get("delta")
        if type(part) is not dict:
            self._add(choice)
            return
        content = part.get("content")
        if content:
            self.text.append(content)
        reasoning = part.get("reasoning")
        if reasoning:
            self.reasoning.append(reasoning)
        for call in part.get("tool_calls") or ():
            self._call(call)
        reason = choice.get("finish_reason")
        if reason:
            self.finish_reason = reason

    def _add(self, choice) -> None:
        if (_get(choice, "index") or 0) != 0:
            return
        part = _get(choice, "message") or _get(choice, "delta")
        if part is None:
            text = _get(choice, "text")   # completions
            if text:
                self.text.append(text)
        else:
            if _get(part, "content"):
                self.text.append(_get(part, "content"))
            if _get(part, "reasoning"):
                self.reasoning.append(_get(part, "reasoning"))
            for call in _get(part, "tool_calls") or ():
                self._call(call)
        if _get(choice, "finish_reason"):
            self.finish_reason = _get(choice, "finish_reason")

    def _call(self, call) -> None:
        index = _get(call, "index") or 0
        entry = self.calls.setdefault(index, {"id": None, "name": None, "arguments": []})
        fn = _get(call, "function")
        if _get(call, "id"):
            entry["id"] = _get(call, "id")
        if fn is not None:
            if _get(fn, "name"):
                entry["name"] = _get(fn, "name")
            if _get(fn, "arguments"):
                entry["arguments"].append(_get(fn, "arguments"))

    def messages(self, finish_reason: str | None = None) -> list:
        parts = []
        if self.reasoning:
            parts.append({"type": "reasoning", "content": "".join(self.reasoning)})
        if self.text:
            parts.append({"type": "text", "content": "".join(self.text)})
        for _, call in sorted(self.calls.items()):
            parts.append({"type": "tool_call", "id": call["id"], "name": call["name"],
                          "arguments": _arguments("".join(call["arguments"]))})
        return [{"role": "assistant", "parts": parts, "finish_reason": finish_reason or self.finish_reason}]


# --- Responses ------------------------------------------------------------------------------------

def _responses_item(item, messages: list) -> None:
    kind = _get(item, "type") or ("message" if _get(item, "role") else None)
    if kind == "message":
        content = _get(item, "content")
        text = content if isinstance(content, str) else "\n".join(
            _get(p, "text") for p in content or () if isinstance(_get(p, "text"), str))
        _append(messages, _get(item, "role") or "user", [{"type": "text", "content": text}] if text else [])
    elif kind == "function_call":
        _append(messages, "assistant", [{"type": "tool_call", "id": _get(item, "call_id"), "name": _get(item, "name"),
                                         "arguments": _arguments(_get(item, "arguments"))}])
    elif kind == "function_call_output":
        output = _get(item, "output")
        messages.append({"role": "tool", "parts": [{"type": "tool_call_response", "id": _get(item, "call_id"),
                                                     "response": output if isinstance(output, str) else _text_of(output)}]})
    elif kind == "reasoning":
        texts = [_get(p, "text") for key in ("summary", "content") for p in _get(item, key) or ()]
        _append(messages, "assistant", [{"type": "reasoning", "content": "\n".join(t for t in texts if t)}])
    else:
        plain = item if isinstance(item, dict) else getattr(item, "model_dump", lambda: str(item))()
        _append(messages, "assistant" if kind and kind.endswith("_call") else "user",
                [{"type": str(kind), "content": plain}])


def responses_input(body: dict) -> list:
    messages: list = []
    if body.get("instructions"):
        messages.append({"role": "system", "parts": [{"type": "text", "content": body["instructions"]}]})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "parts": [{"type": "text", "content": given}]})
    else:
        for item in given or ():
            _responses_item(item, messages)
    return messages


def responses_output(response, finish_reason: str | None) -> list:
    messages: list = []
    for item in _get(response, "output") or ():
        _responses_item(item, messages)
    if not messages:
        messages.append({"role": "assistant", "parts": []})
    messages[-1]["finish_reason"] = finish_reason
    return messages


# --- Anthropic Messages ------------------------------------------------------------------------

def anthropic_input(body: dict) -> list:
    messages: list = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "parts": [{"type": "text", "content": _text_of(system)}]})
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        role, content = m.get("role") or "user", m.get("content")
        if isinstance(content, str):
            _append(messages, role, [{"type": "text", "content": content}])
            continue
        for block in content or ():
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "text":
                _append(messages, role, [{"type": "text", "content": block.get("text") or ""}])
            elif kind == "tool_use":
                _append(messages, role, [{"type": "tool_call", "id": block.get("id"), "name": block.get("name"),
                                          "arguments": block.get("input")}])
            elif kind == "tool_result":
                messages.append({"role": "tool", "parts": [{"type": "tool_call_response", "id": block.get("tool_use_id"),
                                                             "response": _text_of(block.get("content"))}]})
            elif kind == "thinking":
                _append(messages, role, [{"type": "reasoning", "content": block.get("thinking") or ""}])
            else:
                _append(messages, role, [{"type": str(kind), "content": {k: v for k, v in block.items()
                                                                          if k != "source"}}])
    return messages


def anthropic_stream_output(blocks: list, stop_reason: str | None) -> list:
    """The assistant turn of a converted Anthropic stream (``MessageStream.content()``), as
    :class:`ChatOutput` gives it for the chat chunks it was converted from."""
    parts = []
    for kind, block, text in blocks:
        if kind == "thinking" and text:
            parts.append({"type": "reasoning", "content": text})
        elif kind == "text" and text:
            parts.append({"type": "text", "content": text})
        elif kind == "tool_use":
            parts.append({"type": "tool_call", "id": block.get("id"), "name": block.get("name"),
                          "arguments": _arguments(text)})
    return [{"role": "assistant", "parts": parts, "finish_reason": stop_reason}]
