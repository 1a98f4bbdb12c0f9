"""Anthropic Messages as vLLM's chat completions and back, by hand (tests/tracing/test_protocols.py
checks the same against vLLM's own ``/v1/messages``)."""

from __future__ import annotations

import json

import pytest

from lightspan.tracing.anthropic_convert import MessageStream, Unsupported, to_chat, to_message

TOOL = {"name": "add", "description": "Add.", "input_schema": {"properties": {"a": {"type": "integer"}}}}


def test_a_tool_turn_becomes_vllms_chat_request():
    body = {"model": "m", "max_tokens": 9, "stream": True, "stop_sequences": ["x"], "top_k": 5,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: 1"}, {"type": "text", "text": "A"},
                       {"type": "text", "text": "B"}],
            "tools": [TOOL], "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                  {"type": "text", "text": "Adding."},
                                                  {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 2}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [{"type": "text", "text": "5"}, {"type": "text", "text": "!"}]},
                                             {"type": "text", "text": "So?"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "6"}]}]}
    assert to_chat(body) == {
        "model": "m", "max_tokens": 9, "max_completion_tokens": 9, "stop": ["x"], "top_k": 5, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "parallel_tool_calls": True, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
            "properties": {"a": {"type": "integer"}}, "type": "object"}}}],
        "messages": [
            {"role": "system", "content": "AB"},
            {"role": "user", "content": "2+3?"},
            {"role": "assistant", "reasoning": "hm", "content": "Adding.",
             "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
            # a tool_result goes before the rest of its turn; a turn left without content goes
            {"role": "tool", "tool_call_id": "t1", "content": "5\n!"},
            {"role": "user", "content": "So?"},
            {"role": "tool", "tool_call_id": "t2", "content": "6"}]}


@pytest.mark.parametrize("change", [
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]},
    {"thinking": {"type": "disabled"}},
    {"messages": [{"role": "system", "content": "inline"}, {"role": "user", "content": "q"}]},
    {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"max_tokens": 0},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}]}]},
])
def test_what_vllm_would_convert_differently_is_left_alone(change):
    with pytest.raises(Unsupported):
        to_chat({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "q"}], **change})


def test_a_chat_completion_becomes_the_message():
    chat = {"id": "c1", "model": "m", "usage": {"prompt_tokens": 10, "completion_tokens": 4},
            "choices": [{"index": 0, "finish_reason": "tool_calls", "stop_reason": None, "message": {
                "role": "assistant", "content": "Sure.", "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}}]}
    assert to_message(chat) == {
        "id": "c1", "type": "message", "role": "assistant", "model": "m", "stop_reason": "tool_use",
        "content": [{"type": "text", "text": "Sure."}, {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}}],
        "usage": {"input_tokens": 10, "output_tokens": 4}}
    empty = {"id": "c2", "model": "m", "choices": [{"finish_reason": "stop", "stop_reason": "END", "message": {}}]}
    assert to_message(empty)["content"] == [{"type": "text", "text": ""}]
    assert (to_message(empty)["stop_reason"], to_message(empty)["stop_sequence"]) == ("stop_sequence", "END")


def _chunk(delta=None, finish=None, usage=None, choices=True):
    out = {"id": "c", "model": "m", "usage": usage}
    out["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if choices else []
    return out


def test_chat_chunks_become_the_event_stream():
    stream = MessageStream()
    chunks = [_chunk({"role": "assistant", "content": ""}, usage={"prompt_tokens": 7, "completion_tokens": 0}),
              _chunk({"content": "Hi"}), _chunk({"content": " there"}),
              _chunk({"tool_calls": [{"index": 0, "id": "t1", "function": {"name": "add", "arguments": ""}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
              _chunk({"content": "late"}),   # text while a tool call is open: held back until it closes
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, finish="tool_calls"),
              _chunk(usage={"prompt_tokens": 7, "completion_tokens": 5}, choices=False)]
    events = [e for c in chunks for e in stream.feed(c)] + stream.done()
    assert [(name, json.dumps(data, sort_keys=True)) for name, data in events] == [
        (n, json.dumps(d, sort_keys=True)) for n, d in [
            ("message_start", {"type": "message_start", "message": {
                "id": "c", "type": "message", "role": "assistant", "content": [], "model": "m",
                "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 7, "output_tokens": 0}}}),
            ("content_block_start", {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}),
            ("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}, "index": 0}),
            ("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": " there"}, "index": 0}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("content_block_start", {"type": "content_block_start", "content_block": {
                "type": "tool_use", "id": "t1", "name": "add", "input": {}}, "index": 1}),
            ("content_block_delta", {"type": "content_block_delta", "delta": {"type": "input_json_delta", "partial_json": '{"a": '}, "index": 1}),
            ("content_block_delta", {"type": "content_block_delta", "delta": {"type": "input_json_delta", "partial_json": "1}"}, "index": 1}),
            ("content_block_stop", {"type": "content_block_stop", "index": 1}),
            ("content_block_start", {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 2}),
            ("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "late"}, "index": 2}),
            ("content_block_stop", {"type": "content_block_stop", "index": 2}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                               "usage": {"input_tokens": 7, "output_tokens": 5}}),
            ("message_stop", {"type": "message_stop"})]]
