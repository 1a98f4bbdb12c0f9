"""examples/sandbox: the bubblewrap sandbox with real bwrap (what comes back, and what an escape
attempt from the model's code meets), and the agent's episode against a scripted OpenAI-compatible
server on loopback. Skipped, with the reason, where bubblewrap cannot run."""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.examples.test_examples import EXAMPLES

SANDBOX = EXAMPLES / "sandbox"


def load(path: Path):
    """The example's module, registered under its own name (as the agent imports ``sandbox``)."""
    cached = sys.modules.get(path.stem)
    if cached is not None and Path(getattr(cached, "__file__", "") or "") != path:
        del sys.modules[path.stem]   # another example's module of the same name (six have a make_tasks)
    sys.path.insert(0, str(SANDBOX))
    try:
        return importlib.import_module(path.stem)
    finally:
        sys.path.remove(str(SANDBOX))


@pytest.fixture(scope="module")
def sbx():
    module = load(SANDBOX / "sandbox.py")
    try:
        module.Sandbox().check()
    except module.SandboxUnavailable as e:
        pytest.skip(f"bubblewrap cannot run here ({e}); scripts/test.sh installs Debian's bubblewrap")
    return module


@pytest.fixture(scope="module")
def agent():
    return load(SANDBOX / "agent.py")


def test_the_programs_output_comes_back(sbx):
    result = sbx.Sandbox().run("import sys\nprint(sum(range(59, 877)))\nprint('oops', file=sys.stderr)")
    assert (result.stdout, result.stderr, result.exit_code, result.limit) == ("382415\n", "oops\n", 0, None)
    failed = sbx.Sandbox().run("print('before')\n1 / 0")
    assert failed.stdout == "before\n" and failed.exit_code == 1 and "ZeroDivisionError" in failed.stderr


def test_host_files_outside_the_view_cannot_be_read(sbx, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    paths = [str(secret), str(Path(__file__).resolve()), str(EXAMPLES.parent / "pyproject.toml"), "/root",
             "/etc/passwd", "/home", sys.executable]
    program = ("import json, os\nout = {}\nfor p in %r:\n    try:\n        out[p] = open(p).read(20) if os.path.isfile(p) "
               "else os.listdir(p)\n    except OSError as e:\n        out[p] = type(e).__name__\nprint(json.dumps(out))" % paths)
    result = sbx.Sandbox().run(program)
    seen = json.loads(result.stdout)
    assert seen == {p: "FileNotFoundError" for p in paths}, seen
    listing = json.loads(sbx.Sandbox().run("import json, os\nprint(json.dumps(sorted(os.listdir('/'))))").stdout)
    assert set(listing) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "proc", "dev", "sandbox", "tmp"}, listing


def test_writes_outside_the_work_dir_fail_and_the_work_dir_is_private(sbx):
    name = f"lightspan-sandbox-{uuid.uuid4().hex}"
    program = ("import json\nout = {}\nfor p in %r:\n    try:\n        open(p, 'w').write('x')\n        out[p] = 'written'\n"
               "    except OSError as e:\n        out[p] = e.errno\nprint(json.dumps(out))"
               % ["/usr/" + name, "/" + name, "/dev/" + name, "/proc/" + name, "/sandbox/" + name, "/tmp/" + name])
    result = json.loads(sbx.Sandbox().run(program).stdout)
    assert result["/sandbox/" + name] == result["/tmp/" + name] == "written"
    assert all(v != "written" for p, v in result.items() if not p.startswith(("/sandbox/", "/tmp/"))), result
    assert not (Path("/tmp") / name).exists()        # the sandbox's /tmp is its own tmpfs
    second = sbx.Sandbox().run(f"import os\nprint(os.path.exists('/sandbox/{name}'))")
    assert second.stdout == "False\n"                 # nothing persists from one run to the next


def test_no_network_not_even_the_hosts_loopback(sbx):
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    port = server.getsockname()[1]
    program = ("import socket\nfor host in ('127.0.0.1', '10.0.0.1'):\n    try:\n"
               "        socket.create_connection((host, %d), timeout=5)\n        print(host, 'connected')\n"
               "    except OSError as e:\n        print(host, type(e).__name__)" % port)
    try:
        result = sbx.Sandbox().run(program)
        assert result.stdout.splitlines() == ["127.0.0.1 ConnectionRefusedError", "10.0.0.1 OSError"], result
        with pytest.raises(BlockingIOError):          # no connection ever reached the host's listener
            server.accept()
    finally:
        server.close()


