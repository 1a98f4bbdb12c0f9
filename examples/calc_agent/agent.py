"""Math with a calculator tool (Calc-X style), as a LangGraph graph: no lightspan code in it but the reward.

    plan (LLM) ──▶ calculator (Python, safe) ──▶ answer (LLM) ──▶ reward

1. ``plan``: the model reads the word problem and writes the arithmetic expression that solves it
   (after two worked examples given as earlier chat turns);
2. ``calculator``: the longest arithmetic expression in that reply is evaluated safely (an AST walk
   over numbers, + - * / and parentheses; nothing else is executed), and the result goes back to
   the model as the next turn, ``Calculator: <expression> = <result>. Final answer?``;
3. ``answer``: the model writes the final answer.

Reward 1 when the last number of the final answer is the right one, else 0.

The tool protocol is text, inside the graph: SmolLM2-135M served by vLLM does not do native tool
calls (vLLM needs a tool parser and a chat template that knows tools, and a 135M model does not
follow a tool schema), so the graph's own calculator node plays the tool. A bigger model could
use ``ChatOpenAI.bind_tools`` instead; the graph and the reward would not change.

The LLM calls go through LangChain's ``ChatOpenAI``, which uses the ``openai`` client: under
``opentelemetry-instrument`` with lightspan installed, each call's token ids and logprobs are
recorded on its span, and ``opentelemetry-instrumentation-langchain`` (if installed) adds the
graph's and nodes' spans. Run it unchanged, once per task sample:

    lightspan rollout --tasks examples/calc_agent/data/train.jsonl --samples 4 -- python examples/calc_agent/agent.py
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
from typing import Annotated, TypedDict

from langchain_core.messages import AIMessage, HumanMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

try:  # optional: the reward could equally be posted later by id
    from lightspan.tracing import emit_reward
except ImportError:  # pragma: no cover
    def emit_reward(value, **_):
        pass

# Two worked examples as earlier chat turns (few-shot): SmolLM2-135M ignores a bare instruction to
# "write the expression" (2 of 48 sampled plans were right) but follows the pattern of a dialogue.
SHOTS = [("A shop sells 27 bags of 14 apples. How many apples?", "27 * 14", "378"),
         ("Tom had 530 cards and lost 120. How many are left?", "530 - 120", "410")]
ASK = "Write the calculation for: {question}"
TOOL = "Calculator: {expression} = {result}. Final answer?"


def few_shot(n: int = len(SHOTS)) -> list:
    turns = []
    for question, expression, result in SHOTS[:n]:
        turns += [HumanMessage(ASK.format(question=question)), AIMessage(expression),
                  HumanMessage(TOOL.format(expression=expression, result=result)), AIMessage(result)]
    return turns


_NUMBER = r"\d+(?:\.\d+)?"
# numbers joined by + - * / x ×, with optional parentheses: the longest such run in the reply
_EXPRESSION = re.compile(rf"[(\s]*{_NUMBER}[)\s]*(?:[-+*/x×][(\s]*{_NUMBER}[)\s]*)+")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class State(TypedDict, total=False):
    messages: Annotated[list, add_messages]
    plan: str
    expression: str
    result: str
    answer: str


def extract_expression(text: str) -> str | None:
    """The longest arithmetic expression in ``text`` (``x`` and ``×`` read as ``*``), or None."""
    found = [m.group(0).strip() for m in _EXPRESSION.finditer(text or "")]
    if not found:
        return None
    return max(found, key=len).replace("×", "*").replace("x", "*")


def calculate(expression: str) -> float:
    """Evaluate + - * / over numbers and parentheses; anything else raises ValueError."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"not allowed in a calculator expression: {ast.dump(node)[:60]}")
    try:
        return walk(ast.parse(expression, mode="eval"))
    except (SyntaxError, ZeroDivisionError, RecursionError) as e:
        raise ValueError(str(e)) from None


def format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def score(answer: str, expected: float) -> float:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", (answer or "").replace(",", ""))
    return float(bool(numbers) and abs(float(numbers[-1]) - float(expected)) < 1e-6)


def build_graph(llm: ChatOpenAI):
    def plan(state: State) -> State:
        reply = llm.invoke(state["messages"])
        return {"messages": [reply], "plan": reply.content}

    def calculator(state: State) -> State:
        expression = extract_expression(state["plan"])
        try:
            result = "error: no expression" if expression is None else format_number(calculate(expression))
        except (ValueError, OverflowError) as e:
            result = f"error: {e}"
        # the tool's answer goes back to the model as the next user turn (text protocol, see above)
        return {"messages": [HumanMessage(TOOL.format(expression=expression or "?", result=result))],
                "expression": expression or "", "result": result}

    def answer(state: State) -> State:
        reply = llm.invoke(state["messages"])
        return {"messages": [reply], "answer": reply.content}

    graph = StateGraph(State)
    graph.add_node("plan", plan)
    graph.add_node("calculator", calculator)
    graph.add_node("answer", answer)
    graph.add_edge(START, "plan")
    graph.add_edge("plan", "calculator")
    graph.add_edge("calculator", "answer")
    graph.add_edge("answer", END)
    return graph.compile(name="calc_agent")


def main() -> None:
    task = json.loads(os.environ["LIGHTSPAN_TASK"])
    llm = ChatOpenAI(model=os.environ.get("AGENT_MODEL", "policy"),  # OPENAI_BASE_URL, OPENAI_API_KEY from env
                     temperature=float(task.get("temperature", 0.7)), max_tokens=int(task.get("max_tokens", 24)))
    state = build_graph(llm).invoke({"messages": [*few_shot(int(task.get("shots", 2))), HumanMessage(ASK.format(question=task["question"]))]})
    reward = score(state["answer"], task["answer"])
    emit_reward(reward)
    print(json.dumps({"task": task["id"], "plan": state["plan"], "expression": state["expression"],
                      "result": state["result"], "answer": state["answer"], "reward": reward}))


if __name__ == "__main__":
    main()
