"""The Responses API as chat completions, the way vLLM serves it, so that every token's logprob can be asked for.

vLLM 0.32 answers ``POST /v1/responses`` (non-harmony models) by rendering the request's items as
chat messages (``vllm/entrypoints/openai/responses/utils.py``: ``construct_input_messages``),
generating as a chat completion would, and parsing the output with the same tool and reasoning
parsers. Its answer carries a logprob only for tokens of output text: none for a reply that is only
a tool call, none for a tool call's tokens beside text, and in a stream none for tokens whose delta
has no text (the end-of-turn token). Its chat completions route gives ids and a logprob for every
token. lightspan therefore makes vLLM's conversion itself, calls ``/v1/chat/completions`` with the
capture fields, and converts the answer back as vLLM's Responses route writes it: the caller gets
the Response object, or the event stream, that ``/v1/responses`` gives (compared greedily in
tests/tracing/test_protocols.py), and the span gets the ids. Pure functions over JSON dicts, for the
instrumentor and a gateway alike:

- :func:`to_chat`: the request (``instructions`` as the system message, message items, ``function_call``
  items merged into the assistant turn as tool calls, ``function_call_output`` items as ``tool``
  messages, reasoning items as ``reasoning``, function tools as chat tools, the sampling fields and
  vLLM's own extensions handed on). A request it cannot reproduce raises :class:`Unsupported` and
  goes to ``/v1/responses`` as it is: stored or background responses, ``previous_response_id``,
  tools other than functions, structured ``text`` formats, ``reasoning`` settings, items other
  than those above, a partial last message (vLLM continues it), and the fields that would show the
  caller ids or logprobs (``enable_response_messages``, ``include``);
- :func:`to_response`: a chat completion as the Response object (``ResponsesResponse.from_request``);
- :class:`~lightspan.tracing.protocols.responses_stream.ResponseStream`: chat completion chunks as the
  Responses events, by vLLM's simple streaming state machine (its own module).

Where the answer echoes what vLLM resolved rather than what was asked, it says what was asked:
``temperature`` / ``top_p`` left unset echo vLLM's defaults (1.0; a server whose model has a
generation config of its own samples with, and would echo, that config's), ``max_output_tokens``
left unset echoes ``null`` (vLLM: the room left in the context), and the prompt cache counts
(``usage.input_tokens_details``) are the chat answer's: ``cached_tokens`` 0 unless vLLM runs with
``--enable-prompt-tokens-details``, ``cache_write_tokens`` 0 (vLLM's Responses route: the prompt
tokens it wrote to its prefix cache, which its chat route does not report).
"""

from __future__ import annotations

import time
import uuid

_ECHOED_DEFAULTS = {"background": False, "instructions": None, "max_tool_calls": None, "metadata": None,
                    "previous_response_id": None, "prompt": None, "reasoning": None, "service_tier": "auto",
                    "text": None, "truncation": "disabled", "user": None}
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens",
             "include_stop_str_in_output", "user", "priority")
# vLLM's own request fields, handed on as its chat route takes them
_PASSED_THROUGH = ("structured_outputs", "watermarking", "cache_salt", "vllm_xargs", "kv_transfer_params",
                   "ec_transfer_params", "chat_template_kwargs", "mm_processor_kwargs", "request_id")
# fields that change nothing vLLM generates, or that it ignores
_IGNORED = frozenset({"model", "input", "stream", "store", "metadata", "service_tier", "truncation", "instructions",
                      "max_output_tokens", "tools", "tool_choice", "parallel_tool_calls", "prompt_cache_key",
                      "safety_identifier", "prompt_cache_retention", "max_tool_calls", "include_reasoning",
                      "top_logprobs", "session_id", *_SAMPLING, *_PASSED_THROUGH})


class Unsupported(ValueError):
    """A request :func:`to_chat` cannot convert as vLLM does; the message says what."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


def _text(content) -> str | None:
    """An assistant item's text, as vLLM reads it (the first part's)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        return content[0].get("text")
    return None


