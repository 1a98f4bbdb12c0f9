"""A crewAI crew that knows nothing about lightspan but its reward: a researcher and a writer, one
task each, run in sequence (the writer sees the researcher's output). Run it unchanged, once per
task sample, from an environment of its own (crewAI requires ``openai<3``, the trainer's stack
``openai>=3``)::

    pip install lightspan crewai opentelemetry-instrumentation-crewai
    lightspan rollout --tasks tasks.jsonl -- /path/to/that/env/bin/python examples/frameworks/crewai_crew.py

crewAI calls the model through the ``openai`` client (``OPENAI_BASE_URL`` is the vLLM server), so
lightspan captures each call's token ids; traceloop's crewAI instrumentation puts each call under
its agent's ``<role>.agent`` span, so it is attributed to the agent's role (``Researcher``,
``Writer``) and ``lightspan transitions build --agent-match '^Writer$'`` trains the writer only.
crewAI's own anonymous telemetry goes to crewAI's servers; ``CREWAI_DISABLE_TELEMETRY=true`` turns
it off. A task line looks like ``{"id": "add-1", "topic": "adding 2 and 3", "answer": "5"}``.
"""

from __future__ import annotations

import json
import os

from crewai import LLM, Agent, Crew, Process, Task

from lightspan.tracing import emit_reward


def main() -> float:
    task = json.loads(os.environ.get("LIGHTSPAN_TASK", '{"id": "demo", "topic": "adding 2 and 3", "answer": "5"}'))
    llm = LLM(model=os.environ.get("AGENT_MODEL", "gpt-4o-mini"), max_tokens=int(task.get("max_tokens", 64)),
              temperature=float(task.get("temperature", 0.7)))
    researcher = Agent(role="Researcher", goal="Find the key facts about {topic}",
                       backstory="You check every number.", llm=llm, allow_delegation=False)
    writer = Agent(role="Writer", goal="Explain {topic} in one sentence",
                   backstory="You write short, plain answers.", llm=llm, allow_delegation=False)
    research = Task(description="List the key facts about {topic}.", expected_output="Three short facts.",
                    agent=researcher)
    answer = Task(description="Answer in one sentence: {topic}.", expected_output="One sentence with the number.",
                  agent=writer)
    crew = Crew(agents=[researcher, writer], tasks=[research, answer], process=Process.sequential)
    result = crew.kickoff(inputs={"topic": task["topic"]})
    expected = str(task.get("answer", ""))
    reward = float(bool(expected) and expected in result.raw)
    emit_reward(reward)
    print(json.dumps({"task": task["id"], "answer": result.raw, "reward": reward}))
    return reward


if __name__ == "__main__":
    main()
