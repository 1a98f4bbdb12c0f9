"""The stub server of bench/capture_overhead.py: vLLM 0.32's answers, canned, field for field.

``python bench/capture_stub.py PORT --prompt-tokens N --completion-tokens M`` serves, on loopback:

- ``POST /v1/chat/completions``: a chat completion (or one SSE chunk per token), with
  ``prompt_token_ids``, ``token_ids`` and per-token ``logprobs`` when the request asks for them
  and ``null`` when it does not; with ``stream_options.include_usage`` a last chunk with the usage;
- ``POST /v1/responses``: a Responses answer (or its event stream: created, in_progress, the item
  and part events, one text delta per token, completed), with ``input_messages`` /
  ``output_messages`` when the request has ``enable_response_messages`` and the output text's
  logprobs when ``include`` asks for them;
- ``POST /v1/messages``: the Anthropic message vLLM's own route answers (or its event stream),
  which carries no ids.

Recorded shapes, not a model: the stub answers instantly, so the client's side is all there is to
time. ``--ids-for-all`` sends the ids to every request, as if each had asked.
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "policy"


def _sse(events, named: bool = False) -> bytes:
    out = []
    for e in events:
        head = f"event: {e['type']}\n".encode() if named else b""
        out.append(head + b"data: " + json.dumps(e).encode() + b"\n\n")
    return b"".join(out)


def bodies(prompt_tokens: int, completion_tokens: int) -> dict:
    """Canned bodies keyed by (api, stream?, ids?, logprobs?, usage chunk?)."""
    prompt_ids = [(i * 7919) % 50_000 for i in range(prompt_tokens)]
    ids = [(i * 104_729) % 50_000 for i in range(completion_tokens)]
    tokens = [f"tok{i}" for i in range(completion_tokens)]
    text = "".join(tokens)
    content = [{"token": t, "logprob": -0.1 - (i % 17) * 0.173, "bytes": list(t.encode()), "top_logprobs": []}
               for i, t in enumerate(tokens)]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
             "completion_tokens": completion_tokens, "prompt_tokens_details": None, "completion_tokens_details": None}
    head = {"id": "chatcmpl-bench", "created": 1_796_000_000, "model": MODEL}
    out = {}
    for with_ids in (False, True):
        for lp in (False, True):
            full = {**head, "object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                        "annotations": None, "audio": None, "function_call": None, "reasoning": None},
                "logprobs": {"content": content} if lp else None, "finish_reason": "length",
                "stop_reason": None, "token_ids": ids if with_ids else None, "routed_experts": None}],
                "service_tier": None, "system_fingerprint": "vllm-0.32.0", "usage": usage, "prompt_logprobs": None,
                "prompt_token_ids": prompt_ids if with_ids else None, "prompt_text": None,
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
            out[("chat", False, with_ids, lp, False)] = json.dumps(full).encode()
            for with_usage in (False, True):
                chunks = [{**head, "object": "chat.completion.chunk", "choices": [{
                    "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                    "prompt_token_ids": prompt_ids if with_ids else None, "prompt_text": None}]
                for i, t in enumerate(tokens):
                    chunks.append({**head, "object": "chat.completion.chunk", "choices": [{
                        "index": 0, "delta": {"content": t}, "logprobs": {"content": [content[i]]} if lp else None,
                        "finish_reason": "length" if i == len(tokens) - 1 else None, "stop_reason": None,
                        "token_ids": [ids[i]] if with_ids else None}], "system_fingerprint": "vllm-0.32.0"})
                if with_usage:
                    for i, c in enumerate(chunks):
                        c["usage"] = {**usage, "completion_tokens": i, "total_tokens": prompt_tokens + i}
                    chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})
                out[("chat", True, with_ids, lp, with_usage)] = _sse(chunks) + b"data: [DONE]\n\n"
            out[("responses", False, with_ids, lp, False)], out[("responses", True, with_ids, lp, False)] = _responses(
                prompt_ids, ids, tokens, content, with_ids, lp)
    message = {"id": "chatcmpl-bench", "type": "message", "role": "assistant", "content": [{"type": "text", "text": text}],
               "model": MODEL, "stop_reason": "max_tokens", "usage": {"input_tokens": prompt_tokens,
                                                                       "output_tokens": completion_tokens}}
    out[("messages", False, False, False, False)] = json.dumps(message).encode()
    start = {"type": "message_start", "message": {**message, "content": [], "stop_reason": None, "stop_sequence": None,
                                                  "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}
    events = [start, {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}]
    events += [{"type": "content_block_delta", "delta": {"type": "text_delta", "text": t}, "index": 0} for t in tokens]
    events += [{"type": "content_block_stop", "index": 0},
               {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens}},
               {"type": "message_stop"}]
    out[("messages", True, False, False, False)] = _sse(events, named=True)
    return out


def _responses(prompt_ids, ids, tokens, content, with_ids: bool, lp: bool) -> tuple[bytes, bytes]:
    text = "".join(tokens)
    part = {"annotations": [], "text": text, "type": "output_text",
            "logprobs": [{**c, "top_logprobs": []} for c in content] if lp else None}
    item = {"id": "msg_bench", "content": [part], "role": "assistant", "status": "completed", "type": "message",
            "phase": None}
    response = {"id": "resp_bench", "created_at": 1_796_000_000, "incomplete_details": {"reason": "max_output_tokens"},
                "instructions": None, "metadata": None, "model": MODEL, "object": "response", "output": [item],
                "parallel_tool_calls": True, "temperature": 0.7, "tool_choice": "none", "tools": [], "top_p": 1.0,
                "background": False, "max_output_tokens": len(ids), "max_tool_calls": None,
                "previous_response_id": None, "prompt": None, "reasoning": None, "service_tier": "auto",
                "status": "incomplete", "text": None, "top_logprobs": 0, "truncation": "disabled",
                "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(ids),
                          "total_tokens": len(prompt_ids) + len(ids),
                          "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
                "user": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "kv_transfer_params": None,
                "ec_transfer_params": None,
                "input_messages": [{"message": "<prompt>", "tokens": prompt_ids, "type": "raw_message_tokens"}]
                if with_ids else None,
                "output_messages": [{"message": text, "tokens": ids, "type": "raw_message_tokens"}] if with_ids else None}
    early = {**response, "output": [], "status": "in_progress", "usage": None, "incomplete_details": None,
             "input_messages": None, "output_messages": None}
    events = [{"response": early, "sequence_number": 0, "type": "response.created"},
              {"response": early, "sequence_number": 1, "type": "response.in_progress"},
              {"item": {**item, "content": [], "status": "in_progress"}, "output_index": 0, "sequence_number": 2,
               "type": "response.output_item.added"},
              {"content_index": 0, "item_id": "msg_bench", "output_index": 0, "part": {**part, "text": "",
               "logprobs": []}, "sequence_number": 3, "type": "response.content_part.added"}]
    for i, t in enumerate(tokens):
        events.append({"content_index": 0, "delta": t, "item_id": "msg_bench",
                       "logprobs": [{"token": t, "logprob": content[i]["logprob"], "top_logprobs": []}] if lp else [],
                       "output_index": 0, "sequence_number": 4 + i, "type": "response.output_text.delta"})
    n = 4 + len(tokens)
    events += [{"content_index": 0, "item_id": "msg_bench", "logprobs": [], "output_index": 0, "sequence_number": n,
                "text": text, "type": "response.output_text.done"},
               {"content_index": 0, "item_id": "msg_bench", "output_index": 0, "part": part, "sequence_number": n + 1,
                "type": "response.content_part.done"},
               {"item": item, "output_index": 0, "sequence_number": n + 2, "type": "response.output_item.done"},
               {"response": response, "sequence_number": n + 3, "type": "response.completed"}]
    return json.dumps(response).encode(), _sse(events, named=True)


def answer(canned: dict, path: str, request: dict, ids_for_all: bool = False) -> tuple[str, bytes]:
    """(content type, body) of the canned answer (:func:`bodies`) to ``request`` posted to ``path``
    (the server's, and bench/capture_opcodes.py's mocked transport's)."""
    stream = bool(request.get("stream"))
    if path.endswith("/responses"):
        key = ("responses", stream, ids_for_all or bool(request.get("enable_response_messages")),
               "message.output_text.logprobs" in (request.get("include") or ()), False)
    elif path.endswith("/messages"):
        key = ("messages", stream, False, False, False)
    else:
        usage = stream and bool((request.get("stream_options") or {}).get("include_usage"))
        key = ("chat", stream, ids_for_all or bool(request.get("return_token_ids")), bool(request.get("logprobs")),
               usage)
    return ("text/event-stream" if stream else "application/json"), canned[key]


def serve(port: int, prompt_tokens: int, completion_tokens: int, ids_for_all: bool = False) -> None:
    canned = bodies(prompt_tokens, completion_tokens)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall

        def log_message(self, *args):
            pass

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            content_type, body = answer(canned, self.path, request, ids_for_all)
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("port", type=int)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--completion-tokens", type=int, default=64)
    p.add_argument("--ids-for-all", action="store_true")
    a = p.parse_args()
    serve(a.port, a.prompt_tokens, a.completion_tokens, a.ids_for_all)
