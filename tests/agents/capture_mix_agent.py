"""Toy agent for the never-silent tests: one call of each capture outcome.

1. a chat call through its own base URL variable, spelled ``localhost`` (the runner's capture URL
   says 127.0.0.1): captured;
2. a chat call to ``OTHER_BASE_URL``, a server that is not a capture URL: not captured (other_url);
3. a Responses call answered with a tool call only: captured, sent as a chat completion, which
   has every token's logprob (structured outputs make the random model write the call);
4. two such calls that ask for the output text's logprobs themselves (``include``), which only
   vLLM's Responses route writes: they go there, and it gives logprobs for output text alone, none
   for a tool call (no_logprobs: the ids are captured, the logprobs not).
"""

import json
import os
import re

from openai import OpenAI

from lightspan.tracing import emit_reward

task = json.loads(os.environ["LIGHTSPAN_TASK"])
messages = [{"role": "user", "content": task["prompt"]}]
own = OpenAI(base_url=os.environ["OPENAI_BASE_URL"].replace("127.0.0.1", "localhost"))
own.chat.completions.create(model="policy", messages=messages, max_tokens=4)
OpenAI(base_url=os.environ["OTHER_BASE_URL"]).chat.completions.create(model="policy", messages=messages, max_tokens=4)
TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the weather.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'
for include in ([], ["message.output_text.logprobs"], ["message.output_text.logprobs"]):
    reply = own.responses.create(model="policy", input=task["prompt"], tools=TOOLS, max_output_tokens=120,
                                 include=include, extra_body={"structured_outputs": {"regex": re.escape(CALL)}})
    assert [item.type for item in reply.output] == ["function_call"], reply.output
emit_reward(0.5)
print(json.dumps({"task": task["id"]}))
