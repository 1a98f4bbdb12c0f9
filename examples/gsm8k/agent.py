"""A GSM8K-style math agent with a calculator tool, on the plain ``openai`` client: no lightspan code
in it but the reward.

The agent is what Agent Lightning's GSM8K example is (a chat model, a word problem, a reward from the
final number; its question and gold answer given as ``QUESTION`` and ``ANSWER``), plus the tool the
issue asks for: the model may call a calculator as often as it likes before it answers.

    turn k: model ──▶ <calc>48 - 5</calc>  ──▶ calculator ──▶ <result>43</result> (next user turn)
    last:   model ──▶ <answer>43</answer>  ──▶ reward

The tool protocol is text, as in Search-R1 (``<search>`` / ``<information>`` / ``<answer>``): the
model served here, SmolLM2-135M-Instruct, makes no native tool calls (vLLM needs a tool parser and a
chat template that renders tools, and a 135M model does not follow a tool schema). Each model turn
stops at the first closing tag, and one worked dialogue is given as earlier turns (task field
``shots``), because a 135M model copies a dialogue's form far better than it follows an instruction.
The calculator evaluates + - * / and parentheses over numbers by walking Python's AST; nothing else is
executed.

Reward: 1 when the number inside the last ``<answer>`` equals the gold answer's final number (the one
after ``####``, GSM8K's form, or ``ANSWER`` itself when it is a bare number), else 0; a reply that
neither calculates nor answers ends the episode with 0, as an invalid action does in Search-R1.

Run it unchanged, once per task sample; ``--env-map`` gives the task's fields as Agent Lightning's
runner does and refuses a task file whose line lacks one (naming the line and the field):

    lightspan rollout --tasks examples/gsm8k/data/train.jsonl --samples 4 \\
      --env-map QUESTION=input.question,ANSWER=input.answer -- python examples/gsm8k/agent.py

Sampling settings come from the task JSON in ``LIGHTSPAN_TASK`` when there is one (``lightspan
experiment`` sets ``temperature``: 0 for held-out tasks): ``temperature`` (0.7), ``max_tokens`` per
turn (24), ``max_turns`` (6), ``shots`` (1).
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re

from openai import OpenAI

try:  # optional: the reward could equally be posted later by id
    from lightspan.tracing import emit_reward
except ImportError:  # pragma: no cover
    def emit_reward(value, **_):
        pass

INSTRUCTION = ("Solve the math problem. Do one calculation per turn as <calc>expression</calc>; the calculator "
               "replies <result>value</result>. When you know the final number, reply <answer>number</answer>.")
# worked dialogues: the model copies their form (calc, result, ..., answer)
SHOTS = [("Tom has 5 bags with 12 apples in each bag. He eats 7 apples. How many apples are left?",
          [("5 * 12", "60"), ("60 - 7", "53")], "53"),
         ("A shop has 84 pens and sells them in packs of 4. How many packs does it sell?", [("84 / 4", "21")], "21")]
STOP = ["</calc>", "</answer>"]
_TAG = re.compile(r"<(calc|answer)>(.*?)(?:</\1>|$)", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def first_turn(question: str) -> str:
    return f"{INSTRUCTION}\nQuestion: {question}"


def shot_turns(n: int = 1) -> list[dict]:
    """The first ``n`` worked dialogues as earlier chat turns."""
    turns = []
    for question, calcs, answer in SHOTS[:n]:
        turns.append({"role": "user", "content": first_turn(question)})
        for expression, result in calcs:
            turns += [{"role": "assistant", "content": f"<calc>{expression}</calc>"},
                      {"role": "user", "content": f"<result>{result}</result>"}]
        turns.append({"role": "assistant", "content": f"<answer>{answer}</answer>"})
    return turns


def parse_action(reply: str) -> tuple[str | None, str]:
    """The first ``<calc>`` or ``<answer>`` in a reply and its content; the closing tag may be missing
    (generation stops at it). ``(None, "")`` when there is neither."""
    match = _TAG.search(reply or "")
    return (match.group(1), match.group(2).strip()) if match else (None, "")


def calculate(expression: str) -> float:
    """Evaluate + - * / over numbers and parentheses (``x`` and ``×`` read as ``*``); anything else
    raises ValueError."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError("only numbers, + - * / and parentheses")
    text = expression.replace("×", "*").replace("x", "*").replace(",", "").split("=")[0].strip()
    try:
        return walk(ast.parse(text, mode="eval"))
    except (SyntaxError, ZeroDivisionError, RecursionError) as e:
        raise ValueError(str(e) or type(e).__name__) from None


def format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def gold_number(answer: str) -> float:
    """The final number of a GSM8K answer: what follows ``####``, else the answer's last number."""
    text = str(answer).replace(",", "")
    tail = text.rsplit("####", 1)[-1]
    numbers = _NUMBER.findall(tail)
    if not numbers:
        raise ValueError(f"no number in the gold answer {answer!r}")
    return float(numbers[-1])


def score(answer: str | None, gold: str) -> float:
    """1.0 when the answer's last number is the gold answer's final number, else 0.0."""
    numbers = _NUMBER.findall((answer or "").replace(",", ""))
    return float(bool(numbers) and abs(float(numbers[-1]) - gold_number(gold)) < 1e-6)


def tool_reply(expression: str) -> str:
    try:
        return f"<result>{format_number(calculate(expression))}</result>"
    except (ValueError, OverflowError) as e:
        return f"<result>error: {e}</result>"


def solve(client: OpenAI, question: str, *, model: str = "policy", temperature: float = 0.7,
          max_tokens: int = 24, max_turns: int = 6, shots: int = 1) -> dict:
    """One episode: the model calculates until it answers (or runs out of turns)."""
    messages = [*shot_turns(shots), {"role": "user", "content": first_turn(question)}]
    calcs, answer, ended, turns = [], None, "turns", 0
    for turns in range(1, max_turns + 1):
        response = client.chat.completions.create(model=model, messages=messages, temperature=temperature,
                                                  max_tokens=max_tokens, stop=STOP)
        reply = response.choices[0].message.content or ""
        action, content = parse_action(reply)
        if action is None:
            ended = "invalid"
            break
        messages.append({"role": "assistant", "content": f"<{action}>{content}</{action}>"})
        if action == "answer":
            answer, ended = content, "answer"
            break
        result = tool_reply(content)
        calcs.append([content, result])
        messages.append({"role": "user", "content": result})
    return {"calcs": calcs, "answer": answer, "ended": ended, "turns": turns}


def main() -> None:
    task = json.loads(os.environ.get("LIGHTSPAN_TASK") or "{}")
    question = os.environ["QUESTION"] if "QUESTION" in os.environ else task["question"]
    gold = os.environ["ANSWER"] if "ANSWER" in os.environ else str(task["answer"])
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    episode = solve(client, question, model=os.environ.get("AGENT_MODEL", "policy"),
                    temperature=float(task.get("temperature", 0.7)), max_tokens=int(task.get("max_tokens", 24)),
                    max_turns=int(task.get("max_turns", 6)), shots=int(task.get("shots", 1)))
    reward = score(episode["answer"], gold)
    emit_reward(reward)
    print(json.dumps({"task": task.get("id"), **episode, "gold": gold_number(gold), "reward": reward}))


if __name__ == "__main__":
    main()
