"""Anthropic Messages as chat completions, the way vLLM serves them, so that the ids can be asked for.

vLLM 0.32 answers ``POST /v1/messages`` by converting the request into a chat completion,
running it, and converting the answer back (``vllm/entrypoints/anthropic/serving.py``); that
route takes no ``return_token_ids`` and its answer carries no token ids or logprobs. lightspan
therefore makes the same conversion itself, calls ``/v1/chat/completions`` with the capture
fields, and converts vLLM's answer back as vLLM would: the caller gets the Anthropic message,
or the Anthropic event stream, that ``/v1/messages`` gives, and the span gets the ids. Three pure
functions over JSON dicts, for the instrumentor and a gateway alike:

- :func:`to_chat`: the request (vLLM's ``to_chat_completion_request``, field for field: system
  blocks joined, ``tool_use`` blocks as tool calls with ``json.dumps`` arguments,
  ``tool_result`` blocks as ``tool`` messages placed before the rest of their user turn,
  thinking blocks as ``reasoning``, ``tool_choice`` ``any`` as ``required``). A request it
  cannot reproduce exactly raises :class:`Unsupported` and goes to ``/v1/messages`` as it is:
  images, ``thinking`` of type ``disabled`` (vLLM probes the model for it), inline ``system``
  messages (vLLM merges them or not depending on the chat template), tool changes, blocks or
  fields that vLLM's own validation would refuse;
- :func:`to_message`: a chat completion as the Anthropic message (``model_dump(exclude_none)``);
- :class:`MessageStream`: chat completion chunks as the Anthropic events, by vLLM's state machine
  (one block at a time, text while a tool call is open held back until it closes).

Where vLLM itself fails (a tool call whose arguments are not a JSON object makes its converter
raise, and the call end in a 400), the message here carries the arguments as they parse, or
``{}``; an error answer keeps the chat-completions error body (:func:`to_error` makes the
Anthropic one of it, as vLLM's route does, for a gateway).
"""

from __future__ import annotations

import json
import operator
import time
import uuid

_BILLING = "x-anthropic-billing-header"
_STOP_REASONS = ("stop", "tool_calls")
_PASSED_THROUGH = ("watermarking", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
                   "chat_template_kwargs")   # vLLM-specific fields its Anthropic route hands on


class Unsupported(ValueError):
    """A request :func:`to_chat` cannot convert as vLLM does; the message says what."""


def _system_text(content) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(_BILLING) else content
    parts = [b.get("text") for b in content if b.get("type") == "text" and b.get("text")
             and not b["text"].startswith(_BILLING)]
    return "".join(parts) if parts else None


def _tool_result(block: dict, role: str, messages: list, parts: list) -> None:
    content = block.get("content")
    if role != "user":
        parts.append({"type": "text", "text": f"Tool result: {str(content) if content else ''}"})
        return
    text = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            if item.get("type") in ("image", "tool_reference"):
                raise Unsupported(f"a tool_result holding {item['type']} blocks")
            if item.get("type") == "text":
                texts.append(item.get("text", ""))
        text = "\n".join(texts)
    messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text or ""})


def _message(msg: dict, messages: list) -> None:
    role, content = msg.get("role"), msg.get("content")
    if role not in ("user", "assistant"):
        raise Unsupported(f"a message with role {role!r}")
    out = {"role": role}
    if isinstance(content, str):
        out["content"] = content
    elif isinstance(content, list):
        parts, calls, reasoning = [], [], []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                if not isinstance(block.get("text", ""), str):
                    raise Unsupported("a text block whose text is not a string")
                if block.get("text"):
                    parts.append({"type": "text", "text": block["text"]})
            elif kind == "thinking":
                if block.get("thinking") is not None:
                    reasoning.append(block["thinking"])
            elif kind == "redacted_thinking":
                pass
            elif kind == "tool_use":
                arguments = block.get("input")
                if arguments is not None and not isinstance(arguments, dict):
                    raise Unsupported("a tool_use block whose input is not an object")
                calls.append({"id": block.get("id") or f"call_{int(time.time())}", "type": "function",
                              "function": {"name": block.get("name") or "", "arguments": json.dumps(arguments or {})}})
            elif kind == "tool_result":
                _tool_result(block, role, messages, parts)
            else:
                raise Unsupported(f"a {kind!r} content block")
        if reasoning:
            out["reasoning"] = "".join(reasoning)
        if calls:
            out["tool_calls"] = calls
        if len(parts) == 1:
            out["content"] = parts[0]["text"]
        elif parts:
            out["content"] = parts
    else:
        raise Unsupported("a message whose content is neither text nor a list of blocks")
    if not (role == "user" and "content" not in out):
        messages.append(out)