def test_fork_bomb_memory_hog_and_loops_are_stopped_by_the_limits(sbx):
    before = sbx._processes_of(sbx.NOBODY if os.geteuid() == 0 else os.geteuid())
    bomb = sbx.Sandbox(sbx.SandboxConfig(max_processes=8, wall_s=60)).run(
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(120)\n"
        "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print(n, type(e).__name__)")
    forks, error = bomb.stdout.split()
    assert int(forks) < 8 and error == "BlockingIOError", bomb
    # its sleeping children died with the sandbox
    assert sbx._processes_of(sbx.NOBODY if os.geteuid() == 0 else os.geteuid()) == before

    hog = sbx.Sandbox(sbx.SandboxConfig(memory_mb=128)).run("x = bytearray(2 * 1024**3)\nprint('allocated')")
    assert (hog.stdout, hog.limit) == ("", "memory"), hog

    spin = sbx.Sandbox(sbx.SandboxConfig(cpu_s=1, wall_s=120)).run("while True:\n    pass")
    assert (spin.limit, spin.exit_code) == ("cpu", 128 + 9), spin      # killed at the CPU limit
    sleeper = sbx.Sandbox(sbx.SandboxConfig(wall_s=1)).run("import time\nprint('started', flush=True)\n"
                                                            "while True:\n    time.sleep(1)")
    assert (sleeper.limit, sleeper.exit_code) == ("wall", None), sleeper


def test_output_is_bounded(sbx):
    result = sbx.Sandbox(sbx.SandboxConfig(output_bytes=1000)).run("print('x' * 10**7)")
    assert result.exit_code == 0 and result.truncated and result.stdout == "x" * 1000


def test_sandbox_unavailable_is_its_own_error(tmp_path):
    sbx = load(SANDBOX / "sandbox.py")
    missing = sbx.Sandbox(sbx.SandboxConfig(bwrap=str(tmp_path / "no-such-bwrap")))
    with pytest.raises(sbx.SandboxUnavailable, match="apt-get install bubblewrap"):
        missing.run("print(1)")
    with pytest.raises(ValueError, match="SANDBOX_CPU_S"):
        sbx.SandboxConfig.from_env({"SANDBOX_CPU_S": "lots"})
    with pytest.raises(ValueError, match="SANDBOX_WALL_S"):
        sbx.SandboxConfig.from_env({"SANDBOX_WALL_S": "0"})
    assert sbx.SandboxConfig.from_env({"SANDBOX_RO_BINDS": "/usr:/opt/py"}).ro_binds == ("/usr", "/opt/py")


def test_replies_are_parsed_and_answers_scored(agent):
    assert agent.parse_reply("```python\nprint(1 + 2)") == ("code", "print(1 + 2)")
    assert agent.parse_reply("Here:\n```\nprint(3)\n```\nAnswer: 3") == ("code", "print(3)")
    assert agent.parse_reply("Answer: 'olleh'.\nmore text") == ("answer", "'olleh'.")
    assert agent.parse_reply("I think it is 5") == (None, "")
    assert agent.score("382,415", "382415") == agent.score("'olleh'.", "olleh") == 1.0
    assert agent.score("382416", "382415") == agent.score("Olleh", "olleh") == agent.score(None, "1") == 0.0
    gen = load(SANDBOX / "make_tasks.py")
    train, val = gen.make_splits(0, 80, 16)
    assert (train, val) == gen.make_splits(0, 80, 16)
    assert not {t["question"] for t in train} & {t["question"] for t in val}
    assert {t["family"] for t in val} == {f.__name__ for f in gen.FAMILIES}


class ScriptedModel:
    """An OpenAI-compatible chat server on loopback that answers with the given replies in turn and
    keeps each request's messages."""

    def __init__(self, replies: list[str]):
        self.replies, self.requests = list(replies), []
        model = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                model.requests.append(body)
                content = model.replies.pop(0) if model.replies else "no more replies"
                data = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                   "choices": [{"index": 0, "finish_reason": "stop",
                                                "message": {"role": "assistant", "content": content}}],
                                   "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def run_agent(model_url: str, task: dict, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SANDBOX / "agent.py")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OPENAI_BASE_URL": model_url, "OPENAI_API_KEY": "x",
                               "LIGHTSPAN_TASK": json.dumps(task), **env})


def test_the_agent_runs_the_models_program_and_answers_from_its_output(sbx):
    model = ScriptedModel(["```python\nprint(sum(range(59, 877)))", "Answer: 382415"])
    try:
        done = run_agent(model.url, {"id": "t", "question": "What is the sum of all integers from 59 to 876?",
                                     "answer": "382415"})
    finally:
        model.close()
    assert done.returncode == 0, done.stderr
    episode = json.loads(done.stdout.splitlines()[-1])
    assert (episode["answer"], episode["reward"], episode["turns"]) == ("382415", 1.0, 2), episode
    second = model.requests[1]["messages"]
    assert second[-2] == {"role": "assistant", "content": "```python\nprint(sum(range(59, 877)))\n```"}
    assert second[-1] == {"role": "user", "content": "Output:\n382415"}
    assert len(second) == 4 * 2 + 3        # two worked dialogues, then this one's three turns
    assert model.requests[0]["stop"] == ["\n```"]


def test_a_sandbox_that_cannot_run_fails_the_rollout_without_a_reward(tmp_path):
    model = ScriptedModel(["```python\nprint(1)"])
    try:
        done = run_agent(model.url, {"id": "t", "question": "q", "answer": "1"},
                         SANDBOX_BWRAP=str(tmp_path / "no-such-bwrap"))
    finally:
        model.close()
    assert done.returncode == os.EX_TEMPFAIL, (done.returncode, done.stderr)
    assert "sandbox unavailable" in done.stderr and "apt-get install bubblewrap" in done.stderr
    assert done.stdout == "" and model.requests == []   # the model was never called, no reward printed
