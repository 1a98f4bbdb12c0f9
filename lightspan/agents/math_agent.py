"""A plain OpenAI-client agent that answers an arithmetic question: no lightspan code in it
except the optional reward helper.

Run it as lightspan does, unchanged, under OpenTelemetry's zero-code instrumentation:

    LIGHTSPAN_TASK='{"id": "t1", "question": "What is 12 + 30?", "answer": 42}' \\
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x \\
    opentelemetry-instrument python examples/math_agent.py    # runs this file (the demo's agent)

Reward: 1 when the last integer of the reply is the answer, plus 0.2 when that correct reply also
ends in the requested ``Answer: <number>`` form. The format bonus is gated on correctness: an
ungated one is learned instead of the arithmetic — SmolLM2 collapsed to "Answer: <wrong number>"
within 4 GRPO steps in our demo, as it did at temperature 1.0 in an earlier probe (docs/architecture.md,
Learning on CPU).
"""

import json
import os
import re

from openai import OpenAI

try:  # optional: the reward could equally be posted later by id
    from lightspan.tracing import emit_reward
except ImportError:  # pragma: no cover
    def emit_reward(value, **_):
        pass

INSTRUCTION = "End your reply with 'Answer: <number>'."


def score(reply: str, answer: int) -> float:
    numbers = re.findall(r"-?\d+", reply or "")
    correct = bool(numbers) and int(numbers[-1]) == int(answer)
    formatted = re.search(r"Answer:\s*-?\d+\s*\.?\s*$", (reply or "").strip()) is not None
    return (1.2 if formatted else 1.0) if correct else 0.0


def main() -> None:
    task = json.loads(os.environ["LIGHTSPAN_TASK"])
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    response = client.chat.completions.create(
        model=os.environ.get("AGENT_MODEL", "policy"),
        messages=[{"role": "user", "content": f"{task['question']} {INSTRUCTION}"}],
        max_tokens=int(task.get("max_tokens", 24)),
        temperature=float(task.get("temperature", 0.7)),
    )
    reply = response.choices[0].message.content
    reward = score(reply, task["answer"])
    emit_reward(reward)
    print(json.dumps({"task": task["id"], "reply": reply, "reward": reward}))


if __name__ == "__main__":
    main()
