"""An OpenAI Agents SDK agent (``openai-agents``) that knows nothing about lightspan but its reward: a
run, then a streamed run that continues the conversation. Run it unchanged, once per task sample:

    lightspan rollout --tasks tasks.jsonl --samples 4 -- python examples/frameworks/openai_agents_agent.py

The model is ``OpenAIChatCompletionsModel`` on an ``AsyncOpenAI`` client (``OPENAI_BASE_URL`` is the
vLLM server): vLLM's chat completions give a logprob for every token, which its Responses API (the
SDK's default model, captured too: openai_agents_tools.py) does not in streams. The SDK's own
tracing exports to OpenAI's servers; it is switched off here
(``OPENAI_AGENTS_DISABLE_TRACING=1`` does the same), and OpenTelemetry's instrumentation of the
``openai`` client records the calls instead. A task line looks like
``{"id": "add-1", "prompt": "What is 2 + 3?", "answer": "5"}``.
"""

from __future__ import annotations

import asyncio
import json
import os

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

from lightspan.tracing import emit_reward

MODEL = os.environ.get("AGENT_MODEL", "policy")


async def solve(task: dict) -> tuple[str, str]:
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI())
    solver = Agent(name="solver", instructions="You solve arithmetic problems.", model=model,
                   model_settings=ModelSettings(max_tokens=int(task.get("max_tokens", 16)),
                                                temperature=float(task.get("temperature", 0.7))))
    # 1. think: an ordinary run
    first = await Runner.run(solver, task["prompt"])
    # 2. answer: a streamed run continuing the same conversation
    follow_up = first.to_input_list() + [{"role": "user", "content": "Now give only the final answer."}]
    streamed = Runner.run_streamed(solver, follow_up)
    async for _ in streamed.stream_events():
        pass
    return str(first.final_output or ""), str(streamed.final_output or "")


def main() -> float:
    set_tracing_disabled(True)  # the SDK's exporter would send traces to OpenAI's servers
    task = json.loads(os.environ.get("LIGHTSPAN_TASK", '{"id": "demo", "prompt": "What is 2 + 3?", "answer": "5"}'))
    thought, answer = asyncio.run(solve(task))
    expected = str(task.get("answer", ""))
    reward = float(bool(expected) and expected in answer)
    emit_reward(reward)
    print(json.dumps({"task": task["id"], "calls": 2, "thought": thought, "answer": answer, "reward": reward}))
    return reward


if __name__ == "__main__":
    main()
