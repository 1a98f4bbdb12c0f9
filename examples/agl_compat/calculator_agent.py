"""A calculator agent in Agent Lightning's runner shape: an AutoGen AgentChat assistant whose tool is
the calculator MCP server (``mcp-server-calculator``, started over stdio), configured by
environment variables only, posting its own score as a reward event. It imports nothing of
lightspan; ``lightspan rollout`` runs it unchanged (README.md here):

    lightspan rollout --tasks calc.jsonl --env-map QUESTION=input.question,RESULT=input.result \\
        -- python examples/agl_compat/calculator_agent.py

It reads ``QUESTION`` and ``RESULT`` (the task), ``AGL_OPENAI_BASE_URL`` and ``AGL_KEY`` (the
policy's endpoint and key) and ``AGL_EVENT_URL`` (where the reward event goes). The MCP server is
started as ``python -m mcp_server_calculator``: the runner puts the agent's environment first on
``PATH``, so that ``python`` has the server installed. AutoGen traces itself, so the LLM calls
belong to the agent ``calculator``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.request
from fractions import Fraction

from autogen_agentchat.agents import AssistantAgent
from autogen_core.models import ModelFamily, ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient
from autogen_ext.tools.mcp import McpWorkbench, StdioServerParams

MODEL = "auto"     # the name the agent asks for; serve the policy under it (lightspan vllm --aliases auto)
# a served policy is no model AutoGen knows by name: say what it can do
POLICY = ModelInfo(vision=False, function_calling=True, json_output=False, structured_output=False,
                   family=ModelFamily.UNKNOWN)
SYSTEM = ("You solve math problems. Do every computation with the calculate tool. When you are done, "
          "write the result on a last line as 'Result: <value>'.")


def close_enough(reply: str, expected: str, rel_tol: float = 1e-2) -> bool:
    """Whether the value after the reply's last ``Result:`` is ``expected``: as numbers (fractions and
    decimals alike, within ``rel_tol``), else as the same text ignoring case and spaces."""
    found = re.findall(r"result\s*:\s*([^\n]+)", reply, flags=re.IGNORECASE)
    answer = found[-1] if found else reply
    clean = [s.replace(",", "").strip().rstrip(".").lower() for s in (answer, expected)]
    try:
        got, want = (Fraction(s) for s in clean)
    except ValueError:
        return clean[0].replace(" ", "") == clean[1].replace(" ", "")
    return abs(got - want) <= rel_tol * abs(want)


def post_reward(value: float) -> None:
    """Send the reward event of this rollout to ``AGL_EVENT_URL``, with ``AGL_KEY`` as the bearer token."""
    body = json.dumps({"event_type": "reward", "data": {"value": value}}).encode()
    request = urllib.request.Request(os.environ["AGL_EVENT_URL"], data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {os.environ['AGL_KEY']}"})
    with urllib.request.urlopen(request, timeout=30):
        pass


async def solve(question: str) -> str:
    client = OpenAIChatCompletionClient(model=MODEL, base_url=os.environ["AGL_OPENAI_BASE_URL"],
                                        api_key=os.environ["AGL_KEY"], model_info=POLICY)
    server = StdioServerParams(command="python", args=["-m", "mcp_server_calculator"], read_timeout_seconds=60)
    async with McpWorkbench(server) as calculator:
        agent = AssistantAgent("calculator", model_client=client, workbench=calculator, system_message=SYSTEM,
                               max_tool_iterations=8, reflect_on_tool_use=True)
        result = await agent.run(task=question)
    await client.close()
    return result.messages[-1].to_text()


if __name__ == "__main__":
    reply = asyncio.run(solve(os.environ["QUESTION"]))
    print(reply)
    post_reward(float(close_enough(reply, os.environ["RESULT"])))
