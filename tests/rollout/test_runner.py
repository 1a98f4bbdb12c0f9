"""The rollout runner: environment, task files, outcomes and process-group timeouts."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from urllib.parse import unquote

import pytest

from lightspan.core.config import ConfigError
from lightspan import store
from lightspan.rollout import runner
from lightspan.tracing import semconv


def _cfg(tmp_path, tasks=None, **kw):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in (tasks or [{"id": "t1"}])))
    return runner.RolloutConfig(tasks=str(path), data_dir=str(tmp_path), **kw)


def test_resource_attributes_are_appended_and_encoded():
    out = runner.resource_attributes("deployment.environment=prod,lightspan.task.id=old", "r 1", "a,b=c", "val")
    pairs = dict(kv.split("=", 1) for kv in out.split(","))
    assert pairs["deployment.environment"] == "prod"
    assert unquote(pairs[semconv.TASK_ID]) == "a,b=c"
    assert unquote(pairs[semconv.ROLLOUT_ID]) == "r 1"
    assert pairs[semconv.SPLIT] == "val"


def test_task_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n{"question": "no id"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 has no \"id\""):
        runner.load_tasks(bad)
    bad.write_text('{"id": 1}\nnot json\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2 is not JSON"):
        runner.load_tasks(bad)
    assert runner.load_tasks(_cfg(tmp_path).tasks) == [{"id": "t1"}]


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="rollout.tasks"):
        runner.RolloutConfig(tasks=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="rollout.samples"):
        _cfg(tmp_path, samples=0)


def test_agent_environment_carries_task_version_and_capture_url(tmp_path):
    cfg = _cfg(tmp_path, openai_base_url="http://127.0.0.1:9/v1", split="val")
    env = runner.agent_environment(cfg, {"id": "t1", "x": 3}, "t1-abc", 5)
    assert json.loads(env["LIGHTSPAN_TASK"]) == {"id": "t1", "x": 3}
    assert env["LIGHTSPAN_MODEL_VERSION"] == "5"
    assert env["OPENAI_BASE_URL"] == env["LIGHTSPAN_CAPTURE_URLS"] == "http://127.0.0.1:9/v1"
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9"   # the anthropic client adds /v1/messages
    assert "lightspan.rollout.id=t1-abc" in env["OTEL_RESOURCE_ATTRIBUTES"]
    assert "lightspan.split=val" in env["OTEL_RESOURCE_ATTRIBUTES"]


def test_behind_a_gateway_the_ids_travel_in_the_base_url(tmp_path):
    from lightspan.rollout.gateway import route
    from lightspan.tracing.instrumentor import should_capture

    cfg = _cfg(tmp_path, gateway_url="http://127.0.0.1:8100/", split="val")
    env = runner.agent_environment(cfg, {"id": "t/1"}, "t/1-abc", 5)
    base = env["OPENAI_BASE_URL"]
    assert base.startswith("http://127.0.0.1:8100/rollouts/")
    ids, path = route(base.removeprefix("http://127.0.0.1:8100") + "/chat/completions")
    assert ids == {semconv.ROLLOUT_ID: "t/1-abc", semconv.TASK_ID: "t/1", semconv.SPLIT: "val"}
    assert path == "/v1/chat/completions"
    # the in-process instrumentor leaves these calls to the gateway, even on loopback
    assert not should_capture(base, "/chat/completions", env["LIGHTSPAN_CAPTURE_URLS"].split(","))


def test_served_version_reads_policy_json(tmp_path):
    assert store.policy.served_version(tmp_path) == 0
    (tmp_path / "policy.json").write_text(json.dumps({"version": 3}))
    assert store.policy.served_version(tmp_path) == 3
    (tmp_path / "policy.json").write_text("{not json")     # someone else's file: the initial model
    assert store.policy.served_version(tmp_path) == 0
    store.policy.write(tmp_path, 4, tmp_path)
    assert store.policy.read(tmp_path).version == 4 and store.policy.read(tmp_path).path == str(tmp_path.resolve())


def _run_one(tmp_path, code: str, timeout_s: float = 60.0):
    cfg = _cfg(tmp_path, timeout_s=timeout_s)
    return runner.run_one(cfg, [sys.executable, "-c", code], {"id": "t1"}, 0, None, tmp_path)


def test_outcomes_are_classified(tmp_path):
    ok = _run_one(tmp_path, "import os, json; print(json.loads(os.environ['LIGHTSPAN_TASK'])['id'])")
    assert (ok.outcome, ok.exit_code) == ("ok", 0)
    assert (tmp_path / f"{ok.rollout_id}.log").read_text().strip().endswith("t1")
    failed = _run_one(tmp_path, "raise SystemExit(3)")
    assert (failed.outcome, failed.exit_code) == ("failed", 3)
    killed = _run_one(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.outcome == "infra"  # died by a signal the runner did not send: retried


def test_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(120)")
    out = _run_one(tmp_path, code, timeout_s=20.0)
    assert out.outcome == "timeout"
    child = int(pid_file.read_text())
    # the grandchild was killed with its group: its /proc entry goes (or shows a zombie) at once;
    # SIGKILL delivery is asynchronous, so poll briefly with a deadline
    status = Path(f"/proc/{child}/status")
    deadline = time.monotonic() + 5
    while status.exists() and "zombie" not in status.read_text().lower() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not status.exists() or "zombie" in status.read_text().lower()


# --- the agent's interpreter, and Agent Lightning's environment -----------------------------------

def test_a_bare_python_is_this_environments_interpreter(tmp_path, monkeypatch):
    """``rollout -- python agent.py`` runs lightspan's interpreter, whatever ``python`` is first on
    PATH; and the agent's own ``python`` children (an MCP server) find it first on PATH too."""
    decoy = tmp_path / "bin"
    decoy.mkdir()
    (decoy / "python").write_text("#!/bin/sh\necho decoy\n")
    (decoy / "python").chmod(0o755)
    monkeypatch.setenv("PATH", f"{decoy}:{Path(sys.executable).parent}:/usr/bin:/bin")
    code = "import sys; print('agent', sys.executable)"
    out = runner.run_one(_cfg(tmp_path), ["python", "-c", code], {"id": "t1"}, 0, None, tmp_path)
    text = (tmp_path / f"{out.rollout_id}.log").read_text()
    assert out.outcome == "ok" and f"agent {sys.executable}" in text, text
    for name in ("python3", "python3.11"):
        assert runner.instrumented([name, "a.py"])[1:] == [sys.executable, "a.py"]
    for as_given in (["/opt/other/bin/python", "a.py"], ["node", "a.js"], ["pythonista"]):
        assert runner.instrumented(as_given)[1:] == as_given
    # the agent's own `python` children (an MCP server) find its interpreter first, as if its
    # virtual environment were activated
    if sys.prefix != sys.base_prefix:
        assert runner.activated_path(["python", "a.py"], f"{decoy}:/bin") == f"{Path(sys.executable).parent}:{decoy}:/bin"
    other = tmp_path / "venv"
    (other / "bin").mkdir(parents=True)
    (other / "pyvenv.cfg").write_text("home = /usr/bin\n")
    assert runner.activated_path([str(other / "bin" / "python3"), "a.py"], "/bin") == f"{other / 'bin'}:/bin"
    assert runner.activated_path(["/usr/bin/python3", "a.py"], "/bin") == "/bin"      # not a venv
    if sys.prefix != sys.base_prefix:   # any other command (a shell, env, a wrapper): this environment first
        for command in (["node", "a.js"], ["sh", "-c", "exec python a.py"], ["/usr/bin/env", "python", "a.py"]):
            assert runner.activated_path(command, "/bin") == f"{Path(sys.executable).parent}:/bin", command


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="lightspan runs in no virtual environment here")
def test_an_agent_started_through_a_shell_gets_lightspans_environment(tmp_path, monkeypatch):
    """``sh -c "exec python -m lightspan.rollout.agent_class MODULE.CLASS"`` in process mode (issue
    32, 5): the shell's ``python`` is lightspan's, instrumented, with a decoy ``python`` first on the
    caller's PATH; the agent's calls are stored with their rollout's ids and their token ids."""
    from tests.attacks.conftest import Upstream
    from tests.conftest import collector_process

    decoy = tmp_path / "bin"
    decoy.mkdir()
    (decoy / "python").write_text("#!/bin/sh\necho decoy: no lightspan here\nexit 3\n")
    (decoy / "python").chmod(0o755)
    (tmp_path / "shellagent").mkdir()
    (tmp_path / "shellagent" / "__init__.py").write_text(
        "from openai import OpenAI\n"
        "class Agent:\n"
        "    def run(self):\n"
        "        client = OpenAI(max_retries=0)\n"
        "        for n in range(2):\n"
        "            client.chat.completions.create(model='policy', messages=[{'role': 'user', 'content': str(n)}])\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{decoy}:/usr/bin:/bin")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    llm = Upstream()
    data = tmp_path / "data"
    data.mkdir()
    try:
        with collector_process(data, tmp_path / "collector.log") as (_, ports):
            cfg = _cfg(tmp_path, openai_base_url=f"{llm.url}/v1", otlp_endpoint=f"http://127.0.0.1:{ports['http']}",
                       mode="process", timeout_s=90.0)
            out = runner.run_one(cfg, ["sh", "-c", "exec python -m lightspan.rollout.agent_class shellagent.Agent"],
                                 {"id": "t1"}, 0, None, tmp_path)
            log = (tmp_path / f"{out.rollout_id}.log").read_text()
            assert out.outcome == "ok" and "decoy" not in log, log
            import requests

            requests.post(f"http://127.0.0.1:{ports['api']}/v1/flush", timeout=60).raise_for_status()
            rows = store.connect(data).execute(
                "SELECT rollout_id, task_id, prompt_token_ids IS NOT NULL FROM llm_calls").fetchall()
    finally:
        llm.close()
    assert rows == [(out.rollout_id, "t1", True)] * 2, rows


