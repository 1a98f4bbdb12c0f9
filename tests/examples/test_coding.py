"""examples/coding: bug injection (a failing test the clean package passes), the reward step (a hand-fixed
copy passes, a bugged one and forging attempts do not), isolation of the agent's commands (mini-swe-agent's
own BubblewrapEnvironment with the example's command line: hostile commands reach neither the host, the
network, nor another rollout's copy), and one short mini-swe-agent episode with the tiny model under
``lightspan rollout`` on the suite's shared vLLM, its calls captured with token ids, then one training step."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.examples.test_examples import (  # noqa: F401 (collector: a fixture)
    EXAMPLES, collector, lightspan, load, grade_first_of_each_task, train_one_step)

CODING = EXAMPLES / "coding"
AGENT = CODING / "agent.py"
ROOTED = os.geteuid() == 0 and shutil.which("bwrap") and shutil.which("prlimit") and shutil.which("unshare")
needs_sandbox = pytest.mark.skipif(not ROOTED, reason="needs root, bubblewrap, prlimit and unshare "
                                                      "(bash examples/sandbox/setup.sh)")


@pytest.fixture(scope="module")
def grade():
    module = load(CODING / "grade.py")
    try:
        module.Sandbox(module.sandbox_config()).check()
    except module.SandboxUnavailable as e:
        pytest.skip(f"the sandbox cannot run here: {e}")
    return module


@pytest.fixture(scope="module")
def tasks():
    rows = [json.loads(line) for line in (CODING / "data" / "val.jsonl").read_text().splitlines()]
    return {t["id"]: t for t in rows}


def bugged(tmp_path, task, name="copy"):
    make = load(CODING / "make_tasks.py")
    copy = tmp_path / name
    shutil.copytree(CODING / "textkit", copy)
    make.bugged_copy(copy, task["file"].split("/")[-1], task["line"], task["original"], task["buggy"])
    return copy


def pytest_in(copy) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest"], cwd=copy, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


def test_mutations_are_one_token_changes_on_one_line():
    make = load(CODING / "make_tasks.py")
    source = "def f(a, b):\n    if a < b and b > 0:\n        return a + 1\n    return b - a\n"
    found = {(line, buggy) for line, _, buggy in make.mutations(source)}
    assert (2, "    if a <= b and b > 0:") in found and (2, "    if a < b or b > 0:") in found
    assert (3, "        return a - 1") in found and (3, "        return a + 2") in found
    assert (4, "    return b + a") in found
    for line, original, buggy in make.mutations(source):
        assert source.splitlines()[line - 1] == original != buggy
    # the command tier's edit: the changed token with its neighbours, regex characters escaped
    assert make.edit_command("m.py", 2, "    if a <= b and b > 0:", "    if a < b and b > 0:") == "sed -i '2s/a < b/a <= b/' m.py"
    assert make.edit_command("m.py", 3, "    x = y[i - 1].z", "    x = y[i - 2].z") == "sed -i '3s/- 2\\]\\./- 1]./' m.py"


def test_an_injected_bug_fails_its_named_test_and_the_clean_package_passes(grade, tasks, tmp_path):
    clean = pytest_in(shutil.copytree(CODING / "textkit", tmp_path / "clean"))
    assert clean.returncode == 0 and "80 passed" in clean.stdout, clean.stdout[-500:]
    task = tasks["bug003-line"]
    copy = bugged(tmp_path, task)
    run = pytest_in(copy)
    assert run.returncode == 1 and f"FAILED tests/test_textkit.py::{task['failing'][0]}" in run.stdout, run.stdout[-800:]
    assert f"line {task['line']} of {task['file']}" in task["statement"]
    # the five tiers of one bug say less and less, and are in one split
    same = [t for t in tasks.values() if t["bug"] == task["bug"]]
    assert [t["tier"] for t in same] == ["command", "fix", "line", "function", "test"]
    assert task["failing"][0] in same[3]["statement"] and task["file"] not in same[3]["statement"]
    assert task["failing"][0] not in same[4]["statement"]
    assert (same[1]["original"].strip() in same[1]["statement"]) and same[1]["buggy"].strip() in same[1]["statement"]
    # the command tier gives the edit itself: run with the real sed on a bugged copy, it restores the file
    command = same[0]["command"]
    assert command.startswith(f"sed -i '{task['line']}s/") and command in same[0]["statement"]
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in same[0]["statement"]
    make = load(CODING / "make_tasks.py")
    make.check_command(command, copy, task["file"], (CODING / "textkit" / task["file"]).read_text())
    train_bugs = {json.loads(line)["bug"] for line in (CODING / "data" / "train.jsonl").read_text().splitlines()}
    assert not train_bugs & {t["bug"] for t in tasks.values()}


def test_the_reward_step_passes_a_hand_fixed_copy_only(grade, tasks, tmp_path):
    task = tasks["bug003-function"]
    copy = bugged(tmp_path, task)
    before = grade.grade(copy)
    assert not before["passed"] and set(task["failing"]) <= set(before["failed_visible"]), before
    path = copy / task["file"]
    path.write_text(path.read_text().replace(task["buggy"], task["original"]))   # the fix, by hand
    after = grade.grade(copy)
    assert after == {"passed": True, "cases": before["cases"], "failed": 0, "failed_visible": [], "failed_hidden": []}


def test_the_reward_cannot_be_forged_from_the_copy(grade, tasks, tmp_path):
    """What the policy's commands could do to its copy instead of fixing the bug: none passes."""
    task = tasks["bug003-function"]
    fake = json.dumps([{"ok": None}] * 200)
    attempts = {
        # the shipped tests rewritten to expect the bug, or deleted: the grader reads the clean package's tests
        "tests": lambda c: (c / "tests" / "cases.py").write_text("CASES = {}\n"),
        # print results and exit before the driver: only the inputs reach the sandbox, never the expected values
        "exit": lambda c: (c / "textkit" / "__init__.py").write_text(
            f"print({grade.MARK!r} + {fake!r})\nimport os\nos._exit(0)\n"),
        # memorise the shipped cases: the held-back inputs still fail
        "memo": lambda c: (c / "textkit" / "case.py").write_text(
            (c / "textkit" / "case.py").read_text()
            + "\n_snake = snake_case\ndef snake_case(text):\n    return 'title_case_words' if text == 'Title Case Words' "
              "else _snake(text)\n"),
        # a symlink to a host file in place of a module: skipped, never read
        "link": lambda c: ((c / "textkit" / "count.py").unlink(), (c / "textkit" / "count.py").symlink_to("/etc/passwd")),
    }
    for name, attack in attempts.items():
        copy = bugged(tmp_path, task, name)
        attack(copy)
        assert not grade.grade(copy)["passed"], name


