"""Anthropic Messages as vLLM's chat completions and back, by hand (tests/tracing/test_protocols.py
checks the same against vLLM's own ``/v1/messages``)."""

from __future__ import annotations

import json

import pytest

from lightspan.tracing.protocols.anthropic_convert import MessageStream, Unsupported, to_chat, to_message, usage

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
        "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                  "output_tokens": 4}}
    empty = {"id": "c2", "model": "m", "choices": [{"finish_reason": "stop", "stop_reason": "END", "message": {}}]}
    assert to_message(empty)["content"] == [{"type": "text", "text": ""}]
    assert (to_message(empty)["stop_reason"], to_message(empty)["stop_sequence"]) == ("stop_sequence", "END")


NO_CACHE = {"cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}   # as Anthropic's API sends them


def test_usage_always_carries_the_cache_counts_anthropic_sends():
    """Agents add ``cache_read_input_tokens`` up as an int: Anthropic sends 0 when nothing was cached."""
    assert usage(None) == {"input_tokens": 0, **NO_CACHE, "output_tokens": 0}
    assert usage({"prompt_tokens": 9, "completion_tokens": 2}) == {"input_tokens": 9, **NO_CACHE, "output_tokens": 2}
    cached = usage({"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}})
    assert cached == {"input_tokens": 5, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4,
                      "output_tokens": 2}


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
                "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 7, **NO_CACHE, "output_tokens": 0}}}),
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
                               "usage": {"input_tokens": 7, **NO_CACHE, "output_tokens": 5}}),
            ("message_stop", {"type": "message_stop"})]]


def _random_stream(rng) -> list:
    """A chat stream as vLLM sends it with ids and logprobs: text, reasoning and tool calls (each
    one's arguments right after it, as vLLM's tool parsers send them) in a random order, some chunks
    with two tokens, a finish, the usage chunk."""
    deltas = [{"role": "assistant", "content": ""}]
    tool = 0
    for _ in range(rng.randint(1, 30)):
        kind = rng.choice(["text"] * 6 + ["reasoning", "tool", "empty"])
        if kind == "text":
            deltas.append({"content": rng.choice(["a", "b c", "é", "\n"])})
        elif kind == "reasoning":
            deltas.append({"reasoning": "hm"})
        elif kind == "tool":
            tool += 1
            deltas.append({"tool_calls": [{"index": tool - 1, "id": f"t{tool}", "function": {"name": "add", "arguments": ""}}]})
            deltas += [{"tool_calls": [{"index": tool - 1, "function": {"arguments": part}}]}
                       for part in rng.choice([['{"a": 1}'], ['{"a"', ': 2}'], []])]
        else:
            deltas.append({"content": ""})
    chunks = []
    for i, delta in enumerate(deltas):
        chunk = _chunk(delta)
        n = rng.choice([1, 1, 1, 2])
        if i == 0:
            chunk["prompt_token_ids"] = [1, 2, 3]
        else:
            chunk["choices"][0].update(token_ids=[100 + i] * n, logprobs={"content": [
                {"token": "x", "logprob": -0.5 * i, "bytes": [120], "top_logprobs": []}] * n})
        chunks.append(chunk)
    chunks[-1]["choices"][0]["finish_reason"] = rng.choice(["stop", "length", "tool_calls"])
    return chunks + [_chunk(usage={"prompt_tokens": 3, "completion_tokens": 9}, choices=False)]


def _unsigned(events) -> str:
    """The events as JSON, thinking blocks' random signatures left out."""
    return json.dumps([(n, {**d, "delta": {k: v for k, v in d["delta"].items() if k != "signature"}}
                        if "delta" in d else d) for n, d in events])


def test_the_one_pass_conversion_of_a_text_chunk_is_the_general_ones():
    """``AnthropicCapture.events`` reads and converts a one-token text chunk in one pass: the events,
    the ids, the logprobs and the span's output messages are those of the general path's
    (``Capture.add_json`` and ``MessageStream.feed``)."""
    import copy
    import random

    from lightspan.tracing.protocols.anthropic_messages import AnthropicCapture, anthropic_stream_output

    body = {"model": "m", "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    rng = random.Random(11)
    for _ in range(300):
        chunks = _random_stream(rng)
        fast, general = AnthropicCapture(body), AnthropicCapture(body)
        got = [e for c in copy.deepcopy(chunks) for e in fast.events(c)] + fast.end()
        expected = []
        for c in copy.deepcopy(chunks):
            general.chat.add_json(c)
            expected += general.stream.feed(c)
        expected += general.end()
        assert _unsigned(got) == _unsigned(expected)
        assert fast.attributes(1) == general.attributes(1) and fast.status() == "ok"
        assert anthropic_stream_output(fast.stream.content(), "s") == anthropic_stream_output(
            general.stream.content(), "s")


def test_a_converted_streams_output_messages_are_its_chat_chunks():
    """The span's output messages of a converted stream, read from the Anthropic blocks, are what
    ``ChatOutput`` reads from the chat chunks they were converted from."""
    import random

    from lightspan.tracing.protocols.anthropic_messages import anthropic_stream_output
    from lightspan.tracing.protocols.chat_messages import ChatOutput

    rng = random.Random(5)
    for _ in range(200):
        chunks = [c for c in _random_stream(rng) if c.get("choices")]
        stream, chat = MessageStream(), ChatOutput()
        for c in chunks:
            stream.feed(c)
            chat.add(c)
        stream.done()
        ours = anthropic_stream_output(stream.content(), "end_turn")[0]["parts"]
        theirs = chat.messages("end_turn")[0]["parts"]
        # (ChatOutput joins all text, and all reasoning, into one part each; the blocks keep their order)
        def joined(parts, kind):
            return "".join(p["content"] for p in parts if p["type"] == kind)
        assert joined(ours, "text") == joined(theirs, "text") and joined(ours, "reasoning") == joined(theirs, "reasoning")
        assert [p for p in ours if p["type"] == "tool_call"] == [p for p in theirs if p["type"] == "tool_call"]
