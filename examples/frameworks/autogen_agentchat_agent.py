# From microsoft/autogen's README.md, "Multi-Agent Orchestration" (commit
# 027ecf0a379bcc1d09956d46d12d44a3ad9cee14), unchanged below this header.
# Copyright (c) Microsoft Corporation. MIT License (the repository's LICENSE-CODE).
#
# An AutoGen AgentChat assistant with two expert agents as tools (AgentTool), streamed. Under
# `lightspan rollout` it needs nothing but a model named gpt-4.1 (`lightspan vllm --aliases
# gpt-4.1`) and its packages in its own environment (autogen-core pins protobuf~=5.29):
#     pip install lightspan autogen-agentchat "autogen-ext[openai]"
#     lightspan rollout --tasks tasks.jsonl -- /path/to/that/env/bin/python examples/frameworks/autogen_agentchat_agent.py
# AutoGen traces itself with OpenTelemetry: each call lies under its agent's `invoke_agent NAME`
# span (gen_ai.agent.name), so it is attributed to `assistant` (or the expert that made it).
# It emits no reward: a grader posts one per rollout (POST /v1/rewards).

import asyncio

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.tools import AgentTool
from autogen_agentchat.ui import Console
from autogen_ext.models.openai import OpenAIChatCompletionClient


async def main() -> None:
    model_client = OpenAIChatCompletionClient(model="gpt-4.1")

    math_agent = AssistantAgent(
        "math_expert",
        model_client=model_client,
        system_message="You are a math expert.",
        description="A math expert assistant.",
        model_client_stream=True,
    )
    math_agent_tool = AgentTool(math_agent, return_value_as_last_message=True)

    chemistry_agent = AssistantAgent(
        "chemistry_expert",
        model_client=model_client,
        system_message="You are a chemistry expert.",
        description="A chemistry expert assistant.",
        model_client_stream=True,
    )
    chemistry_agent_tool = AgentTool(chemistry_agent, return_value_as_last_message=True)

    agent = AssistantAgent(
        "assistant",
        system_message="You are a general assistant. Use expert tools when needed.",
        model_client=model_client,
        model_client_stream=True,
        tools=[math_agent_tool, chemistry_agent_tool],
        max_tool_iterations=10,
    )
    await Console(agent.run_stream(task="What is the integral of x^2?"))
    await Console(agent.run_stream(task="What is the molecular weight of water?"))


asyncio.run(main())
