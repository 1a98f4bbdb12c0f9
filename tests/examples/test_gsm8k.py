"""examples/gsm8k: the GSM8K-style generator, the calculator, the agent's text protocol and reward, the
refusal of a task file that lacks a field, and one training step on the session's vLLM."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from lightspan.core.config import ConfigError
from lightspan.rollout.runner import load_tasks
from tests.examples.test_examples import (  # noqa: F401 (collector: a fixture)
    EXAMPLES, collector, lightspan, load, grade_first_of_each_task, train_one_step)

GSM8K = EXAMPLES / "gsm8k"
ENV_MAP = "QUESTION=input.question,ANSWER=input.answer"


@pytest.fixture(scope="module")
def agent():
    pytest.importorskip("openai")
    return load(GSM8K / "agent.py")


@pytest.fixture(scope="module")
def gen():
    return load(GSM8K / "make_tasks.py")


def test_problems_are_gsm8k_style_correct_and_split(gen):
    train, val = gen.make_splits(0, 80, 40)
    assert (train, val) == gen.make_splits(0, 80, 40)                       # deterministic
    assert not {t["question"] for t in train} & {t["question"] for t in val}
    assert [sum(t["steps"] == k for t in val) for k in (1, 2, 3, 4)] == [10, 10, 10, 10]
    for t in train + val:
        # GSM8K's answer form: one annotated line per step, then "#### N"
        lines = t["answer"].splitlines()
        assert lines[-1] == f"#### {t['result']}" and len(lines) == t["steps"] + 1, t
        value = None
        for line in lines[:-1]:
            left, result = re.fullmatch(r"(.+) = <<.+=(\d+)>>\d+", line).groups()
            assert eval(left) == int(result) > 0, line              # exact, positive: divisions have no remainder
            if value is not None:                                   # each step starts from the last result
                assert left.startswith(str(value)), t
            value = int(result)
        assert value == t["result"]
        numbers = [int(n) for n in re.findall(r"\d+", t["question"])]
        assert len(numbers) == t["steps"] + 1, t                    # every number in the text is used once


def test_shipped_files_are_what_the_generator_writes(gen):
    train, val = gen.make_splits()
    for name, rows in (("train", train), ("val", val)):
        shipped = [json.loads(line) for line in (GSM8K / "data" / f"{name}.jsonl").read_text().splitlines()]
        assert shipped == rows


def test_calculator_evaluates_arithmetic_and_nothing_else(agent):
    assert agent.calculate("12 * (3 + 4)") == 84 and agent.calculate("84 / 4") == 21
    assert agent.calculate("5 x 12") == 60 and agent.calculate("1,250 - 50") == 1200
    assert agent.calculate("5 * 12 = 61") == 60                    # a guessed result after '=' is ignored
    for bad in ("__import__('os').system('true')", "2 ** 999", "abs(-3)", "x1 + 1", "1 / 0", "(1 + 2"):
        with pytest.raises(ValueError):
            agent.calculate(bad)
    assert agent.tool_reply("7 * 6") == "<result>42</result>"
    assert agent.tool_reply("7 / 0").startswith("<result>error")


def test_actions_and_reward(agent):
    assert agent.parse_action("<calc>5 * 12") == ("calc", "5 * 12")      # generation stops at </calc>
    assert agent.parse_action("ok <answer> 53 </answer> and more") == ("answer", "53")
    assert agent.parse_action("<calc>1+1</calc><answer>2</answer>") == ("calc", "1+1")
    assert agent.parse_action("the answer is 53") == (None, "")
    assert agent.gold_number("5*12 = <<5*12=60>>60\n60-7 = <<60-7=53>>53\n#### 53") == 53
    assert agent.gold_number("1,250") == 1250
    assert agent.score("53", "...\n#### 53") == 1.0 and agent.score("53.0", "#### 53") == 1.0
    assert agent.score("about 52", "#### 53") == 0.0 and agent.score(None, "#### 53") == 0.0


class Scripted:
    """An OpenAI client whose chat completions are the given replies, in order; it keeps the requests."""

    def __init__(self, replies):
        self.replies, self.requests = list(replies), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    def _create(self, **request):
        self.requests.append(copy.deepcopy(request))   # the agent goes on appending to its messages
        message = SimpleNamespace(content=self.replies.pop(0))
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def test_an_episode_calculates_until_it_answers(agent):
    client = Scripted(["<calc>4 * 9", "<calc>36 - 15", "<answer>21"])
    episode = agent.solve(client, "Kemi bakes 4 trays of 9 muffins and sells 15. How many are left?", shots=1)
    assert episode == {"calcs": [["4 * 9", "<result>36</result>"], ["36 - 15", "<result>21</result>"]],
                       "answer": "21", "ended": "answer", "turns": 3}
    last = client.requests[-1]
    assert last["stop"] == agent.STOP and last["messages"][-1] == {"role": "user", "content": "<result>21</result>"}
    assert last["messages"][-2] == {"role": "assistant", "content": "<calc>36 - 15</calc>"}
    assert agent.solve(Scripted(["I think 21"]), "q", shots=0)["ended"] == "invalid"
    assert agent.solve(Scripted(["<calc>1+1"] * 3), "q", max_turns=3)["ended"] == "turns"


def test_a_task_file_missing_a_field_is_refused_with_its_line(tmp_path):
    bad = tmp_path / "tasks.jsonl"
    bad.write_text(json.dumps({"id": "a", "question": "q", "answer": "#### 1"}) + "\n"
                   + json.dumps({"id": "b", "question": "q"}) + "\n")
    with pytest.raises(ConfigError, match=r"tasks.jsonl:2: ANSWER=input.answer: the task has no 'answer'"):
        load_tasks(bad, dict(kv.split("=") for kv in ENV_MAP.split(",")))
    # lightspan experiment refuses it before it empties the data directory or starts anything
    data = tmp_path / "data"
    data.mkdir()
    (data / "keep").write_text("x")
    out = subprocess.run([sys.executable, "-m", "lightspan.cli", "experiment", "--agent", str(GSM8K / "agent.py"),
                          "--train-tasks", str(GSM8K / "data" / "train.jsonl"), "--val-tasks", str(bad),
                          "--env-map", ENV_MAP, "--data-dir", str(data), "--model", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "tasks.jsonl:2: ANSWER=input.answer: the task has no 'answer'" in out.stderr, out.stderr[-2000:]
    assert (data / "keep").exists()


@pytest.mark.e2e
def test_gsm8k_trains_one_step_from_its_traces(collector, vllm_server, tiny_model, tmp_path, gen):
    """The unchanged agent under ``lightspan rollout`` (tasks' fields by --env-map), transitions, one
    GRPO step. The tiny model writes random bytes (no action: one call per rollout, reward 0); a grader
    marks one rollout per task solved so that each group has an advantage."""
    import requests

    from lightspan import store
    from lightspan.trainer.sync import ReloadSync

    data, ports = collector
    api = f"http://127.0.0.1:{ports['api']}"
    ReloadSync(vllm_server.url).push(str(tiny_model), 0)
    train, _ = gen.make_splits(0, 2, 2)
    tasks = tmp_path / "train.jsonl"      # no worked dialogue and 8 new tokens: the tiny model's context
    tasks.write_text("".join(json.dumps({**t, "shots": 0, "max_tokens": 8, "temperature": 0.8}) + "\n" for t in train))
    out = lightspan("rollout", "--tasks", str(tasks), "--samples", "2", "--env-map", ENV_MAP,
                    "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}", "--openai-base-url",
                    f"{vllm_server.url}/v1", "--data-dir", str(data), "--timeout-s", "120",
                    "--", sys.executable, str(GSM8K / "agent.py"))
    assert out["ok"] == 4, out
    requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()
    con = store.connect(data)
    rollouts = con.execute("SELECT rollout_key, task_id, final_reward FROM rollouts WHERE task_id IS NOT NULL "
                           "ORDER BY rollout_key").fetchall()
    assert len(rollouts) == 4 and all(r[2] == 0.0 for r in rollouts), rollouts
    calls = con.execute("SELECT count(*) FILTER (WHERE len(completion_token_ids) > 0) FROM llm_calls").fetchone()[0]
    assert calls >= 4
    grade_first_of_each_task(api, rollouts)
    built = lightspan("transitions", "build", "--data-dir", str(data), "--grace-s", "0")
    assert built["transitions/calls"] == calls and built["transitions/nonzero_advantage"] > 0, built
    train_one_step(data, tiny_model, vllm_server.url)
