"""examples/scienceworld: the tiers from the game's own variation splits, the agent's text protocol, an
episode against the real game (valid, refused and missing actions; the history compaction), a game
engine that cannot start as an infrastructure failure (never a reward of 0), and one training step on
the session's vLLM with the tiny model. The game is a JVM: one is started per module for the in-process
tests; each rollout under ``lightspan rollout`` starts its own, as in production."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import requests

from tests.examples.test_examples import (  # noqa: F401 (collector: a fixture)
    EXAMPLES, collector, lightspan, load, train_one_step)

SW = EXAMPLES / "scienceworld"
ENV_MAP = "TASK_NAME=input.task_name,VARIATION_IDX=input.variation"
NON_LIVING = "find-non-living-thing"   # variation 0 starts in the hallway, with a picture in it


@pytest.fixture(scope="module")
def agent():
    pytest.importorskip("openai")
    return load(SW / "agent.py")


@pytest.fixture(scope="module")
def game(agent):
    """One real engine for the module (its JVM start is paid once)."""
    pytest.importorskip("scienceworld", reason="pip install -e '.[scienceworld]' (scripts/setup.sh does)")
    if shutil.which("java") is None:
        pytest.skip("no Java runtime: bash examples/scienceworld/setup.sh installs Debian's default-jre-headless")
    g = agent.Game()
    yield g
    g.close()


class Scripted:
    """An OpenAI client whose chat completions are the given replies, in order; it keeps the requests."""

    def __init__(self, replies):
        self.replies, self.requests = list(replies), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    def _create(self, **request):
        self.requests.append(copy.deepcopy(request))   # the agent goes on appending to its messages
        message = SimpleNamespace(content=self.replies.pop(0))
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def test_actions_are_parsed_from_the_last_action_line(agent):
    assert agent.parse_action("Thought: a picture is not alive.\nAction: focus on picture") == "focus on picture"
    assert agent.parse_action("Action: Go to Kitchen.") == "go to kitchen"
    assert agent.parse_action("Action: look around\nAction: 'focus on air'") == "focus on air"
    assert agent.parse_action("Actions: look at table") == "look at table"
    assert agent.parse_action("Action: go to hallway (refused); look around") == "go to hallway"
    assert agent.parse_action("Thought: the room is called the hallway") is None
    assert agent.parse_action("Action:   ") is None and agent.parse_action("") is None


def test_tiers_come_from_the_games_own_splits(game, agent):
    gen = load(SW / "make_tasks.py")
    splits = {}
    for task in gen.TIERS.values():
        game.load(task, 0)
        env = game.env
        splits[task] = {"train": list(env.get_variations_train()), "dev": list(env.get_variations_dev()),
                        "test": list(env.get_variations_test())}
    files = gen.make_splits(splits)
    for name, rows in files.items():
        shipped = [json.loads(line) for line in (SW / "data" / f"{name}.jsonl").read_text().splitlines()]
        assert shipped == rows, name
    for task, by in splits.items():    # train, dev and test variations are disjoint, and so are the files
        assert not set(by["train"]) & set(by["dev"]) and not set(by["dev"]) & set(by["test"])
    seen = {name: {(r["task_name"], r["variation"]) for r in rows} for name, rows in files.items()}
    assert not seen["train"] & seen["val"] and not seen["val"] & seen["test"] and not seen["train"] & seen["test"]
    assert {r["tier"] for r in files["val"]} == {"easy", "medium", "hard"}


def test_an_episode_against_the_game_scores_valid_refused_and_missing_actions(game, agent):
    """A refused action and a reply with no action are the agent's mistakes: each costs a step, the next
    observation says so (with valid actions), and the episode goes on to the game's score."""
    game.load(NON_LIVING, 0)
    client = Scripted(["Thought: I fly.\nAction: fly to the moon",
                       "Thought: I do not know what to do.",
                       "Thought: a picture is not alive.\nAction: Focus on picture."])
    episode = agent.play(client, game, max_steps=3, shots=0, hint_actions=3)
    assert episode["actions"] == ["fly to the moon", "(none)", "focus on picture"]
    assert episode["invalid"] == 2 and episode["steps"] == 3 and not episode["finished"]
    assert episode["score"] > 0 and episode["reward"] == episode["score"] / 100     # focus on a non-living thing
    second, third = client.requests[1]["messages"], client.requests[2]["messages"]
    assert second[-1]["content"].startswith("Observation: No known action matches that input.")
    assert second[-1]["content"].count(";") == 2 and "Valid actions include: " in second[-1]["content"]
    assert third[-1]["content"].startswith("Observation: Write your action on a line that starts with 'Action:'")
    assert client.requests[0]["stop"] == agent.STOP
    # the episode ends when the game says so: here, the task done
    game.load(NON_LIVING, 0)
    solved = agent.play(Scripted(["Action: focus on picture", "Action: pick up picture", "Action: go to kitchen",
                                  "Action: move picture to red box"]), game, max_steps=10, shots=0)
    assert solved["finished"] and solved["score"] == 100 and solved["reward"] == 1.0 and solved["steps"] == 4


