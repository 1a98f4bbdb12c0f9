"""A LangChain agent on ``ChatOpenAI`` (langchain-openai) that knows nothing about lightspan but its
reward: a chain call, a streamed call and two async calls at once. Run it unchanged, once per task
sample:

    lightspan rollout --tasks tasks.jsonl --samples 4 -- python examples/frameworks/langchain_agent.py

``lightspan rollout`` starts it under ``opentelemetry-instrument`` with ``OPENAI_BASE_URL`` (the vLLM
server, which ``ChatOpenAI`` reads through the ``openai`` client), the task in ``LIGHTSPAN_TASK`` and
the rollout/task ids in ``OTEL_RESOURCE_ATTRIBUTES``. ``ChatOpenAI`` calls the client through
``with_raw_response`` (non-streaming) and ``create(stream=True)``; lightspan's instrumentor records
the token ids of both on the call's one LLM span, whether that span is traceloop's ``openai.chat`` or,
with traceloop's LangChain instrumentation installed too, its ``ChatOpenAI.chat``. A task line looks
like ``{"id": "add-1", "prompt": "What is 2 + 3?", "answer": "5"}``.
"""

from __future__ import annotations

import asyncio
import json
import os

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_openai import ChatOpenAI

from lightspan.tracing import emit_reward

MODEL = os.environ.get("AGENT_MODEL", "policy")


def main() -> float:
    task = json.loads(os.environ.get("LIGHTSPAN_TASK", '{"id": "demo", "prompt": "What is 2 + 3?", "answer": "5"}'))
    max_tokens = int(task.get("max_tokens", 16))
    llm = ChatOpenAI(model=MODEL, max_tokens=max_tokens, temperature=float(task.get("temperature", 0.7)),
                     max_retries=0)

    # 1. think: a prompt | model | parser chain
    prompt = ChatPromptTemplate.from_messages([("system", "You solve arithmetic problems."), ("user", "{question}")])
    thought = (prompt | llm | StrOutputParser()).invoke({"question": task["prompt"]})

    # 2. answer: streamed
    messages = [("system", "You solve arithmetic problems."), ("user", task["prompt"]), ("assistant", thought),
                ("user", "Now give only the final answer.")]
    answer = "".join(str(chunk.content) for chunk in llm.stream(messages))

    # 3. check: two async calls at once
    check = [*messages, ("assistant", answer), ("user", "Is that right? Answer yes or no.")]
    votes = [str(m.content) for m in asyncio.run(llm.abatch([check, check]))]

    expected = str(task.get("answer", ""))
    reward = float(bool(expected) and expected in answer)
    emit_reward(reward)
    print(json.dumps({"task": task["id"], "calls": 4, "answer": answer, "votes": votes, "reward": reward}))
    return reward


if __name__ == "__main__":
    main()
