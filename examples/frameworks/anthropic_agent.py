"""A tool-using agent on the ``anthropic`` client that knows nothing about lightspan but its reward.

It asks the model to use an ``add`` tool (``tool_choice`` forces the call, ``strict`` its
arguments' schema), runs the tool, hands the result back as a ``tool_result`` block and streams
the answer (``messages.stream``). Run it unchanged, once per task sample:

    lightspan rollout --tasks tasks.jsonl --samples 4 -- python examples/frameworks/anthropic_agent.py

``lightspan rollout`` points ``ANTHROPIC_BASE_URL`` at the vLLM server; lightspan's instrumentor
sends the calls to vLLM's chat completions, converted as vLLM's ``/v1/messages`` converts them, so
they come back with token ids. A task line looks like
``{"id": "add-1", "prompt": "What is 2 + 3?", "answer": "5", "a": 2, "b": 3}``.
"""

from __future__ import annotations

import json
import os

import anthropic

from lightspan.tracing import emit_reward

MODEL = os.environ.get("AGENT_MODEL", "policy")
TOOLS = [{"name": "add", "description": "Add two integers.", "strict": True,
          "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"], "additionalProperties": False}}]


def add(a, b) -> str:
    try:
        return str(int(a) + int(b))
    except (TypeError, ValueError):
        return "error: a and b must be integers"


def solve(client: anthropic.Anthropic, task: dict) -> str:
    max_tokens = int(task.get("max_tokens", 96))
    messages = [{"role": "user", "content": task["prompt"]}]
    # 1. the tool call
    first = client.messages.create(model=MODEL, max_tokens=max_tokens, system="You add numbers with the add tool.",
                                   tools=TOOLS, tool_choice={"type": "tool", "name": "add"}, messages=messages)
    results = [{"type": "tool_result", "tool_use_id": block.id, "content": add(**block.input)}
               for block in first.content if block.type == "tool_use"]
    if not results:
        return "".join(block.text for block in first.content if block.type == "text")
    messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": results}]
    # 2. the answer, streamed
    with client.messages.stream(model=MODEL, max_tokens=max_tokens, system="You add numbers with the add tool.",
                                tools=TOOLS, messages=messages) as stream:
        return "".join(stream.text_stream)


def main() -> float:
    task = json.loads(os.environ.get("LIGHTSPAN_TASK", '{"id": "demo", "prompt": "What is 2 + 3?", "answer": "5"}'))
    answer = solve(anthropic.Anthropic(), task)
    expected = str(task.get("answer", ""))
    reward = float(bool(expected) and expected in answer)
    emit_reward(reward)
    print(json.dumps({"task": task["id"], "answer": answer, "reward": reward}))
    return reward


if __name__ == "__main__":
    main()