@pytest.fixture
def shared_tmp():
    """A directory the sandboxes' user ids can reach: pytest's own temporary directories are private to
    root (and re-made so by every pytest session on the machine), so this one lives in /tmp, 0755."""
    import tempfile

    path = tempfile.mkdtemp(prefix="lightspan-coding-test-", dir="/tmp")
    os.chmod(path, 0o755)
    yield __import__("pathlib").Path(path)
    shutil.rmtree(path, ignore_errors=True)


def shared_dir(base, name):
    path = base / name
    path.mkdir()
    return path


ISOLATION = r"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import agent
from minisweagent.environments.extra.bubblewrap import BubblewrapEnvironment

task, base, host_file, port = json.loads(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5])
cfg = agent.SandboxConfig.from_env()
envs = {}
for name in ("a", "b"):
    uid, lock = agent.claim_uid()
    repo = agent.working_copy(task, base / name, uid, 8)
    exe, args = agent.sandbox_command(cfg, uid)
    envs[name] = (BubblewrapEnvironment(cwd=str(repo), executable=exe, wrapper_args=args, timeout=10), uid, lock, repo)
env_a, uid_a, _, repo_a = envs["a"]
_, _, _, repo_b = envs["b"]
commands = {
    "host_file": f"cat {host_file}; echo pwned > {host_file}",
    "other_copy": f"ls {repo_b}; echo pwned > {repo_b}/textkit/case.py",
    "system": "echo pwned > /usr/pwned; echo pwned > /pwned",
    "network": f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), timeout=3)'",
    "fork_bomb": "f() { f | f & }; f; sleep 2; echo survived",
    "memory": "python3 -c 'x = bytearray(2 * 1024 ** 3)'",
    "flood": "yes",
    "disk": "head -c 100000000 /dev/zero > big; r=$?; ls -l big; rm big; exit $r",
    "own_copy": "echo ok > note && cat note",
}
out = {}
for name, command in commands.items():
    r = env_a.execute({"command": command})
    out[name] = {"rc": r["returncode"], "output": r["output"][-400:], "bytes": len(r["output"])}
