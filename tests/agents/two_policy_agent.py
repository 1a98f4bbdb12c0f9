"""Toy two-agent workflow for the several-policies test: a writer and a checker, each an agent span
(``invoke_agent``, ``gen_ai.agent.name``) around its own chat call, each calling its own policy by
model name (``WRITER_MODEL``, ``CHECKER_MODEL``: the policies' names). Reward: the share of ASCII
letters in the two completions."""

import json
import os

from openai import OpenAI
from opentelemetry import trace

from lightspan.tracing import emit_reward

task = json.loads(os.environ["LIGHTSPAN_TASK"])
client = OpenAI()
tracer = trace.get_tracer("two_policy_agent")
texts = []
for agent, model in (("writer", os.environ.get("WRITER_MODEL", "policy")),
                     ("checker", os.environ.get("CHECKER_MODEL", "policy"))):
    with tracer.start_as_current_span(f"invoke_agent {agent}", attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent}):
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": task["prompt"] + " ".join(texts)}],
            max_tokens=int(task.get("max_tokens", 8)), temperature=float(task.get("temperature", 1.0)))
        texts.append(response.choices[0].message.content or "")
reward = sum(c.isascii() and c.isalpha() for c in "".join(texts)) / (2 * int(task.get("max_tokens", 8)))
emit_reward(reward)
print(json.dumps({"task": task["id"], "reward": reward}))