def test_the_history_is_compacted_every_few_steps(game, agent):
    """Within a window each prompt extends the previous call's; at a compaction it is rewritten: the task,
    the actions so far (refused ones marked) and the room as it is now."""
    game.load(NON_LIVING, 0)
    client = Scripted(["Action: look around", "Action: dance", "Action: go to kitchen", "Action: look around",
                       "Action: look around"])
    episode = agent.play(client, game, max_steps=5, compact_every=2, shots=1)
    assert episode["compactions"] == 2 and episode["steps"] == 5
    calls = [r["messages"] for r in client.requests]

    def extends(later, earlier):
        return later[:len(earlier)] == earlier

    assert extends(calls[1], calls[0]) and extends(calls[3], calls[2])
    assert not extends(calls[2], calls[1]) and not extends(calls[4], calls[3])
    rewritten = calls[2][-1]["content"]
    assert "Your actions so far: look around; dance (refused)" in rewritten
    assert "This room is called the hallway" in rewritten
    assert "Your actions so far: look around; dance (refused); go to kitchen; look around" in calls[4][-1]["content"]
    assert "This room is called the kitchen" in calls[4][-1]["content"]
    assert calls[2][:len(agent.shot_turns(1))] == agent.shot_turns(1)          # the worked dialogue stays


def test_a_task_the_game_lacks_is_refused_naming_the_field(game, agent):
    with pytest.raises(ValueError, match="TASK_NAME='find-unicorn' is not a ScienceWorld task"):
        game.load("find-unicorn", 0)
    with pytest.raises(ValueError, match=r"VARIATION_IDX=9999 is outside find-non-living-thing's 0\.\.299"):
        game.load(NON_LIVING, 9999)


def fake_path(tmp_path, java: str | None):
    """A PATH with nothing on it but, when given, a ``java`` that is this shell script."""
    bin_dir = tmp_path / ("bin-" + ("none" if java is None else "crash"))
    bin_dir.mkdir()
    if java is not None:
        (bin_dir / "java").write_text(java)
        (bin_dir / "java").chmod(0o755)
    return str(bin_dir)


