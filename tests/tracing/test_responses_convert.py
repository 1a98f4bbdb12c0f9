"""The Responses API as vLLM's chat completions and back, by hand (tests/tracing/test_protocols.py
checks the same against vLLM's own ``/v1/responses``, greedily)."""

from __future__ import annotations

import copy
import random
import re

import pytest

from lightspan.tracing.protocols.responses_convert import Unsupported, to_chat, to_response, usage
from lightspan.tracing.protocols.responses_stream import ResponseStream

PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "name": "add", "description": "Add.", "parameters": PARAMS, "strict": False}
CHAT_TOOL = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": PARAMS,
                                              "strict": False}}


def _call(call_id: str, a: int) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "add", "arguments": f'{{"a": {a}}}'}}


def test_a_tool_turn_becomes_vllms_chat_request():
    body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0.5, "top_p": 0.9,
            "stream": True, "tools": [TOOL], "tool_choice": {"type": "function", "name": "add"},
            "structured_outputs": {"regex": "x"}, "metadata": {"k": "v"}, "store": False,
            "input": [
                {"role": "user", "content": "2+3?"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
                {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": "Adding.", "annotations": []}]},
                # two calls of one turn join its assistant message; their outputs are tool messages
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
                {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 3}'},
                {"type": "function_call_output", "call_id": "c1", "output": "5"},
                {"type": "function_call_output", "call_id": "c2", "output": "6"},
                {"role": "user", "content": [{"type": "input_text", "text": "So?"}]},
                {"type": "message", "role": "developer", "content": "Answer in digits."}]}
    assert to_chat(body) == {
        "model": "m", "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "structured_outputs": {"regex": "x"},
        "tools": [CHAT_TOOL], "tool_choice": {"type": "function", "function": {"name": "add"}},
        "parallel_tool_calls": True, "stream": True, "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+3?"},
            {"role": "assistant", "reasoning": "hm", "content": "Adding.", "tool_calls": [_call("c1", 2), _call("c2", 3)]},
            {"role": "tool", "content": "5", "tool_call_id": "c1"},
            {"role": "tool", "content": "6", "tool_call_id": "c2"},
            {"role": "user", "content": [{"type": "text", "text": "So?"}]},
            {"role": "developer", "content": "Answer in digits."}]}


def test_a_plain_prompt_and_each_tool_choice():
    assert to_chat({"model": "m", "input": "hi"}) == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    base = {"model": "m", "input": "hi", "tools": [TOOL]}
    for choice in ("auto", "required", "none"):
        chat = to_chat({**base, "tool_choice": choice, "parallel_tool_calls": False})
        assert (chat["tool_choice"], chat["tools"], chat["parallel_tool_calls"]) == (choice, [CHAT_TOOL], False)
    assert (to_chat(base)["tool_choice"], to_chat(base)["parallel_tool_calls"]) == ("auto", True)   # vLLM's defaults
    # without tools, a tool_choice that asks for none of them changes nothing
    assert "tool_choice" not in to_chat({"model": "m", "input": "hi", "tool_choice": "none"})
    # a call the assistant made first, before any text of its turn, opens the turn
    chat = to_chat({"model": "m", "input": [
        {"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "add", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "1"}]})
    assert chat["messages"][1:] == [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "content": "1", "tool_call_id": "c"}]


@pytest.mark.parametrize("change", [
    {"previous_response_id": "resp_1"},
    {"background": True},
    {"conversation": "conv_1"},
    {"prompt": {"id": "pmpt_1"}},
    {"reasoning": {"effort": "low"}},
    {"enable_response_messages": True},                     # the caller reads ids: vLLM's route writes them
    {"include": ["message.output_text.logprobs"]},
    {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
    {"tools": [{"type": "web_search"}]},
    {"tools": [TOOL], "tool_choice": {"type": "web_search"}},
    {"tool_choice": "required"},                            # required, without tools
    {"some_new_field": 1},
    {"input": []},
    {"model": ""},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
    {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "x"}]}]},
    {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]},
    {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": "n"}]},
    {"input": [{"type": "message", "role": "assistant", "status": "in_progress",   # vLLM continues it
                "content": [{"type": "output_text", "text": "Par", "annotations": []}]}]},
    {"input": [{"type": "item_reference", "id": "msg_1"}]},
], ids=lambda change: next(iter(change)))
def test_what_vllm_would_convert_differently_is_left_alone(change):
    with pytest.raises(Unsupported):
        to_chat({"model": "m", "input": "q", **change})


_RANDOM_ID = re.compile(r"^(resp|msg|fc|rs)_[0-9a-f]{16}$")


def _ids_aside(obj):
    """The object with lightspan's random item and response ids as ``<prefix>_*``."""
    if isinstance(obj, dict):
        return {k: _ids_aside(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_ids_aside(v) for v in obj]
    if isinstance(obj, str) and _RANDOM_ID.match(obj):
        return obj.split("_")[0] + "_*"
    return obj


USAGE = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0,
                                                      "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
         "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                                       "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
         "total_tokens": 14}


