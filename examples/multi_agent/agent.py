"""Two agents in one LangGraph workflow: an SQL writer and a checker that may fix its query.

    sql_writer (graph, one LLM node) ── run the query ──▶ sql_checker (graph, one LLM node): sees the
    question, the query and its result; replies OK or a corrected query

Each agent is its own compiled graph with a name (``compile(name="sql_writer")``); the workflow
invokes one after the other. Nothing in it names lightspan but the reward. Under
``opentelemetry-instrument`` with ``opentelemetry-instrumentation-langchain`` each graph invocation
is a ``<name>.workflow`` span with ``gen_ai.agent.name = <name>`` (operation ``invoke_agent``) that
encloses its node's LLM call, so each call belongs to its agent, and the transition builder trains
only the one ``--agent-match`` selects (here the writer, as Agent Lightning's Spider example trains
its writer and leaves the checker fixed):

    lightspan transitions build --agent-match '^sql_writer$'

Why not the two agents as nodes of one parent graph: with instrumentation-langchain 0.62.4 the
sub-graph's ``invoke_agent`` span is then a sibling of the node spans, not their ancestor (the
node spans follow LangChain's run tree), and the nearest agent span above both LLM calls is the
parent graph's: the two agents could not be told apart.

The checker's query replaces the writer's only when the writer's failed (an error, or no rows)
and the checker's runs. Reward: Spider's execution match of the final query (1 or 0), emitted last.
Before it, right after the checker's turn, the checker's own reward ``checker`` (1 when its action
was right: OK on a right query, or a fixed query that is right), which a policy that credits
``discounted`` (examples/multi_agent/policies.toml) adds to the final one; ``identical`` credit
(the writer's) takes the final reward alone.

Each agent calls its own model name: ``WRITER_MODEL`` and ``CHECKER_MODEL`` (default ``AGENT_MODEL``,
else ``policy``). With one policy both call it; with two (policies.toml) each calls its policy's
adapter, ``writer`` and ``checker``, which vLLM serves side by side. The last line of its output
is JSON with the queries, ``writer_correct``, ``checker_right`` and the reward.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path
from typing import TypedDict

from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "sql_agent"))
from spider_db import SCHEMA_PROMPT, ensure_db, execute, extract_sql, same_result

try:  # optional: the reward could equally be posted later by id
    from lightspan.tracing import emit_reward
except ImportError:  # pragma: no cover
    def emit_reward(value, **_):
        pass

SYSTEM = f"You write SQLite queries for this database:\n{SCHEMA_PROMPT}"
SHOTS = [("How many concerts are there?", "SELECT count(*) FROM concert"),
         ("Which singers are 30 years old?", "SELECT name FROM singer WHERE age = 30")]
CHECK = "Q: {question}\nSQL: {sql}\nResult: {result}\nIf the SQL is right reply OK, else reply a fixed query."


class State(TypedDict, total=False):
    question: str
    shots: int
    sql: str
    result: str
    checked: str
    fixed_sql: str
    final_sql: str


def run_sql(db: Path, sql: str | None) -> tuple[list | None, str]:
    """(rows, a short description for the checker); rows is None when the query failed."""
    if not sql:
        return None, "no query"
    try:
        rows = execute(db, sql)
    except sqlite3.Error as e:
        return None, f"error: {e}"
    return rows, (str(rows[:3])[:60] if rows else "no rows")


def writer_agent(llm: ChatOpenAI, db: Path):
    def write(state: State) -> State:
        turns = [("system", SYSTEM)]
        for q, sql in SHOTS[:state.get("shots", 2)]:
            turns += [("user", q), ("assistant", sql)]
        sql = extract_sql(llm.invoke([*turns, ("user", state["question"])]).content)
        return {"sql": sql or "", "result": run_sql(db, sql)[1]}

    graph = StateGraph(State)
    graph.add_node("write", write)
    graph.add_edge(START, "write")
    graph.add_edge("write", END)
    return graph.compile(name="sql_writer")


def checker_agent(llm: ChatOpenAI, db: Path):
    def check(state: State) -> State:
        reply = llm.invoke([("system", SYSTEM), ("user", CHECK.format(
            question=state["question"], sql=state["sql"] or "(none)", result=state["result"]))]).content
        final = state["sql"]
        fixed = extract_sql(reply)
        if run_sql(db, state["sql"])[0] in (None, []) and fixed and run_sql(db, fixed)[0] is not None:
            final = fixed  # the writer's query failed and the checker's runs
        return {"checked": reply, "fixed_sql": fixed or "", "final_sql": final}

    graph = StateGraph(State)
    graph.add_node("check", check)
    graph.add_edge(START, "check")
    graph.add_edge("check", END)
    return graph.compile(name="sql_checker")


def run_team(writer: ChatOpenAI, checker: ChatOpenAI, db: Path, question: str, shots: int) -> State:
    """The workflow: the writer, then the checker on the writer's output."""
    state = writer_agent(writer, db).invoke({"question": question, "shots": shots})
    return checker_agent(checker, db).invoke(state)


def correct(db: Path, sql: str | None, gold: list, ordered: bool) -> bool:
    rows, _ = run_sql(db, sql)
    return rows is not None and same_result(rows, gold, ordered)


def main() -> None:
    task = json.loads(os.environ["LIGHTSPAN_TASK"])
    db = ensure_db(HERE.parent / "sql_agent" / "data" / task.get("db", "concert_singer.sqlite"))
    default = os.environ.get("AGENT_MODEL", "policy")
    llms = [ChatOpenAI(model=os.environ.get(var, default),  # OPENAI_BASE_URL, OPENAI_API_KEY from env
                       temperature=float(task.get("temperature", 0.7)), max_tokens=int(task.get("max_tokens", 48)))
            for var in ("WRITER_MODEL", "CHECKER_MODEL")]
    state = run_team(*llms, db, task["question"], int(task.get("shots", 2)))
    gold, ordered = execute(db, task["gold"]), bool(task.get("ordered"))
    writer_correct = correct(db, state["sql"], gold, ordered)
    # the checker was right if its fix is right, or if it let a right query pass
    checker_right = correct(db, state["fixed_sql"], gold, ordered) if state["fixed_sql"] else writer_correct
    emit_reward(float(checker_right), name="checker")
    reward = float(correct(db, state["final_sql"], gold, ordered))
    emit_reward(reward)                # last: the rollout's final reward
    print(json.dumps({"task": task["id"], "question": task["question"], "writer_sql": state["sql"],
                      "checker": state["checked"], "final_sql": state["final_sql"], "writer_correct": writer_correct,
                      "checker_right": checker_right, "reward": reward}))


if __name__ == "__main__":
    main()