def left():
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and p.stat().st_uid == uid_a:
                state = (p / "stat").read_text().split(")")[-1].split()[0]
                if state != "Z":   # a zombie is dead already: this machine's PID 1 reaps orphans late
                    found.append(state + " " + (p / "cmdline").read_text()[:60])
        except OSError:
            pass
    return found
import time
deadline = time.monotonic() + 30   # processes SIGKILLed with their namespace may take a moment to be gone
while left() and time.monotonic() < deadline:
    time.sleep(0.2)
out["left"] = left()
out["uids"] = [envs["a"][1], envs["b"][1]]
print(json.dumps(out))
"""


@needs_sandbox
def test_hostile_commands_touch_neither_the_host_nor_another_rollout(tasks, tmp_path, shared_tmp):
    pytest.importorskip("minisweagent")
    host_file = tmp_path / "host-secret.txt"
    host_file.write_text("secret")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    script = tmp_path / "isolation.py"
    script.write_text(ISOLATION)
    base = shared_dir(shared_tmp, "rollouts")
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, str(script), str(CODING),
         json.dumps(tasks["bug003-line"]), str(base), str(host_file), str(listener.getsockname()[1])],
        capture_output=True, text=True, timeout=600, env={**os.environ, "MSWEA_SILENT_STARTUP": "1",
                                                          "CODING_WORK_DIR": str(shared_dir(shared_tmp, "work"))})
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    with pytest.raises(TimeoutError):
        listener.accept()                                  # nothing reached the host's loopback
    listener.close()
    assert host_file.read_text() == "secret" and "No such file" in out["host_file"]["output"]
    assert "No such file" in out["other_copy"]["output"] and out["other_copy"]["rc"] != 0
    assert out["uids"][0] != out["uids"][1]
    assert not os.path.exists("/usr/pwned") and not os.path.exists("/pwned")
    assert "Read-only file system" in out["system"]["output"]
    assert out["network"]["rc"] != 0 and ("unreachable" in out["network"]["output"] or
                                          "refused" in out["network"]["output"]), out["network"]
    assert out["fork_bomb"]["rc"] is not None and "Resource temporarily unavailable" in out["fork_bomb"]["output"]
    assert out["memory"]["rc"] != 0 and "MemoryError" in out["memory"]["output"]
    assert out["flood"]["bytes"] <= 65536 and out["flood"]["rc"] != 0        # output capped, `yes` ended
    assert out["disk"]["rc"] != 0 and "big" in out["disk"]["output"]          # file size limited
    assert out["own_copy"] == {"rc": 0, "output": "ok\n", "bytes": 3}
    assert out["left"] == []                                                    # nothing outlived its command
    assert not list(base.rglob("*.py"))    # the copies were tmpfs in the helper's mount namespace: gone with it


TINY_CONFIG = """
agent:
  agent_class: default
  step_limit: 2
  cost_limit: 0
  system_template: "Fix the bug. Reply with one ```bash block."
  instance_template: "{{task}}"
environment:
  environment_class: bubblewrap
  timeout: 30
model:
  model_class: litellm_textbased
  cost_tracking: ignore_errors
  model_kwargs: {max_tokens: 16, temperature: 0.8, drop_params: true}
  format_error_template: "One ```bash block."
