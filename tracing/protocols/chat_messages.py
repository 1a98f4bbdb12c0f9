"""A chat completion's messages in the GenAI shape (lightspan.tracing.messages): the request's
input turns and the answer's assistant turn, read from a response or its stream chunks as they pass
(choice 0, in order). Completions (:mod:`.completions`) use the same readers."""

from __future__ import annotations

import json

from lightspan.tracing.messages import _arguments, _text_of
from lightspan.tracing.protocols.base import _get


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


def output(cap, stream: bool) -> ChatOutput:
    return ChatOutput()


def outputs(cap, out: ChatOutput | None) -> list | None:
    return out.messages() if out is not None else None