def _tools(body: dict, chat: dict) -> None:
    choice, tools = body.get("tool_choice"), body.get("tools")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "none", "tool") or (kind == "tool" and not choice.get("name")):
            raise Unsupported(f"tool_choice {choice!r}")
        chat["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {
            "type": "function", "function": {"name": choice["name"]}}
    if tools is None:
        return
    converted = []
    for tool in tools:
        if not isinstance(tool, dict) or not tool.get("name") or not isinstance(tool.get("input_schema"), dict):
            raise Unsupported("a tool without a name and an input_schema (a server tool)")
        schema = tool["input_schema"]
        function = {"name": tool["name"], "description": tool.get("description"),
                    "parameters": schema if "type" in schema else {**schema, "type": "object"}}
        for key in ("strict", "defer_loading"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        converted.append({"type": "function", "function": function})
    chat.setdefault("tool_choice", "auto")
    chat["tools"] = converted


def to_chat(body: dict) -> dict:
    """The chat completions request vLLM makes of Anthropic request ``body``; raises
    :class:`Unsupported` for what it cannot reproduce (the request then goes as it is)."""
    model, max_tokens, messages = body.get("model"), body.get("max_tokens"), body.get("messages")
    if not isinstance(model, str) or not model or not isinstance(messages, list) or not messages:
        raise Unsupported("a request without a model or messages")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise Unsupported("a request without a positive max_tokens")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "adaptive")):
        raise Unsupported(f"thinking {thinking!r}")
    chat_messages: list[dict] = []
    system = body.get("system")
    if system:
        if not isinstance(system, (str, list)):
            raise Unsupported("a system prompt that is neither text nor blocks")
        text = system if isinstance(system, str) else _system_text(system)
        if text:
            chat_messages.append({"role": "system", "content": text})
    for msg in messages:
        if not isinstance(msg, dict):
            raise Unsupported("a message that is not an object")
        _message(msg, chat_messages)
    chat = {"model": model, "messages": chat_messages, "max_tokens": max_tokens, "max_completion_tokens": max_tokens}
    for ours, theirs in (("stop", "stop_sequences"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    for key in _PASSED_THROUGH:
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    output = body.get("output_config")
    if isinstance(output, dict):
        fmt = output.get("format")
        if isinstance(fmt, dict) and fmt.get("json_schema"):
            chat["response_format"] = {"type": fmt.get("type"), "json_schema": {"schema": fmt["json_schema"],
                                                                                "name": fmt.get("type")}}
        if output.get("effort") is not None:
            chat["reasoning_effort"] = output["effort"]
    if thinking and thinking.get("type") == "enabled":
        chat["thinking_token_budget"] = thinking.get("budget_tokens")
    _tools(body, chat)
    return chat


def usage(chat_usage) -> dict:
    """Anthropic usage from chat usage: ``input_tokens`` leaves out the cached prompt tokens. The two
    cache counts are always there, 0 when unused, as Anthropic's API sends them (agents add them up as
    ints; vLLM's own ``/v1/messages`` leaves them out, which such an agent cannot survive)."""
    if not chat_usage:
        return {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0}
    details = chat_usage.get("prompt_tokens_details")
    read = created = 0
    if details:
        read = details.get("cached_tokens") or 0
        created = details.get("created_cache_tokens") or 0
    return {"input_tokens": max(0, (chat_usage.get("prompt_tokens") or 0) - read - created),
            "cache_creation_input_tokens": created, "cache_read_input_tokens": read,
            "output_tokens": chat_usage.get("completion_tokens") or 0}


def stop_reason(finish_reason, stop, tool_used: bool, tool_complete: bool) -> tuple[str | None, str | None]:
    """Anthropic (stop_reason, stop_sequence) of a chat finish reason (vLLM's rule)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in _STOP_REASONS:
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _arguments(text: str):
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def to_message(chat: dict) -> dict:
    """The Anthropic message of a chat completion (``model_dump(exclude_none=True)`` of vLLM's)."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls), bool(calls))
    content = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": uuid.uuid4().hex})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in calls:
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                        "input": _arguments(fn.get("arguments"))})
    return message_of(chat, content, reason, sequence)


def message_of(chat: dict, content: list, reason: str | None, sequence: str | None) -> dict:
    """The Anthropic message of a chat completion whose ``content`` blocks and stop reason are made."""
    out = {"id": chat.get("id") or f"msg_{int(time.time() * 1000)}", "type": "message", "role": "assistant",
           "content": content or [{"type": "text", "text": ""}], "model": chat.get("model")}
    if reason is not None:
        out["stop_reason"] = reason
    if sequence is not None:
        out["stop_sequence"] = sequence
    out["usage"] = usage(chat.get("usage"))
    kv, ec = chat.get("kv_transfer_params"), chat.get("ec_transfer_params")
    if kv is not None:
        out["kv_transfer_params"] = kv
    if ec is not None:
        out["ec_transfer_params"] = ec
    return out


_DELTA_TEXT = {kind: operator.itemgetter(field)
               for kind, field in (("text", "text"), ("thinking", "thinking"), ("tool_use", "partial_json"))}


class MessageStream:
    """Chat completion chunks in, Anthropic stream events out: ``(event name, data dict)`` pairs,
    as vLLM's ``message_stream_converter`` writes them (``exclude_unset``)."""

    def __init__(self):
        self.first = True
        self.finish_reason = self.stop = None
        self.tool_used = False
        self.tool_args: list[str] = []      # the arguments of the latest tool_use block
        self.next_index = 0                 # the index the next block gets
        self.block: str | None = None       # the open block's type
        self.index: int | None = None
        self.signature: str | None = None   # a thinking block's, until sent
        self.tool_id: str | None = None
        self.pending: list[str] = []        # text that came while a tool_use block was open
        self.tool_ids: dict[int, str] = {}  # tool call index -> tool_use id
        self.blocks: list[tuple[dict, list]] = []   # each block as started, with its deltas (for the span)

    def _stop_block(self, out: list) -> None:
        if self.block is None:
            return
        if self.block == "thinking" and self.signature is not None:
            out.append(("content_block_delta", {"type": "content_block_delta", "delta": {
                "type": "signature_delta", "signature": self.signature}, "index": self.index}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.block = self.index = self.signature = self.tool_id = None
        self.next_index += 1

    def _start_block(self, block: dict, out: list) -> None:
        out.append(("content_block_start", {"type": "content_block_start", "content_block": block,
                                            "index": self.next_index}))
        self.block, self.index = block["type"], self.next_index
        self.blocks.append((block, []))
        self.signature = uuid.uuid4().hex if block["type"] == "thinking" else None
        self.tool_id = block.get("id") if block["type"] == "tool_use" else None

    def _flush(self, out: list) -> None:
        text, self.pending = "".join(self.pending), []
        self._stop_block(out)
        if text:
            self._start_block({"type": "text", "text": ""}, out)
            self._delta({"type": "text_delta", "text": text}, out)
            self._stop_block(out)

    def _delta(self, delta: dict, out: list) -> None:
        index = self.index if self.index is not None else self.next_index
        out.append(("content_block_delta", {"type": "content_block_delta", "delta": delta, "index": index}))
        if self.block is not None:
            self.blocks[-1][1].append(delta)

    def feed(self, chunk: dict) -> list[tuple[str, dict]]:
        """The events of one chat completion chunk."""
        out: list = []
        if self.first:
            self.first = False
            out.append(("message_start", {"type": "message_start", "message": {
                "id": chunk.get("id") or f"msg_{int(time.time() * 1000)}", "type": "message", "role": "assistant",
                "content": [], "model": chunk.get("model"), "stop_reason": None, "stop_sequence": None,
                "usage": usage(chunk.get("usage"))}}))
            return out
        choices = chunk.get("choices") or []
        if not choices:   # the last chunk: the usage
            self._flush(out)
            tool_complete = self.tool_used and _is_json("".join(self.tool_args))
            reason, sequence = stop_reason(self.finish_reason or "stop", self.stop, self.tool_used, tool_complete)
            out.append(("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": reason, "stop_sequence": sequence}, "usage": usage(chunk.get("usage"))}))
            return out
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish_reason, self.stop = choice["finish_reason"], choice.get("stop_reason")
        delta = choice.get("delta") or {}
        if delta.get("reasoning"):
            if self.block != "thinking":
                self._flush(out)
                self._start_block({"type": "thinking", "thinking": ""}, out)
            self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}, out)
        text = delta.get("content")
        if text:
            if self.block == "tool_use":
                self.pending.append(text)
            else:
                if self.block != "text":
                    self._flush(out)
                    self._start_block({"type": "text", "text": ""}, out)
                self._delta({"type": "text_delta", "text": text}, out)
        for call in delta.get("tool_calls") or ():
            self._tool_call(call, out)
        return out

    def text(self, text: str) -> list[tuple[str, dict]]:
        """The events of a chunk that is only ``text``, while a text block is open (what :meth:`feed`
        gives for it, without reading the chunk again)."""
        delta = {"type": "text_delta", "text": text}   # (_delta, inlined: this runs per token)
        self.blocks[-1][1].append(delta)
        return [("content_block_delta", {"type": "content_block_delta", "delta": delta, "index": self.index})]

    def _tool_call(self, call: dict, out: list) -> None:
        fn = call.get("function") or {}
        if call.get("id") is not None:
            self.tool_ids[call.get("index")] = call["id"]
            if self.tool_id != call["id"] and fn.get("name") is not None:
                self._flush(out)
                self.tool_used, self.tool_args = True, []
                self._start_block({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}, out)
            tool_id = call["id"]
        else:
            tool_id = self.tool_ids.get(call.get("index"))
        if tool_id is not None and fn.get("arguments") and self.tool_id == tool_id:
            self.tool_args.append(fn["arguments"])
            self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}, out)

    def content(self) -> list[tuple[str, dict, str]]:
        """The message's blocks so far: (type, the block as started, the text of its deltas: a text
        block's text, a thinking block's thinking, a tool_use block's input as JSON text)."""
        out = []
        for block, deltas in self.blocks:
            field = _DELTA_TEXT.get(block["type"])
            # (each delta of a block has its field, never empty: _delta's callers; read in C)
            out.append((block["type"], block, "".join(map(field, deltas)) if field else ""))
        return out

    def done(self) -> list[tuple[str, dict]]:
        """The events at the stream's ``[DONE]``."""
        out: list = []
        self._flush(out)
        out.append(("message_stop", {"type": "message_stop"}))
        return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def to_error(chat_error) -> dict:
    """Anthropic's error body of a chat completions error answer (vLLM's ``translate_error_response``:
    the error's type and message); an answer that is not vLLM's error shape gives an ``api_error``."""
    error = chat_error.get("error") if isinstance(chat_error, dict) else None
    error = error if isinstance(error, dict) else {}
    return {"type": "error", "error": {"type": str(error.get("type") or "api_error"),
                                       "message": str(error.get("message") or "")}}