"""


@pytest.mark.e2e
@needs_sandbox
def test_a_mini_swe_agent_episode_is_captured_and_trains_one_step(collector, vllm_server, tiny_model, tmp_path,  # noqa: F811
                                                                    tasks, shared_tmp):
    """mini-swe-agent, unchanged, with the tiny model: every call captured with its token ids under
    lightspan rollout, the reward step's 0 stored per rollout, then (a grader marking one rollout per task
    solved, as the tiny model writes random bytes) one GRPO step."""
    pytest.importorskip("minisweagent")
    from lightspan import store
    from lightspan.trainer.sync import ReloadSync

    data, ports = collector
    api = f"http://127.0.0.1:{ports['api']}"
    ReloadSync(vllm_server.url).push(str(tiny_model), 0)
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)       # the tiny model's context is 1024 bytes: short templates
    task_file = tmp_path / "tasks.jsonl"
    picked = [tasks["bug003-fix"], tasks["bug007-fix"]]
    task_file.write_text("".join(json.dumps({**t, "statement": t["failing"][0] + " fails."}) + "\n" for t in picked))
    env = {**os.environ, "CODING_CONFIG": str(config), "CODING_WORK_DIR": str(shared_dir(shared_tmp, "work"))}
    out = json.loads(subprocess.run(
        [sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(task_file), "--samples", "2",
         "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}", "--openai-base-url", f"{vllm_server.url}/v1",
         "--data-dir", str(data), "--timeout-s", "300", "--retries", "0", "--",
         "unshare", "--mount", "--propagation", "private", "python", str(AGENT)],
        check=True, text=True, stdout=subprocess.PIPE, env=env).stdout.strip().splitlines()[-1])
    assert out["ok"] == 4, out
    requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()
    con = store.connect(data)
    rollouts = con.execute("SELECT rollout_key, task_id, final_reward FROM rollouts WHERE task_id IS NOT NULL "
                           "ORDER BY rollout_key").fetchall()
    assert len(rollouts) == 4 and all(r[2] == 0.0 for r in rollouts), rollouts
    per_rollout = con.execute("SELECT rollout_key, count(*), min(len(prompt_token_ids)), min(len(completion_token_ids)) "
                              "FROM llm_calls GROUP BY rollout_key").fetchall()
    assert len(per_rollout) == 4 and all(n == 2 and p > 0 and c > 0 for _, n, p, c in per_rollout), per_rollout
    calls = sum(n for _, n, _, _ in per_rollout)
    grade_first_of_each_task(api, rollouts)
    built = lightspan("transitions", "build", "--data-dir", str(data), "--grace-s", "0")
    assert built["transitions/calls"] == calls and built["transitions/nonzero_advantage"] > 0, built
    train_one_step(data, tiny_model, vllm_server.url)


def test_mini_swe_agent_history_grows_but_a_format_error_drops_the_reply(tmp_path, monkeypatch):
    """What the README says of mini-swe-agent 2.4.6's history, on the package itself (LiteLLM's own
    ``mock_response`` in place of a server): each call's messages extend the previous call's and its reply,
    except after a format error, where the reply is left out and only the error message is added."""
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path / "mini-config"))
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    pytest.importorskip("minisweagent")
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    replies = iter(["I will look.\n```bash\necho hi\n```", "no command here", "```bash\nls\n```"])
    sent = []
    real = litellm.completion

    def completion(**kwargs):
        sent.append([{k: m[k] for k in ("role", "content")} for m in kwargs["messages"]])
        return real(**{**kwargs, "mock_response": next(replies)})

    monkeypatch.setattr(litellm, "completion", completion)
    import yaml

    regex = yaml.safe_load((CODING / "mini.yaml").read_text())["model"]["action_regex"]   # the example's
    model = LitellmTextbasedModel(model_name="openai/policy", cost_tracking="ignore_errors", action_regex=regex)
    agent = DefaultAgent(model, LocalEnvironment(cwd=str(tmp_path)), system_template="sys",
                         instance_template="{{task}}", step_limit=3, cost_limit=0)
    agent.run("task")
    first, second, third = sent
    assert second[:len(first)] == first and second[len(first)]["role"] == "assistant"   # extends: reply + output
    assert "echo hi" in second[len(first)]["content"] and "hi" in second[-1]["content"]
    assert third[:len(second)] == second and len(third) == len(second) + 1             # the bad reply is not there
    assert third[-1]["role"] == "user" and "no command here" not in json.dumps(third)


def test_sources_the_sandbox_user_cannot_reach_are_staged_where_it_can(tmp_path, monkeypatch):
    """A checkout in a private folder (a ``mktemp -d`` clone, /root) is closed to the sandbox's user id:
    what the sandbox binds from it (its bin/, pytest) is copied once under CODING_WORK_DIR/runtime."""
    agent = load(AGENT)
    closed = tmp_path / "closed"
    (closed / "tool").mkdir(parents=True)
    (closed / "tool" / "run").write_text("#!/bin/sh\n")
    os.chmod(closed, 0o700)
    base = tmp_path / "base"
    monkeypatch.setattr(agent, "BASE", base)
    staged = agent.staged(closed / "tool")
    assert staged != closed / "tool" and staged.is_relative_to(base / "runtime")
    assert (staged / "run").read_text() == "#!/bin/sh\n"
    assert agent.staged(closed / "tool") == staged                 # made once
    assert agent.staged(Path("/usr/bin")) == Path("/usr/bin")      # a reachable source is bound as it is
