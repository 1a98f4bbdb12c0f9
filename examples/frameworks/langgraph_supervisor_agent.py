"""A LangGraph supervisor (``langgraph-supervisor``) routing a question to one of two worker agents,
each a LangChain agent with its own tools: ``converter`` changes units, ``calculator`` does the
arithmetic. Nothing in it names lightspan. Every agent calls a model named ``gpt-4o``; under
``lightspan rollout`` serve the policy under that name (``lightspan vllm --aliases gpt-4o``):

    lightspan rollout --tasks tasks.jsonl -- python examples/frameworks/langgraph_supervisor_agent.py

With ``opentelemetry-instrumentation-langchain`` installed, each call is attributed to the agent
whose graph made it (``supervisor``, ``converter`` or ``calculator``), so training the router alone is

    lightspan transitions build --agent-match '^supervisor$'

The task's ``prompt`` is the question (a default one otherwise). It emits no reward: a grader posts
one per rollout (``POST /v1/rewards``).
"""

from __future__ import annotations

import json
import os

from langchain.agents import create_agent
from langchain_openai import ChatOpenAI
from langgraph_supervisor import create_supervisor

KM_PER_MILE = 1.609344


def miles_to_km(miles: float) -> float:
    """Convert a distance in miles to kilometres."""
    return miles * KM_PER_MILE


def km_to_miles(km: float) -> float:
    """Convert a distance in kilometres to miles."""
    return km / KM_PER_MILE


def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


def build():
    model = ChatOpenAI(model="gpt-4o", max_tokens=512)
    converter = create_agent(model, tools=[miles_to_km, km_to_miles], name="converter",
                             system_prompt="You convert distances between miles and kilometres with your tools.")
    calculator = create_agent(model, tools=[multiply, divide], name="calculator",
                              system_prompt="You do arithmetic with your tools, one step at a time.")
    supervisor = create_supervisor(
        [converter, calculator], model=model,
        prompt="You lead a unit converter and a calculator. Hand unit conversions to converter and "
               "arithmetic to calculator, then answer the user from their results.")
    return supervisor.compile()


if __name__ == "__main__":
    task = json.loads(os.environ.get("LIGHTSPAN_TASK", "{}"))
    question = task.get("prompt", "A 10 km run took 50 minutes. How many minutes per mile is that?")
    state = build().invoke({"messages": [{"role": "user", "content": question}]})
    print(state["messages"][-1].content)
