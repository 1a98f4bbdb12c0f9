"""Chat completion chunks as the Responses API's event stream, the way vLLM's ``/v1/responses`` streams.

vLLM 0.32's non-harmony streaming path (``vllm/entrypoints/openai/responses/streaming_events.py``:
``SimpleStreamingEventProcessor``) keeps one output item open at a time: a reasoning item, a message
with one ``output_text`` part, or a function call. A delta of another kind (or a tool call of
another index) closes the open item (``…done`` events, then ``response.output_item.done``) and
opens the next (``response.output_item.added``, and for text and reasoning
``response.content_part.added``); the stream starts with ``response.created`` and
``response.in_progress`` and ends with ``response.completed``, which carries the whole Response
(:mod:`.responses_convert` builds its items and envelope). The caller asked for no logprobs, so the
text events carry ``[]`` and the parts ``null``, as vLLM's do for such a request.
"""

from __future__ import annotations

from lightspan.tracing.protocols.responses_convert import (
    call_item,
    envelope,
    message_item,
    new_id,
    reasoning_item,
    status_of,
    text_part,
    usage,
)


class ResponseStream:
    """Chat completion chunks in, Responses events out (event dicts, ``sequence_number`` in order), as
    vLLM's ``SimpleStreamingEventProcessor`` writes them; :attr:`response` is the final Response."""

    def __init__(self, body: dict):
        self.body = body
        self.sequence = 0
        self.started = False
        self.state: str | None = None       # the open item: "reasoning", "content", "tool_call"
        self.item_id = ""
        self.text = ""                      # the open item's text (a tool call's arguments)
        self.call: tuple | None = None      # the open tool call's (index, call id, name)
        self.output: list[dict] = []
        self.model = self.created = self.finish_reason = self.usage = None
        self.id = new_id("resp")           # one id from response.created to response.completed
        self.response: dict | None = None

    def _event(self, out: list, event: dict) -> None:
        event["sequence_number"] = self.sequence
        self.sequence += 1
        out.append(event)

    def _envelope(self, status: str, output: list, usage_) -> dict:
        return envelope(self.body, self.model, self.created, status, output, usage_, self.id)

    def _close(self, out: list) -> None:
        index, item_id, text = len(self.output), self.item_id, self.text
        if self.state == "content":
            part = text_part(text)
            item = {**message_item(text, item_id), "content": [part] if text else []}
            self._event(out, {"content_index": 0, "item_id": item_id, "logprobs": [], "output_index": index,
                              "text": text, "type": "response.output_text.done"})
            self._event(out, {"content_index": 0, "item_id": item_id, "output_index": index, "part": part,
                              "type": "response.content_part.done"})
        elif self.state == "reasoning":
            item = reasoning_item(text, item_id, "completed")
            self._event(out, {"content_index": 0, "item_id": item_id, "output_index": index, "text": text,
                              "type": "response.reasoning_text.done"})
            self._event(out, {"content_index": 0, "item_id": item_id, "output_index": index,
                              "part": {"text": text, "type": "reasoning_text"}, "type": "response.content_part.done"})
        elif self.state == "tool_call":
            _, call_id, name = self.call
            item = call_item(call_id, name, text, item_id)
            self._event(out, {"arguments": text, "item_id": item_id, "name": name, "output_index": index,
                              "type": "response.function_call_arguments.done"})
        else:
            return
        self._event(out, {"item": item, "output_index": index, "type": "response.output_item.done"})
        self.output.append(item)
        self.state, self.text, self.call = None, "", None

    def _open(self, state: str, out: list, call=None) -> None:
        self._close(out)
        index = len(self.output)
        self.state, self.text = state, ""
        if state == "content":
            self.item_id = new_id("msg")
            item = {"id": self.item_id, "content": [], "role": "assistant", "status": "in_progress",
                    "type": "message", "phase": None}
            self._event(out, {"item": item, "output_index": index, "type": "response.output_item.added"})
            self._event(out, {"content_index": 0, "item_id": self.item_id, "output_index": index,
                              "part": {**text_part(""), "logprobs": []}, "type": "response.content_part.added"})
        elif state == "reasoning":
            self.item_id = new_id("rs")
            item = {"id": self.item_id, "summary": [], "type": "reasoning", "content": None,
                    "encrypted_content": None, "status": "in_progress"}
            self._event(out, {"item": item, "output_index": index, "type": "response.output_item.added"})
            self._event(out, {"content_index": 0, "item_id": self.item_id, "output_index": index,
                              "part": {"text": "", "type": "reasoning_text"}, "type": "response.content_part.added"})
        else:
            self.item_id = new_id("fc")
            self.call = call
            item = call_item(call[1], call[2], "", self.item_id, "in_progress")
            self._event(out, {"item": item, "output_index": index, "type": "response.output_item.added"})

    def _start(self, chunk: dict, out: list) -> None:
        self.started = True
        self.model, self.created = chunk.get("model"), chunk.get("created")
        initial = self._envelope("in_progress", [], None)
        self._event(out, {"response": initial, "type": "response.created"})
        self._event(out, {"response": initial, "type": "response.in_progress"})

    def text_delta(self, text: str) -> list[dict]:
        """The events of a chunk that is only ``text`` while a message item is open (what :meth:`feed`
        gives for it, without reading the chunk again)."""
        out: list = []
        self.text += text
        self._event(out, {"content_index": 0, "delta": text, "item_id": self.item_id, "logprobs": [],
                          "output_index": len(self.output), "type": "response.output_text.delta"})
        return out

    def feed(self, chunk: dict) -> list[dict]:
        """The events of one chat completion chunk."""
        out: list = []
        if not self.started:
            self._start(chunk, out)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning")
            if reasoning is not None:
                if self.state != "reasoning":
                    self._open("reasoning", out)
                self.text += reasoning
                self._event(out, {"content_index": 0, "delta": reasoning, "item_id": self.item_id,
                                  "output_index": len(self.output), "type": "response.reasoning_text.delta"})
            if delta.get("content"):
                if self.state != "content":
                    self._open("content", out)
                out += self.text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                self._tool_call(call, out)
        return out

    def _tool_call(self, call: dict, out: list) -> None:
        fn = call.get("function")
        if fn is None:
            return
        index = call.get("index")
        if self.state != "tool_call" or (index is not None and self.call[0] is not None and index != self.call[0]):
            self._open("tool_call", out, (index, call.get("id"), fn.get("name")))
        if fn.get("arguments"):
            self.text += fn["arguments"]
            self._event(out, {"delta": fn["arguments"], "item_id": self.item_id, "output_index": len(self.output),
                              "type": "response.function_call_arguments.delta"})

    def done(self) -> list[dict]:
        """The events at the chat stream's ``[DONE]``: the open item closed, then ``response.completed``."""
        out: list = []
        self._close(out)
        self.response = self._envelope(status_of(self.finish_reason), list(self.output), usage(self.usage))
        self._event(out, {"response": self.response, "type": "response.completed"})
        return out

