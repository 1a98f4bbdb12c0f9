"""The examples' pure parts: the calculator tool, SQL extraction and execution match, the task
generators, and the experiment runner's task schedule and plot. No server needed."""

from __future__ import annotations

import json
import re
import sqlite3

import pytest

from tests.examples.test_examples import EXAMPLES, load


@pytest.fixture(scope="module")
def calc():
    pytest.importorskip("langgraph", reason="pip install 'lightspan[examples]'")
    return load(EXAMPLES / "calc_agent" / "agent.py")


@pytest.fixture(scope="module")
def spider():
    return load(EXAMPLES / "sql_agent" / "spider_db.py")


def test_calculator_evaluates_arithmetic_and_nothing_else(calc):
    assert calc.calculate("12 * (3 + 4)") == 84
    assert calc.calculate("2160 / 30") == 72
    assert calc.calculate("-5 + 2") == -3
    for bad in ("__import__('os').system('true')", "2 ** 99999", "abs(-3)", "x + 1", "1 / 0", "(1 + 2"):
        with pytest.raises(ValueError):
            calc.calculate(bad)


def test_expression_is_the_longest_arithmetic_run_in_the_reply(calc):
    assert calc.extract_expression("61 * 65 = 4265. Final answer?") == "61 * 65"
    assert calc.extract_expression("She has 466 + 697 - 37 coins") == "466 + 697 - 37"
    assert calc.extract_expression("27 x 14") == "27 * 14"
    assert calc.extract_expression("no numbers here") is None
    assert calc.score("The answer is 3,965.", 3965) == 1.0
    assert calc.score("3965 trees, or 12", 3965) == 0.0      # the last number counts
    assert calc.score("", 1) == 0.0


def test_calc_tasks_are_deterministic_disjoint_and_correct(calc):
    gen = load(EXAMPLES / "calc_agent" / "make_tasks.py")
    train, val = gen.make_splits(0, 60, 12)
    assert (train, val) == gen.make_splits(0, 60, 12)
    assert not {t["question"] for t in train} & {t["question"] for t in val}
    for t in train + val:  # answers are whole and positive: division problems are exact
        assert isinstance(t["answer"], int) and t["answer"] > 0, t
        if "in one box" in t["question"]:
            boxes, pencils = (int(n) for n in re.findall(r"\d+", t["question"]))
            assert t["answer"] * boxes == pencils


def test_execution_match_is_spider_style(spider):
    assert spider.same_result([(1,), (2,)], [(2,), (1,)], ordered=False)
    assert not spider.same_result([(1,), (2,)], [(2,), (1,)], ordered=True)
    assert not spider.same_result([(1,), (1,)], [(1,)], ordered=False)   # multisets, not sets
    assert spider.same_result([(36.666666666,)], [(36.6666667,)], ordered=False)


def test_sql_extraction_and_read_only_execution(spider, tmp_path):
    assert spider.extract_sql("Sure:\n```sql\nSELECT name\nFROM singer;\n```") == "SELECT name FROM singer"
    assert spider.extract_sql("select count(*) from concert\n\nThis counts") == "select count(*) from concert"
    assert spider.extract_sql("I cannot") is None
    db = spider.build_db(tmp_path / "db.sqlite")
    assert spider.execute(db, "SELECT count(*) FROM singer") == [(30,)]
    with pytest.raises(sqlite3.Error):
        spider.execute(db, "DELETE FROM singer")                        # read-only
    with pytest.raises(sqlite3.Error):
        spider.execute(db, "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT max(i) FROM n")
    assert spider.execute(db, "SELECT count(*) FROM singer") == [(30,)]


def test_sql_tasks_have_nonempty_gold_and_disjoint_splits(spider, tmp_path):
    gen = load(EXAMPLES / "sql_agent" / "make_tasks.py")
    db = spider.build_db(tmp_path / "db.sqlite")
    train, val = gen.make_splits(db, 0, 0.3)
    assert len(train) > 2 * len(val) > 0
    assert not {t["question"] for t in train} & {t["question"] for t in val}
    assert {t["template"] for t in val} <= {t["template"] for t in train}
    assert all(spider.execute(db, t["gold"]) for t in train + val)
    shipped = [json.loads(line) for line in (EXAMPLES / "sql_agent" / "data" / "val.jsonl").read_text().splitlines()]
    assert [t["question"] for t in shipped] == [t["question"] for t in val]   # the files are reproducible