def test_agent_lightning_agents_get_their_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("AGL_KEY", raising=False)
    cfg = _cfg(tmp_path, openai_base_url="http://127.0.0.1:9/v1", collector_api_url="http://127.0.0.1:8321/",
               env_map=("QUESTION=input.question", "RESULT=input.result", "STEPS=input.steps",
                        "FIRST=input.steps.0", "TASK=input", "GSM8K_MODEL=/models/tiny"))
    task = {"id": "t/1", "question": "1 + 1?", "result": "2", "steps": ["a", "b"]}
    env = runner.agent_environment(cfg, task, "t/1-abc", None)
    assert env["AGL_OPENAI_BASE_URL"] == env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1"
    assert env["AGL_KEY"] == env["OPENAI_API_KEY"] == "lightspan"
    assert env["AGL_EVENT_URL"] == "http://127.0.0.1:8321/v1/rollouts/t%2F1-abc/events"
    assert (env["QUESTION"], env["RESULT"], env["FIRST"], env["GSM8K_MODEL"]) == ("1 + 1?", "2", "a", "/models/tiny")
    assert json.loads(env["STEPS"]) == ["a", "b"] and json.loads(env["TASK"]) == task
    # the caller's key is the agent's, Agent Lightning's included
    monkeypatch.setenv("OPENAI_API_KEY", "sk-mine")
    assert runner.agent_environment(cfg, task, "r", None)["AGL_KEY"] == "sk-mine"
    # behind the gateway, Agent Lightning's base URL is the gateway's per-rollout one too
    gw = runner.agent_environment(_cfg(tmp_path, gateway_url="http://127.0.0.1:8100"), task, "r", None)
    assert gw["AGL_OPENAI_BASE_URL"] == gw["OPENAI_BASE_URL"] and "/rollouts/r/" in gw["OPENAI_BASE_URL"]


