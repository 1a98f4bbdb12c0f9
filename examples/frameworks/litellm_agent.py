"""A LiteLLM agent (``litellm.completion`` with the ``openai/`` provider and ``api_base``) that knows
nothing about lightspan but its reward: a call, a streamed call and two async calls at once. Run it
unchanged, once per task sample:

    lightspan rollout --tasks tasks.jsonl --samples 4 -- python examples/frameworks/litellm_agent.py

LiteLLM's ``openai/`` provider builds an ``openai`` client but calls ``client.post("/chat/completions",
...)`` itself, bypassing ``chat.completions.create``: the OpenAI instrumentation (which wraps
``create``) makes no span for it. lightspan's instrumentor wraps ``post``, so it still captures the
call: it opens the GenAI span itself (``chat <model>``, scope ``lightspan.instrumentor``) and records
the token ids there. For a non-Python agent, or a LiteLLM configured with a transport of its own,
point ``api_base`` at ``lightspan gateway`` instead. A task line looks like
``{"id": "add-1", "prompt": "What is 2 + 3?", "answer": "5"}``.
"""

from __future__ import annotations

import asyncio
import json
import os

# LiteLLM fetches its model price list from the internet at import unless told to use its bundled
# copy: a vLLM-backed agent has no use for hosted prices, and its host may have no internet.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm

from lightspan.tracing import emit_reward

MODEL = os.environ.get("AGENT_MODEL", "policy")


def main() -> float:
    task = json.loads(os.environ.get("LIGHTSPAN_TASK", '{"id": "demo", "prompt": "What is 2 + 3?", "answer": "5"}'))
    params = {"model": f"openai/{MODEL}", "api_base": os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
              "api_key": os.environ.get("OPENAI_API_KEY", "none"), "max_tokens": int(task.get("max_tokens", 16)),
              "temperature": float(task.get("temperature", 0.7))}
    messages = [{"role": "user", "content": task["prompt"]}]

    # 1. think
    thought = litellm.completion(messages=messages, **params).choices[0].message.content or ""
    messages += [{"role": "assistant", "content": thought},
                 {"role": "user", "content": "Now give only the final answer."}]

    # 2. answer: streamed
    stream = litellm.completion(messages=messages, stream=True, **params)
    answer = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    messages.append({"role": "assistant", "content": answer})

    # 3. check: two async calls at once
    async def votes():
        check = [*messages, {"role": "user", "content": "Is that right? Answer yes or no."}]
        replies = await asyncio.gather(*[litellm.acompletion(messages=check, **params) for _ in range(2)])
        return [r.choices[0].message.content or "" for r in replies]

    expected = str(task.get("answer", ""))
    reward = float(bool(expected) and expected in answer)
    result = {"task": task["id"], "calls": 4, "answer": answer, "votes": asyncio.run(votes()), "reward": reward}
    emit_reward(reward)
    print(json.dumps(result))
    return reward


if __name__ == "__main__":
    main()