def _merge(messages: list, key: str, value) -> bool:
    """Put ``value`` into the last message when it is an assistant turn without ``key`` yet."""
    last = messages[-1] if messages else None
    if last is None or last.get("role") != "assistant":
        return False
    if key == "tool_calls":
        last.setdefault("tool_calls", []).append(value)
        return True
    if last.get(key) is None:
        last[key] = value
        return True
    return False


def _user_parts(content: list) -> list:
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "text") or not isinstance(part.get("text"), str):
            raise Unsupported(f"a message part of type {kind!r}")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _item(item, messages: list) -> None:
    if not isinstance(item, dict):
        raise Unsupported("an input item that is not an object")
    kind, role = item.get("type"), item.get("role")
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        if item.get("namespace"):
            raise Unsupported("a namespaced function call")
        if not _merge(messages, "tool_calls", call):
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("output"), str):
            raise Unsupported("a function_call_output whose output is not text")
        messages.append({"role": "tool", "content": item["output"], "tool_call_id": item.get("call_id")})
    elif kind == "reasoning":
        if item.get("encrypted_content"):
            raise Unsupported("encrypted reasoning")
        content, summary = item.get("content") or [], item.get("summary") or []
        text = content[0].get("text") if content else summary[0].get("text") if summary else ""
        if not _merge(messages, "reasoning", text):
            messages.append({"role": "assistant", "reasoning": text})
    elif kind in (None, "message") and role == "assistant":
        text = _text(item.get("content"))
        if text is None:
            raise Unsupported("an assistant message without text")
        if not _merge(messages, "content", text):
            messages.append({"role": "assistant", "content": text})
    elif kind in (None, "message") and role in ("user", "system", "developer"):
        content = item.get("content")
        if isinstance(content, list):
            content = _user_parts(content)
        elif not isinstance(content, str):
            raise Unsupported("a message whose content is neither text nor parts")
        messages.append({"role": role, "content": content})
    else:
        raise Unsupported(f"an input item of type {kind or role!r}")