def test_an_engine_that_cannot_start_exits_75_without_a_reward(agent, tmp_path):
    """No Java at all: exit status 75 (infrastructure), no model call, no reward printed."""
    pytest.importorskip("scienceworld", reason="pip install -e '.[scienceworld]'")
    env = {**os.environ, "PATH": fake_path(tmp_path, None), "TASK_NAME": NON_LIVING, "VARIATION_IDX": "0",
           "OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": "x"}
    out = subprocess.run([sys.executable, str(SW / "agent.py")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 75, out.stderr[-2000:]
    assert "the ScienceWorld engine did not start (FileNotFoundError" in out.stderr and not out.stdout.strip()


@pytest.mark.e2e
def test_a_crashing_engine_is_an_infrastructure_failure(collector, tmp_path):
    """Under ``lightspan rollout``: a jar that dies at start makes every attempt exit 75, outcome infra,
    no reward stored; the transition builder drops them as infra, never as a reward of 0."""
    pytest.importorskip("scienceworld", reason="pip install -e '.[scienceworld]'")
    from lightspan import store
    from tests.conftest import free_port

    data, ports = collector
    api = f"http://127.0.0.1:{ports['api']}"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "sw1", "task_name": NON_LIVING, "variation": 0}) + "\n")
    crash = fake_path(tmp_path, "#!/bin/sh\necho 'Error: Unable to access jarfile' >&2\nexit 1\n")
    env = {**os.environ, "PATH": crash + os.pathsep + os.environ.get("PATH", "")}
    out = subprocess.run([sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(tasks), "--samples", "1",
                          "--env-map", ENV_MAP, "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}",
                          "--openai-base-url", f"http://127.0.0.1:{free_port()}/v1", "--data-dir", str(data),
                          "--timeout-s", "120", "--", sys.executable, str(SW / "agent.py")],
                         env=env, check=True, text=True, stdout=subprocess.PIPE).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["ok"], summary["failed"], summary["infra"]) == (0, 0, 1), summary
    requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()
    rows = store.connect(data).execute(
        "SELECT outcome, exit_code, status, final_reward FROM rollouts WHERE task_id = 'sw1'").fetchall()
    assert rows == [("infra", 75, "infra", None)] * 2, rows           # tried twice
    logs = list((data / "rollout-logs").glob("sw1-*.log"))
    assert any("the ScienceWorld engine did not start" in p.read_text() for p in logs)
    built = lightspan("transitions", "build", "--data-dir", str(data), "--grace-s", "0")
    assert built["transitions/dropped_rollouts/infra"] == 2 and built.get("transitions/calls", 0) == 0, built


@pytest.mark.e2e
def test_scienceworld_trains_one_step_from_its_traces(collector, vllm_server, tiny_model, tmp_path, game):
    """The unchanged agent plays the real game under ``lightspan rollout`` with the tiny model (its
    context is 1,024 bytes: no worked dialogue, short observations, a prompt rewritten every step), then
    transitions and one GRPO step. The tiny model writes random bytes (no action: the game scores 0); a
    grader marks one rollout solved so that the group has an advantage."""
    from lightspan import store
    from lightspan.trainer.sync import ReloadSync

    data, ports = collector
    api = f"http://127.0.0.1:{ports['api']}"
    ReloadSync(vllm_server.url).push(str(tiny_model), 0)
    tasks = tmp_path / "train.jsonl"
    tasks.write_text(json.dumps({"id": "sw-easy-0", "task_name": NON_LIVING, "variation": 0, "shots": 0,
                                 "max_steps": 2, "compact_every": 1, "max_tokens": 8, "hint_actions": 2,
                                 "obs_chars": 120, "temperature": 0.8}) + "\n")
    out = lightspan("rollout", "--tasks", str(tasks), "--samples", "2", "--env-map", ENV_MAP,
                    "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}", "--openai-base-url",
                    f"{vllm_server.url}/v1", "--data-dir", str(data), "--timeout-s", "180",
                    "--", sys.executable, str(SW / "agent.py"))
    assert out["ok"] == 2, out
    requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()
    con = store.connect(data)
    rollouts = con.execute("SELECT rollout_key, final_reward FROM rollouts WHERE task_id = 'sw-easy-0' "
                           "ORDER BY rollout_key").fetchall()
    assert len(rollouts) == 2 and all(r[1] is not None and 0.0 <= r[1] <= 1.0 for r in rollouts), rollouts
    calls = con.execute("SELECT count(*) FILTER (WHERE len(completion_token_ids) > 0) FROM llm_calls").fetchone()[0]
    assert calls == 4          # two steps each: the game was played to the step limit
    requests.post(f"{api}/v1/rewards", json={"rollout_id": rollouts[0][0], "value": 1.0, "name": "grader"},
                  timeout=30).raise_for_status()
    requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()
    built = lightspan("transitions", "build", "--data-dir", str(data), "--grace-s", "0")
    assert built["transitions/calls"] == calls and built["transitions/nonzero_advantage"] > 0, built
    train_one_step(data, tiny_model, vllm_server.url)
