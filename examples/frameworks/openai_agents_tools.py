"""An OpenAI Agents SDK agent left on the SDK's defaults: no ``model`` given, so the SDK runs
``OpenAIResponsesModel`` (the Responses API) on its default client, with one function tool. It knows
nothing about lightspan; ``lightspan rollout`` runs it unchanged:

    OPENAI_DEFAULT_MODEL=policy OPENAI_AGENTS_DISABLE_TRACING=1 \\
        lightspan rollout --tasks tasks.jsonl -- python examples/frameworks/openai_agents_tools.py

``OPENAI_DEFAULT_MODEL`` is the model name the SDK asks for (or serve the SDK's default name:
``lightspan vllm --aliases``); the SDK's own tracing would export to OpenAI's servers, so it is off.
lightspan's instrumentor captures each Responses call (tests/tracing/test_protocol_agents.py); the
chat completions model has a logprob for every token, the Responses API not always
(examples/frameworks/openai_agents_agent.py uses that one). The task's ``prompt`` is the question:
``{"id": "sum-1", "prompt": "What is 2 + 3?"}``. It emits no reward: a grader scores the rollout.
"""

from __future__ import annotations

import json
import os

from agents import Agent, Runner, function_tool


@function_tool
def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


arithmetic = Agent(
    name="arithmetic",
    instructions="Answer arithmetic questions. Use the add tool for every sum rather than adding in your head.",
    tools=[add],
)


if __name__ == "__main__":
    task = json.loads(os.environ.get("LIGHTSPAN_TASK", '{"prompt": "What is 2 + 3?"}'))
    result = Runner.run_sync(arithmetic, task["prompt"])
    print(result.final_output)
