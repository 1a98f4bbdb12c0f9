"""An OpenAI Agents SDK agent as its users write one, with the SDK's tracing left on (its default):
traceloop's Agents SDK instrumentation (the ``frameworks`` extra) turns the SDK's agent spans
into OpenTelemetry ones, so the call is attributed to ``Agent.name``. The model is chat
completions on the environment's client (``OPENAI_BASE_URL``). The SDK's own exporter to
OpenAI's servers fails offline and says so (``[non-fatal] Tracing request failed``)."""

import asyncio
import json
import os

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
from openai import AsyncOpenAI

from lightspan.tracing import emit_reward


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


task = json.loads(os.environ["LIGHTSPAN_TASK"])
agent = Agent(name="calculator", instructions="You add numbers with the add tool.", tools=[add],
              model=OpenAIChatCompletionsModel(model="gpt-4o-mini", openai_client=AsyncOpenAI()),
              model_settings=ModelSettings(max_tokens=int(task.get("max_tokens", 16))))
result = asyncio.run(Runner.run(agent, task["prompt"], max_turns=3))
emit_reward(float(task["answer"] in str(result.final_output)))
