"""LLM-in-sandbox: the model writes a Python program, a bubblewrap sandbox runs it, the model answers
from its output. No lightspan code in it but the reward.

The agent has the shape of Agent Lightning's LLM-in-sandbox example (a chat model in a loop of
actions and observations in an isolated computer, a step budget, a final answer checked by the
task's reward), cut to what a 135M model can do: one tool, "run this program".

    turn 1:  model ──▶ ```python print(sum(range(59, 877))) ```  ──▶ sandbox (sandbox.py)
    turn 2:  "Output:\\n382415" (next user turn) ──▶ model ──▶ Answer: 382415  ──▶ reward

The tool protocol is text: SmolLM2-135M served by vLLM makes no native tool calls (vLLM needs a tool
parser and a chat template that renders tools, and a 135M model does not follow a tool schema). A
fenced ```python block in a reply is run, its stdout (and the last line of its stderr, when it fails)
comes back as the next user turn; ``Answer: ...`` ends the episode; a reply with neither gets one
reminder of the protocol. Two worked dialogues are given as earlier chat turns (task field ``shots``):
a 135M model copies a dialogue's form far better than it follows an instruction.

Reward: 1 when the text after the last ``Answer:`` equals the task's answer (numbers compared as
numbers, words exactly, surrounding quotes and a final period ignored), else 0.

The sandbox is checked before the model is called: when it cannot run (bubblewrap missing, user
namespaces refused) the agent emits no reward and exits with status 75 (``EX_TEMPFAIL``), an
infrastructure failure that ``lightspan rollout`` retries and the transition builder drops; never
a reward of 0 for the model. The same holds if it breaks later in the episode.

Run it unchanged, once per task sample; ``--env-map`` gives the task's fields as Agent Lightning's
runner does and refuses a task file whose line lacks one (naming the line and the field):

    lightspan rollout --tasks examples/sandbox/data/train.jsonl --samples 4 \\
      --env-map QUESTION=input.question,ANSWER=input.answer -- python examples/sandbox/agent.py

Sampling settings come from the task JSON in ``LIGHTSPAN_TASK`` (``lightspan experiment`` sets
``temperature``: 0 for held-out tasks): ``temperature`` (0.7), ``max_tokens`` per turn (64),
``max_turns`` (3), ``shots`` (2). The sandbox's limits come from ``SANDBOX_*`` variables (sandbox.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys

from openai import OpenAI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sandbox import Result, Sandbox, SandboxConfig, SandboxUnavailable  # noqa: E402

try:  # optional: the reward could equally be posted later by id
    from lightspan.tracing import emit_reward
except ImportError:  # pragma: no cover
    def emit_reward(value, **_):
        pass

log = logging.getLogger("sandbox_agent")

INSTRUCTION = "Write a Python program that prints the answer."
REMINDER = "Reply with a ```python block that prints the answer, or with Answer: <answer>."
# worked dialogues: question, program, its output, answer
SHOTS = [("What is the sum of all integers from 3 to 9?", "print(sum(range(3, 10)))", "42", "42"),
         ("How many times does the letter 's' appear in 'mississippi'?", "print('mississippi'.count('s'))", "4", "4")]
STOP = ["\n```"]   # a turn ends where its program's block closes
_CODE = re.compile(r"```(?:python|py)?[ \t]*\n?(.*?)(?:```|$)", re.DOTALL)
_ANSWER = re.compile(r"Answer:\s*(.*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_turn(question: str) -> str:
    return f"{question}\n{INSTRUCTION}"


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def observation(result: Result, keep: int = 400) -> str:
    """What the model sees of a run: its output, and why it failed when it did."""
    text = result.stdout.strip()[:keep]
    if result.limit:
        text += f"\nError: stopped by the sandbox's {result.limit} limit"
    elif not result.ok:
        lines = result.stderr.strip().splitlines()
        text += f"\nError: {lines[-1][:200] if lines else f'exit status {result.exit_code}'}"
    return f"Output:\n{text.strip() or '(nothing printed)'}"


def shot_turns(n: int = len(SHOTS)) -> list[dict]:
    """The first ``n`` worked dialogues as earlier chat turns."""
    turns = []
    for question, code, output, answer in SHOTS[:n]:
        turns += [{"role": "user", "content": first_turn(question)}, {"role": "assistant", "content": fenced(code)},
                  {"role": "user", "content": f"Output:\n{output}"}, {"role": "assistant", "content": f"Answer: {answer}"}]
    return turns


def parse_reply(reply: str) -> tuple[str | None, str]:
    """The reply's action: ``("code", source)`` for its first fenced block (the closing fence may be
    missing: generation stops at it), ``("answer", text)`` for ``Answer: text``, or ``(None, "")``."""
    reply = reply or ""
    code, answer = _CODE.search(reply), _ANSWER.search(reply)
    if code and (not answer or code.start() < answer.start()) and code.group(1).strip():
        return "code", code.group(1).strip()
    if answer:
        return "answer", answer.group(1).strip().splitlines()[0].strip() if answer.group(1).strip() else ""
    return None, ""


def normalise(text: str) -> str:
    return text.strip().strip("`'\"").rstrip(".").strip().strip("`'\"").replace(",", "")


def score(answer: str | None, gold: str) -> float:
    """1.0 when the answer is the gold one (numbers as numbers, otherwise exact text), else 0.0."""
    if answer is None:
        return 0.0
    got, want = normalise(answer), normalise(str(gold))
    if _NUMBER.fullmatch(want):
        return float(bool(_NUMBER.fullmatch(got)) and abs(float(got) - float(want)) < 1e-6)
    return float(got == want)


def solve(client: OpenAI, box: Sandbox, question: str, *, model: str = "policy", temperature: float = 0.7,
          max_tokens: int = 64, max_turns: int = 3, shots: int = 2) -> dict:
    """One episode: the model writes programs and reads their output until it answers (or runs out of
    turns). Raises SandboxUnavailable when the sandbox, not the program, fails."""
    messages = [*shot_turns(shots), {"role": "user", "content": first_turn(question)}]
    runs, answer, ended, turns = [], None, "turns", 0
    for turns in range(1, max_turns + 1):
        response = client.chat.completions.create(model=model, messages=messages, temperature=temperature,
                                                  max_tokens=max_tokens, stop=STOP)
        reply = response.choices[0].message.content or ""
        action, content = parse_reply(reply)
        if action == "code" and "```" in reply and not reply.rstrip().endswith("```"):
            reply = reply.rstrip() + "\n```"   # the stop sequence cut the closing fence: put it back
        messages.append({"role": "assistant", "content": reply})
        if action == "answer":
            answer, ended = content, "answer"
            break
        if action == "code":
            result = box.run(content)
            runs.append({"code": content, "stdout": result.stdout[:400], "exit_code": result.exit_code,
                         "limit": result.limit})
            messages.append({"role": "user", "content": observation(result)})
        else:
            messages.append({"role": "user", "content": REMINDER})
    return {"runs": runs, "answer": answer, "ended": ended, "turns": turns}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    task = json.loads(os.environ.get("LIGHTSPAN_TASK") or "{}")
    question = os.environ["QUESTION"] if "QUESTION" in os.environ else task["question"]
    gold = os.environ["ANSWER"] if "ANSWER" in os.environ else str(task["answer"])
    try:
        box = Sandbox(SandboxConfig.from_env())
        box.check()   # before the model is called: a retry then cannot depend on what the model wrote
        client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
        episode = solve(client, box, question, model=os.environ.get("AGENT_MODEL", "policy"),
                        temperature=float(task.get("temperature", 0.7)), max_tokens=int(task.get("max_tokens", 64)),
                        max_turns=int(task.get("max_turns", 3)), shots=int(task.get("shots", 2)))
    except SandboxUnavailable as e:
        log.error("sandbox unavailable, no reward (infrastructure failure): %s", e)
        sys.exit(os.EX_TEMPFAIL)
    reward = score(episode["answer"], gold)
    emit_reward(reward)
    print(json.dumps({"task": task.get("id"), **episode, "gold": gold, "reward": reward}))


if __name__ == "__main__":
    main()
