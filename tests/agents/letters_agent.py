"""Toy agent for the end-to-end test: the tiny random model is rewarded for the share of
ASCII letters in its completion, something GRPO can raise in a few steps."""

import json
import os

from openai import OpenAI

from lightspan.tracing import emit_reward

task = json.loads(os.environ["LIGHTSPAN_TASK"])
client = OpenAI()
response = client.chat.completions.create(
    model="policy", messages=[{"role": "user", "content": task["prompt"]}],
    max_tokens=int(task.get("max_tokens", 16)), temperature=float(task.get("temperature", 1.0)))
text = response.choices[0].message.content or ""
reward = sum(c.isascii() and c.isalpha() for c in text) / int(task.get("max_tokens", 16))
emit_reward(reward)
print(json.dumps({"task": task["id"], "reward": reward}))
