"""The agent of bench/rollout_overhead.py: three chat calls with the plain openai client (each
reply goes back into the conversation), then a reward span. No lightspan code but the optional
reward helper, as the demo's agent."""

import json
import os

from openai import OpenAI

try:
    from lightspan.tracing import emit_reward
except ImportError:  # pragma: no cover
    def emit_reward(value, **_):
        pass


def main() -> None:
    task = json.loads(os.environ["LIGHTSPAN_TASK"])
    client = OpenAI()
    messages = [{"role": "user", "content": task["question"]}]
    for turn in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=16,
                                               temperature=0.7).choices[0].message.content
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"Check step {turn}."}]
    emit_reward(1.0 if reply else 0.0)
    print(json.dumps({"task": task["id"], "turns": 3}))


if __name__ == "__main__":
    main()
