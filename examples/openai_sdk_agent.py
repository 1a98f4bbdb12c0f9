"""An agent on the plain ``openai`` SDK — a sync call, a streamed one, async calls in parallel —
that knows nothing about lightspan but its reward. Run it unchanged, once per task sample:

    lightspan rollout --tasks tasks.jsonl --samples 4 -- python examples/openai_sdk_agent.py

``lightspan rollout`` starts it under ``opentelemetry-instrument`` with ``OPENAI_BASE_URL`` (the vLLM
server), the task in ``LIGHTSPAN_TASK`` and the rollout/task ids in ``OTEL_RESOURCE_ATTRIBUTES``:
every call's token ids land on its span, and all of them share the rollout id. A task line looks
like ``{"id": "add-1", "prompt": "What is 2 + 3?", "answer": "5"}``.
"""

from __future__ import annotations

import asyncio
import json
import os

from openai import AsyncOpenAI, OpenAI

from lightspan.tracing import emit_reward

MODEL = os.environ.get("AGENT_MODEL", "policy")


async def _critiques(messages: list[dict], n: int) -> list[str]:
    client = AsyncOpenAI()
    replies = await asyncio.gather(*[
        client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0.7, messages=[
            *messages, {"role": "user", "content": "Is that right? Answer yes or no."}])
        for _ in range(n)])
    return [r.choices[0].message.content or "" for r in replies]


def main() -> float:
    task = json.loads(os.environ.get("LIGHTSPAN_TASK", '{"id": "demo", "prompt": "What is 2 + 3?", "answer": "5"}'))
    client = OpenAI()
    messages = [{"role": "user", "content": task["prompt"]}]

    # 1. think: one ordinary call
    thought = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.7)
    messages += [{"role": "assistant", "content": thought.choices[0].message.content or ""},
                 {"role": "user", "content": "Now give only the final answer."}]

    # 2. answer: streamed, as a chat front end would read it
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.7,
                                            stream=True)
    answer = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    messages.append({"role": "assistant", "content": answer})

    # 3. check: two async calls at once
    votes = asyncio.run(_critiques(messages, n=2))

    expected = str(task.get("answer", ""))
    reward = float(bool(expected) and expected in answer)
    emit_reward(reward)
    print(json.dumps({"task": task["id"], "answer": answer, "votes": votes, "reward": reward}))
    return reward


if __name__ == "__main__":
    main()
