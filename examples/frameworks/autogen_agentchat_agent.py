"""An AutoGen AgentChat tutor that consults two expert agents through ``AgentTool``, streamed, over a
two-turn conversation: the task's question, then a follow-up that builds on the answer. It knows
nothing about lightspan. Every agent calls a model named ``gpt-4.1``; under ``lightspan rollout``
serve the policy under that name (``lightspan vllm --aliases gpt-4.1``). AutoGen's core pins
``protobuf~=5.29``, so it runs from an environment of its own:

    pip install lightspan autogen-agentchat "autogen-ext[openai]"
    lightspan rollout --tasks tasks.jsonl -- /path/to/that/env/bin/python examples/frameworks/autogen_agentchat_agent.py

AutoGen traces itself with OpenTelemetry: each agent's turn is an ``invoke_agent NAME`` span
(``gen_ai.agent.name``), so a call belongs to ``tutor`` or to the expert it asked. The task's
``prompt`` and ``follow_up`` are the two questions (defaults otherwise). It emits no reward: a
grader posts one per rollout (``POST /v1/rewards``).
"""

from __future__ import annotations

import asyncio
import json
import os

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.tools import AgentTool
from autogen_agentchat.ui import Console
from autogen_ext.models.openai import OpenAIChatCompletionClient

MODEL = "gpt-4.1"


def expert(name: str, field: str, client: OpenAIChatCompletionClient) -> AgentTool:
    """An assistant that knows ``field``, as a tool another agent can call with a task."""
    agent = AssistantAgent(name, model_client=client, description=f"An expert in {field}.",
                           system_message=f"You are an expert in {field}. Answer briefly and show the key step.",
                           model_client_stream=True)
    return AgentTool(agent, return_value_as_last_message=True)


async def main(question: str, follow_up: str) -> None:
    experts = OpenAIChatCompletionClient(model=MODEL)
    # AgentTool's experts keep state between calls: the agent that calls them must not call two at once
    lead = OpenAIChatCompletionClient(model=MODEL, parallel_tool_calls=False)
    tutor = AssistantAgent(
        "tutor", model_client=lead, model_client_stream=True, max_tool_iterations=4,
        tools=[expert("statistician", "statistics", experts), expert("geometer", "geometry", experts)],
        system_message="You tutor a student. Ask the statistician or the geometer when a question is theirs, "
                       "then explain their answer in one or two sentences.")
    # the tutor keeps the conversation: the second question builds on the first answer
    await Console(tutor.run_stream(task=question))
    await Console(tutor.run_stream(task=follow_up))
    await asyncio.gather(experts.close(), lead.close())


if __name__ == "__main__":
    task = json.loads(os.environ.get("LIGHTSPAN_TASK", "{}"))
    asyncio.run(main(task.get("prompt", "What is the mean of 4, 8 and 9?"),
                     task.get("follow_up", "What is the area of a circle with that radius?")))