def _envelope(**fields) -> dict:
    """The Response's fields as vLLM's ``ResponsesResponse.from_request`` fills them for a request
    that sets none of them."""
    return {"id": "resp_*", "created_at": 100, "incomplete_details": None, "instructions": None, "metadata": None,
            "model": "m", "object": "response", "output": [], "parallel_tool_calls": True, "temperature": 1.0,
            "tool_choice": "none", "tools": [], "top_p": 1.0, "background": False, "max_output_tokens": None,
            "max_tool_calls": None, "previous_response_id": None, "prompt": None, "reasoning": None,
            "service_tier": "auto", "status": "completed", "text": None, "top_logprobs": None,
            "truncation": "disabled", "usage": USAGE, "user": None, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "kv_transfer_params": None, "ec_transfer_params": None,
            "input_messages": None, "output_messages": None, **fields}


def _completion(message: dict, finish: str) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 100, "model": "m",
            "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14},
            "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                         "message": {"role": "assistant", "reasoning": None, "tool_calls": [], **message}}]}


def _message(text: str) -> dict:
    return {"id": "msg_*", "type": "message", "role": "assistant", "status": "completed", "phase": None,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}]}


def _function_call(call_id: str, a: int, status: str = "completed", arguments: str | None = None) -> dict:
    return {"type": "function_call", "id": "fc_*", "call_id": call_id, "name": "add",
            "arguments": f'{{"a": {a}}}' if arguments is None else arguments, "status": status,
            "async": None, "caller": None, "namespace": None}


def test_a_text_answer_becomes_the_response():
    chat = _completion({"content": "Hello."}, "stop")
    body = {"model": "m", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0,
            "metadata": {"k": "v"}, "user": "u"}
    assert _ids_aside(to_response(chat, body)) == _envelope(
        output=[_message("Hello.")], instructions="Be brief.", max_output_tokens=9, temperature=0.0,
        metadata={"k": "v"}, user="u")
    # cut at its length limit, the response is incomplete
    cut = to_response(_completion({"content": "Hel"}, "length"), {"model": "m", "input": "hi"})
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})


def test_a_tool_call_answer_becomes_the_response():
    body = {"model": "m", "input": "hi", "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    only = to_response(_completion({"content": None, "tool_calls": [_call("c1", 1)]}, "tool_calls"), body)
    assert _ids_aside(only) == _envelope(output=[_function_call("c1", 1)], tools=[TOOL], tool_choice="required",
                                         parallel_tool_calls=False)
    both = to_response(_completion({"content": "Adding.", "reasoning": "hm",
                                    "tool_calls": [_call("c1", 1), _call("c2", 2)]}, "tool_calls"), body)
    assert _ids_aside(both["output"]) == [
        {"id": "rs_*", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}],
         "encrypted_content": None, "status": None},
        _message("Adding."), _function_call("c1", 1), _function_call("c2", 2)]
    assert len({item["id"] for item in both["output"]}) == 4


