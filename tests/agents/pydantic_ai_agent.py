"""A pydantic-ai agent as its users write one: a structured output type on the ``openai:`` model,
which is the Responses API, and whose output tool makes every answer a tool-call-only reply
(``final_result``, with ``tool_choice: required``, which vLLM enforces with the tool parser's
grammar). The tiny test model's context is 1024 byte tokens and the output tool's schema is
rendered into its prompt, so the prompt and the output type are tiny and the reply is capped; inside
the grammar the random model would write whitespace until the cap, so a logit bias (the model's
byte tokenizer: GPT-2's byte order) bans whitespace and favours ``}``, and one call is asked for
(``parallel_tool_calls``): the model then writes ``{"n":<digit>}`` and ends. With ``AGENT_STREAM`` set the reply is
streamed (``run_stream``). The output and the message history go to ``$AGENT_OUTPUT`` as JSON."""

import asyncio
import json
import os

from pydantic import BaseModel
from pydantic_ai import Agent

from lightspan.tracing import emit_reward


class Sum(BaseModel):
    n: int


task = json.loads(os.environ["LIGHTSPAN_TASK"])
SPACE, CR, LF, TAB, CLOSE = 220, 201, 198, 197, 92   # " ", "\r", "\n", "\t", "}"
BIAS = {str(t): -100 for t in (SPACE, CR, LF, TAB)} | {str(CLOSE): 100}
agent = Agent(f"openai:{os.environ.get('AGENT_MODEL', 'policy')}", output_type=Sum, retries=0,
              model_settings={"temperature": 0, "max_tokens": 120, "parallel_tool_calls": False,
                              "extra_body": {"logit_bias": BIAS}})


async def streamed():
    async with agent.run_stream(task["prompt"]) as run:
        return await run.get_output(), json.loads(run.all_messages_json())


if os.environ.get("AGENT_STREAM"):   # the reply streamed: a streamed tool-call-only Responses call
    output, history = asyncio.run(streamed())
else:
    result = agent.run_sync(task["prompt"])
    output, history = result.output, json.loads(result.all_messages_json())
with open(os.environ["AGENT_OUTPUT"], "w") as f:
    json.dump({"output": output.model_dump(), "messages": history}, f)
emit_reward(float(str(output.n) == task["answer"]))
