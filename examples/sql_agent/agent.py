"""Text-to-SQL over a local SQLite database (Spider-like ``concert_singer``), on the plain ``openai`` client.

The agent is what a user would write: the schema and two worked examples in the prompt, one chat
call, the first ``SELECT`` of the reply run against the database. No lightspan code but the reward.

Reward (Spider's execution accuracy): 1 when the predicted query runs and returns the same result
set as the gold query (as multisets; in order when the gold query sorts), else 0. The gold query
travels in the task for the reward only; the model never sees it.

    LIGHTSPAN_TASK="$(head -1 examples/sql_agent/data/val.jsonl)" OPENAI_BASE_URL=http://127.0.0.1:8000/v1 \\
    OPENAI_API_KEY=x opentelemetry-instrument python examples/sql_agent/agent.py
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path

from openai import OpenAI

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from spider_db import SCHEMA_PROMPT, ensure_db, execute, extract_sql, same_result

try:  # optional: the reward could equally be posted later by id
    from lightspan.tracing import emit_reward
except ImportError:  # pragma: no cover
    def emit_reward(value, **_):
        pass

SYSTEM = f"You write SQLite queries for this database:\n{SCHEMA_PROMPT}"
# two worked examples as earlier chat turns: SmolLM2-135M copies the form of a dialogue far better
# than it follows an instruction
SHOT = [{"role": "user", "content": "How many concerts are there?"},
        {"role": "assistant", "content": "SELECT count(*) FROM concert"},
        {"role": "user", "content": "Which singers are 30 years old?"},
        {"role": "assistant", "content": "SELECT name FROM singer WHERE age = 30"}]


def messages(question: str, shots: int = 2) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *SHOT[:2 * shots], {"role": "user", "content": question}]


def score(sql: str | None, task: dict, db: Path) -> tuple[float, str]:
    if not sql:
        return 0.0, "no SELECT in the reply"
    try:
        predicted = execute(db, sql)
    except sqlite3.Error as e:
        return 0.0, f"error: {e}"
    gold = execute(db, task["gold"])
    return float(same_result(predicted, gold, bool(task.get("ordered")))), f"{len(predicted)} rows"


def main() -> None:
    task = json.loads(os.environ["LIGHTSPAN_TASK"])
    db = ensure_db(HERE / "data" / task.get("db", "concert_singer.sqlite"))
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    response = client.chat.completions.create(
        model=os.environ.get("AGENT_MODEL", "policy"), messages=messages(task["question"], int(task.get("shots", 2))),
        max_tokens=int(task.get("max_tokens", 48)), temperature=float(task.get("temperature", 0.7)))
    reply = response.choices[0].message.content or ""
    sql = extract_sql(reply)
    reward, detail = score(sql, task, db)
    emit_reward(reward)
    print(json.dumps({"task": task["id"], "question": task["question"], "sql": sql, "result": detail,
                      "reward": reward}))


if __name__ == "__main__":
    main()