def _tools(body: dict, chat: dict) -> None:
    tools = body.get("tools") or []
    converted = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function" or not tool.get("name"):
            raise Unsupported(f"a {tool.get('type') if isinstance(tool, dict) else ''!r} tool (only function tools)")
        converted.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    choice = body.get("tool_choice", "auto")
    if not converted:
        if choice not in (None, "auto", "none"):
            raise Unsupported(f"tool_choice {choice!r} without tools")
        return
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise Unsupported(f"tool_choice {choice!r}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice not in ("auto", "none", "required"):
        raise Unsupported(f"tool_choice {choice!r}")
    chat["tools"], chat["tool_choice"] = converted, choice


def to_chat(body: dict) -> dict:
    """The chat completions request vLLM makes of Responses request ``body``; raises
    :class:`Unsupported` for what it cannot reproduce (the request then goes as it is)."""
    for key, why in (("background", "a background response"), ("previous_response_id", "previous_response_id"),
                     ("conversation", "a conversation"), ("prompt", "a prompt template"),
                     ("reasoning", "reasoning settings"), ("enable_response_messages", "enable_response_messages"),
                     ("include", "include (fields only vLLM's Responses route writes)")):
        if body.get(key):
            raise Unsupported(why)
    unknown = sorted(k for k, v in body.items() if k not in _IGNORED and v is not None
                     and k not in ("background", "previous_response_id", "reasoning", "include", "text"))
    if unknown:
        raise Unsupported(f"the field(s) {', '.join(unknown)}")
    text = body.get("text")
    if text is not None and (not isinstance(text, dict) or set(text) - {"format", "verbosity"}
                             or (text.get("format") or {"type": "text"}).get("type") != "text"
                             or text.get("verbosity") not in (None, "medium")):
        raise Unsupported(f"text {text!r} (only plain text output)")
    model, items = body.get("model"), body.get("input")
    if not isinstance(model, str) or not model:
        raise Unsupported("a request without a model")
    messages: list = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list) and items:
        last = items[-1]
        if isinstance(last, dict) and last.get("type", "message") in ("message", "reasoning") and \
                last.get("status") in ("in_progress", "incomplete"):
            raise Unsupported("a partial last message (vLLM continues it)")
        for item in items:
            _item(item, messages)
    else:
        raise Unsupported("a request without input")
    chat = {"model": model, "messages": messages}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in (*_SAMPLING, *_PASSED_THROUGH):
        if body.get(key) is not None:
            chat[key] = body[key]
    _tools(body, chat)
    if "tools" in chat:
        chat["parallel_tool_calls"] = body.get("parallel_tool_calls") is not False
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def envelope(body: dict, model, created, status: str, output: list, usage, response_id: str | None = None) -> dict:
    """The Response object's envelope, as ``ResponsesResponse.from_request`` fills it (module docstring)."""
    echoed = {k: body.get(k, v) if body.get(k) is not None else v for k, v in _ECHOED_DEFAULTS.items()}
    tools = body.get("tools") or []
    return {"id": response_id or new_id("resp"), "created_at": created if created is not None else int(time.time()),
           "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
           "instructions": echoed["instructions"], "metadata": echoed["metadata"], "model": model,
           "object": "response", "output": output,
           "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
           "temperature": float(body["temperature"]) if body.get("temperature") is not None else 1.0,
           "tool_choice": body.get("tool_choice") or "auto" if tools else "none", "tools": tools,
           "top_p": float(body["top_p"]) if body.get("top_p") is not None else 1.0,
           "background": echoed["background"], "max_output_tokens": body.get("max_output_tokens"),
           "max_tool_calls": echoed["max_tool_calls"], "previous_response_id": None, "prompt": None,
           "reasoning": None, "service_tier": echoed["service_tier"], "status": status, "text": echoed["text"],
           "top_logprobs": None, "truncation": echoed["truncation"], "usage": usage, "user": echoed["user"],
           "presence_penalty": float(body.get("presence_penalty") or 0.0),
           "frequency_penalty": float(body.get("frequency_penalty") or 0.0),
           "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None, "output_messages": None}


def usage(chat_usage) -> dict | None:
    """Responses usage from chat usage."""
    if not chat_usage:
        return None
    prompt, completion = chat_usage.get("prompt_tokens") or 0, chat_usage.get("completion_tokens") or 0
    details = chat_usage.get("prompt_tokens_details") or {}
    return {"input_tokens": prompt, "input_tokens_details": {
                "cached_tokens": details.get("cached_tokens") or 0, "cache_write_tokens": 0,
                "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": completion, "output_tokens_details": {
                "reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + completion}


def message_item(text: str, item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("msg"), "content": [text_part(text)], "role": "assistant",
            "status": "completed", "type": "message", "phase": None}


def text_part(text: str, logprobs=None) -> dict:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def reasoning_item(text: str, item_id: str | None = None, status=None) -> dict:
    return {"id": item_id or new_id("rs"), "summary": [], "type": "reasoning",
            "content": [{"text": text, "type": "reasoning_text"}], "encrypted_content": None, "status": status}


def call_item(call_id, name, arguments: str, item_id: str | None = None, status="completed") -> dict:
    return {"arguments": arguments, "call_id": call_id or new_id("call"), "name": name, "type": "function_call",
            "id": item_id or new_id("fc"), "async": None, "caller": None, "namespace": None, "status": status}


def status_of(finish_reason) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def to_response(chat: dict, body: dict) -> dict:
    """The Response object of a chat completion, for the caller's Responses request ``body``."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output = []
    if message.get("reasoning"):
        output.append(reasoning_item(message["reasoning"]))
    if message.get("content"):
        output.append(message_item(message["content"]))
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        output.append(call_item(call.get("id"), fn.get("name"), fn.get("arguments") or ""))
    return envelope(body, chat.get("model"), chat.get("created"), status_of(choice.get("finish_reason")), output,
                 usage(chat.get("usage")))