def test_experiment_cycles_train_tasks_with_new_ids():
    from lightspan.experiment import agent_command, step_tasks

    train = [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    assert [t["id"] for t in step_tasks(train, 0, 2, 0.7)] == ["a", "b"]
    assert [t["id"] for t in step_tasks(train, 1, 2, 0.7)] == ["c", "a~1"]
    assert all(t["temperature"] == 0.7 for t in step_tasks(train, 1, 2, 0.7))
    assert agent_command("examples/sql_agent/agent.py")[1].endswith("examples/sql_agent/agent.py")
    assert agent_command("node agent.js --fast") == ["node", "agent.js", "--fast"]


def test_experiment_builds_the_transitions_it_is_told_to(tmp_path, monkeypatch):
    from lightspan.core.config import ConfigError
    from lightspan.experiment import ExperimentConfig, build_config, rollout_config

    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"id": "a"}\n')
    files = {"agent": "agent.py", "train_tasks": str(tasks), "val_tasks": str(tasks)}
    default = build_config(ExperimentConfig(**files), tmp_path)
    assert (default.output, default.data_dir) == ("per_call", str(tmp_path))
    merged = build_config(ExperimentConfig(**files, output="per_rollout", credit="discounted"), tmp_path)
    assert (merged.output, merged.credit) == ("per_rollout", "discounted")
    monkeypatch.setenv("LIGHTSPAN_TRANSITIONS_GAMMA", "0.5")      # the job's own settings still apply
    assert build_config(ExperimentConfig(**files), tmp_path).gamma == 0.5
    # and the rollouts': the experiment's services and choices, the rest from [rollout]'s variables
    monkeypatch.setenv("LIGHTSPAN_ROLLOUT_MODE", "process")
    rollouts = rollout_config(ExperimentConfig(**files, concurrency=3, env_map=("Q=input.question",)), tmp_path,
                              tasks, {"http": 4318, "api": 8999}, "http://127.0.0.1:8001")
    assert (rollouts.mode, rollouts.concurrency, rollouts.env_map) == ("process", 3, ("Q=input.question",))
    assert (rollouts.collector_api_url, rollouts.openai_base_url) == ("http://127.0.0.1:8999", "http://127.0.0.1:8001/v1")
    with pytest.raises(ConfigError, match="output.*per_turn.*per_call, per_rollout"):
        ExperimentConfig(**files, output="per_turn")
    with pytest.raises(ConfigError, match="trainer_wait_s"):
        ExperimentConfig(**files, trainer_wait_s=0)


def test_experiment_plot_is_a_small_png(tmp_path):
    pytest.importorskip("matplotlib", reason="pip install 'lightspan[examples]'")
    from lightspan.experiment_report import plot

    results = {"name": "x", "model": "m", "config": {"temperature": 0.7},
               "train": [{"step": s, "reward_mean": s / 10} for s in range(1, 9)],
               "val": [{"step": 0, "reward_mean": 0.1, "rollouts": 32, "policy_version": 0},
                       {"step": 8, "reward_mean": 0.5, "rollouts": 32, "policy_version": 7}]}
    png = plot(results, tmp_path / "curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 200_000


def test_the_two_policy_example_gives_each_agent_its_policy_and_scores_each_agent(tmp_path):
    from lightspan.store.policies import load as load_policies, owner

    policies = load_policies(EXAMPLES / "multi_agent" / "policies.toml")
    assert [p.name for p in policies] == ["writer", "checker"]
    assert owner(policies, "sql_writer").name == "writer" and owner(policies, "sql_checker").credit == "discounted"
    assert owner(policies, "multi_agent") is None
    two = load(EXAMPLES / "multi_agent" / "two_policies.py")
    for i, (writer, checker, reward) in enumerate([(True, True, 1.0), (False, True, 1.0), (False, False, 0.0),
                                                    (True, False, 1.0)]):
        (tmp_path / f"r{i}.log").write_text("a log line\n" + json.dumps(
            {"writer_correct": writer, "checker_right": checker, "reward": reward}) + "\n")
    assert two.per_agent(two.outputs(tmp_path)) == {"rollouts": 4, "writer_correct": 0.5, "checker_right": 0.5,
                                                    "workflow_correct": 0.75}


def test_the_agent_lightning_style_agents_import_no_lightspan():
    """examples/agl_compat is written to Agent Lightning's contract alone: variables in, reward events out."""
    import ast

    for path in sorted((EXAMPLES / "agl_compat").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {name for name in imported if name.split(".")[0] == "lightspan"}, path


def test_the_word_problem_agents_score_the_final_answer():
    pytest.importorskip("openai")
    agents = load(EXAMPLES / "agl_compat" / "math_agents.py")
    assert agents.score("3 boxes of 4 pens: 3 * 4 = 12.\nAnswer: 12", "12") == 1.0
    assert agents.score("Answer: $1,250.", "1250") == 1.0
    assert agents.score("that makes 7 apples", "7") == 1.0              # no marker: the last number
    assert agents.score("Answer: 11\nAnswer: 12", "12") == 1.0          # the last marker counts
    assert agents.score("Answer: 13", "12") == 0.0 and agents.score("no idea", "12") == 0.0


def test_the_calculator_agent_compares_results_as_numbers():
    pytest.importorskip("autogen_agentchat", reason="pip install 'lightspan[autogen]'")
    agent = load(EXAMPLES / "agl_compat" / "calculator_agent.py")
    assert agent.close_enough("12 * 7 - 5 = 79\nResult: 79", "79")
    assert agent.close_enough("Result: 2.5", "5/2") and agent.close_enough("Result: 3.333", "10/3")
    assert agent.close_enough("Result: (B)", "(b)") and not agent.close_enough("Result: 78", "79")