def test_usage_is_the_chat_answers():
    assert usage(None) is None
    cached = usage({"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 8}})
    assert cached == {**USAGE, "input_tokens_details": {**USAGE["input_tokens_details"], "cached_tokens": 8}}


def _chunk(delta=None, finish=None, usage=None, choices=True) -> dict:
    out = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 100, "model": "m", "usage": usage}
    out["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if choices else []
    return out


def _stream_events(body: dict, chunks: list) -> list:
    stream = ResponseStream(body)
    events = [e for c in chunks for e in stream.feed(c)] + stream.done()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert stream.response is events[-1]["response"]
    return _ids_aside([{k: v for k, v in e.items() if k != "sequence_number"} for e in events])


def test_chat_chunks_become_the_event_stream():
    """Text, then two tool calls, as vLLM's ``SimpleStreamingEventProcessor`` writes them: one output
    item at a time, each closed (``…done``) before the next opens."""
    body = {"model": "m", "input": "hi", "tools": [TOOL], "stream": True}
    chunks = [_chunk({"role": "assistant", "content": ""}),
              _chunk({"content": "Hi"}), _chunk({"content": " there"}),
              _chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                      "function": {"name": "add", "arguments": ""}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
              _chunk({"tool_calls": [{"index": 1, "id": "c2", "type": "function",
                                      "function": {"name": "add", "arguments": '{"a": 2}'}}]}, finish="tool_calls"),
              _chunk(usage={"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}, choices=False)]
    initial = _envelope(status="in_progress", usage=None, created_at=100, tools=[TOOL], tool_choice="auto")
    text_part = {"type": "output_text", "text": "Hi there", "annotations": [], "logprobs": None}
    message = {**_message("Hi there"), "content": [text_part]}
    msg = {"item_id": "msg_*", "output_index": 0, "content_index": 0}
    final = {**initial, "status": "completed", "usage": USAGE,
             "output": [message, _function_call("c1", 1), _function_call("c2", 2)]}
    assert _stream_events(body, chunks) == [
        {"type": "response.created", "response": initial},
        {"type": "response.in_progress", "response": initial},
        {"type": "response.output_item.added", "output_index": 0, "item": {
            "id": "msg_*", "type": "message", "role": "assistant", "status": "in_progress", "content": [], "phase": None}},
        {"type": "response.content_part.added", **msg, "part": {
            "type": "output_text", "text": "", "annotations": [], "logprobs": []}},
        {"type": "response.output_text.delta", **msg, "delta": "Hi", "logprobs": []},
        {"type": "response.output_text.delta", **msg, "delta": " there", "logprobs": []},
        {"type": "response.output_text.done", **msg, "text": "Hi there", "logprobs": []},
        {"type": "response.content_part.done", **msg, "part": text_part},
        {"type": "response.output_item.done", "output_index": 0, "item": message},
        {"type": "response.output_item.added", "output_index": 1, "item": _function_call("c1", 0, "in_progress", "")},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_*", "output_index": 1, "delta": '{"a": '},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_*", "output_index": 1, "delta": "1}"},
        {"type": "response.function_call_arguments.done", "item_id": "fc_*", "output_index": 1, "name": "add",
         "arguments": '{"a": 1}'},
        {"type": "response.output_item.done", "output_index": 1, "item": _function_call("c1", 1)},
        {"type": "response.output_item.added", "output_index": 2, "item": _function_call("c2", 0, "in_progress", "")},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_*", "output_index": 2, "delta": '{"a": 2}'},
        {"type": "response.function_call_arguments.done", "item_id": "fc_*", "output_index": 2, "name": "add",
         "arguments": '{"a": 2}'},
        {"type": "response.output_item.done", "output_index": 2, "item": _function_call("c2", 2)},
        {"type": "response.completed", "response": final}]


def test_a_reasoning_stream_cut_at_its_length_limit():
    body = {"model": "m", "input": "hi", "stream": True, "max_output_tokens": 3}
    chunks = [_chunk({"role": "assistant", "content": ""}), _chunk({"reasoning": "hm"}),
              _chunk({"content": "O"}, finish="length"),
              _chunk(usage={"prompt_tokens": 10, "completion_tokens": 4}, choices=False)]
    events = _stream_events(body, chunks)
    rs = {"item_id": "rs_*", "output_index": 0, "content_index": 0}
    reasoning = {"id": "rs_*", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}],
                 "encrypted_content": None, "status": "completed"}
    assert events[2:8] == [
        {"type": "response.output_item.added", "output_index": 0, "item": {
            "id": "rs_*", "type": "reasoning", "summary": [], "content": None, "encrypted_content": None,
            "status": "in_progress"}},
        {"type": "response.content_part.added", **rs, "part": {"type": "reasoning_text", "text": ""}},
        {"type": "response.reasoning_text.delta", **rs, "delta": "hm"},
        {"type": "response.reasoning_text.done", **rs, "text": "hm"},
        {"type": "response.content_part.done", **rs, "part": {"type": "reasoning_text", "text": "hm"}},
        {"type": "response.output_item.done", "output_index": 0, "item": reasoning}]
    assert [e["type"] for e in events[8:]] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert (final["status"], final["incomplete_details"], final["max_output_tokens"]) == (
        "incomplete", {"reason": "max_output_tokens"}, 3)
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]


def _random_stream(rng) -> list:
    """A chat stream as vLLM sends it with ids and logprobs: text, reasoning and tool calls in a
    random order, some chunks with two tokens, a finish, the usage chunk."""
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
            deltas.append({"tool_calls": [{"index": tool - 1, "id": f"c{tool}", "type": "function",
                                           "function": {"name": "add", "arguments": ""}}]})
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


def test_the_one_pass_conversion_of_a_text_chunk_is_the_general_ones():
    """``ConvertedCapture.events`` reads and converts a one-token text chunk in one pass: the events,
    the ids and the logprobs are those of the general path's (``Capture.add_json`` and
    ``ResponseStream.feed``), and every token has its logprob."""
    from lightspan.tracing.protocols.responses import ResponsesCapture

    body = {"model": "m", "input": "x", "stream": True, "tools": [TOOL]}
    rng = random.Random(7)
    for _ in range(300):
        chunks = _random_stream(rng)
        fast, general = ResponsesCapture.for_request(body), ResponsesCapture.for_request(body)
        got = [e for c in copy.deepcopy(chunks) for e in fast.events(c)] + fast.end()
        expected = []
        for c in copy.deepcopy(chunks):
            general.chat.add_json(c)
            expected += [(e["type"], e) for e in general.stream.feed(c)]
        expected += general.end()
        assert _ids_aside(got) == _ids_aside(expected)
        assert fast.attributes(1) == general.attributes(1) and fast.status() == "ok"
        assert fast.response["output"] == [e["item"] for _, e in got if e["type"] == "response.output_item.done"]
