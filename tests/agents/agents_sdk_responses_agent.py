"""An OpenAI Agents SDK agent on the SDK's default model, the Responses API (``OpenAIResponsesModel``,
which streams even under ``Runner.run`` in SDK 0.24), as its users write one: a turn that calls a
tool, then a turn on the whole history (``result.to_input_list()``), whose input carries back what
the first turn got. vLLM's structured outputs make the tiny model write the tool call
(tests/tracing/test_protocols.py, ``FORCED``). Both histories go to ``$AGENT_OUTPUT`` as JSON for the
test to compare with and without lightspan."""

import asyncio
import json
import os
import re

from agents import Agent, ModelSettings, Runner, function_tool

from lightspan.tracing import emit_reward

CALL_TEXT = '\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@function_tool(strict_mode=False)   # (a strict schema would override the forced call)
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


task = json.loads(os.environ["LIGHTSPAN_TASK"])
model = os.environ.get("AGENT_MODEL", "policy")
caller = Agent(name="calculator", instructions="You add numbers with the add tool.", tools=[add], model=model,
               tool_use_behavior="stop_on_first_tool",
               model_settings=ModelSettings(temperature=0, max_tokens=400,
                                            extra_body={"structured_outputs": {"regex": re.escape(CALL_TEXT)}}))
answerer = Agent(name="answerer", instructions="Answer briefly.", model=model,
                 model_settings=ModelSettings(temperature=0, max_tokens=40,
                                              extra_body={"structured_outputs": {"regex": "Five\\."}}))


async def main():
    first = await Runner.run(caller, task["prompt"], max_turns=2)
    second = await Runner.run(answerer, first.to_input_list() + [{"role": "user", "content": "So?"}], max_turns=1)
    return first, second

first, second = asyncio.run(main())
with open(os.environ["AGENT_OUTPUT"], "w") as f:
    json.dump({"first": first.to_input_list(), "second": second.to_input_list()}, f)
emit_reward(float(str(first.final_output) == task["answer"]))