def test_env_map_errors_name_the_field_and_the_task_line(tmp_path):
    with pytest.raises(ConfigError, match="rollout.env_map"):
        _cfg(tmp_path, env_map=("no-equals-sign",))
    with pytest.raises(ConfigError, match="rollout.env_map"):
        _cfg(tmp_path, env_map=("1BAD=input.question",))
    cfg = _cfg(tmp_path, tasks=[{"id": "a", "question": "q"}, {"id": "b"}], env_map=("QUESTION=input.question",))
    with pytest.raises(ConfigError, match=r"tasks.jsonl:2: QUESTION=input.question: the task has no 'question'"):
        runner.run(cfg, ["python", "-c", "pass"])


def test_an_agent_class_runs_as_agent_lightnings_runner_runs_it(tmp_path, monkeypatch, capsys):
    """``python -m lightspan.rollout.agent_class MODULE.CLASS`` (the runner starts it like any
    command): sync and async ``run``; a failing one exits 1 with its traceback; imported from the
    working directory."""
    from lightspan.rollout import agent_class

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "agents.py").write_text(
        "import asyncio\n"
        "class Sync:\n    def run(self):\n        print('sync ran')\n"
        "class Async:\n    async def run(self):\n        await asyncio.sleep(0)\n        print('async ran')\n"
        "class Fails:\n    async def run(self):\n        raise RuntimeError('the agent broke')\n"
        "not_a_class = 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert agent_class.main(["pkg.agents.Sync"]) == 0 and "sync ran" in capsys.readouterr().out
    assert agent_class.main(["pkg.agents:Async"]) == 0 and "async ran" in capsys.readouterr().out
    assert agent_class.main(["pkg.agents.Fails"]) == 1 and "RuntimeError: the agent broke" in capsys.readouterr().err
    assert agent_class.main(["pkg.agents.not_a_class"]) == 1 and "is not a class" in capsys.readouterr().err
    assert agent_class.main([]) == 2


def test_the_summary_flags_calls_that_were_not_captured(caplog):
    def outcome(rid, report, result="ok"):
        return runner.Outcome(rid, "t", result, 0, 0, 1, 0, report)

    reports = [outcome("a", {"calls": 3, "captured": 2, "not_captured": {"no_logprobs": 1},
                             "reasons": {"no_logprobs": "vLLM dropped them; use chat completions"}}),
               outcome("b", {"calls": 2, "captured": 0, "not_captured": {"other_url": 2},
                             "reasons": {"other_url": "http://x is not a capture URL"}}),
               outcome("c", None), outcome("d", None, "failed")]
    with caplog.at_level("WARNING", logger="lightspan.rollout.runner"):
        summary = runner.capture_summary(reports)
    assert summary == {"calls": 5, "captured": 2, "not_captured": {"no_logprobs": 1, "other_url": 2},
                       "reasons": {"no_logprobs": "vLLM dropped them; use chat completions",
                                   "other_url": "http://x is not a capture URL"},
                       "rollouts_without_ids": ["b"], "rollouts_without_report": 1}
    text = caplog.text
    assert "1 LLM call(s) not captured (no_logprobs): vLLM dropped them; use chat completions" in text
    assert "with LLM calls and no token ids" in text and "left no capture report" in text
