"""``lightspan vllm``: a real vLLM started through the CLI serves tool-using agents, answers to its
aliases, takes extra vLLM flags, and stops when it is stopped."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import requests

from lightspan import inference, models
from lightspan.core.config import ConfigError
from tests.conftest import ARTIFACTS, free_port

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


def _processes_with(text: str) -> list[int]:
    """PIDs whose command line mentions ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s} s")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``lightspan vllm`` (the CLI process) serving the tiny model as policy and gpt-4o-mini, with
    an extra vLLM flag after --."""
    model = models.build_tiny_model(tmp_path_factory.mktemp("vllm-cli-model") / "tiny")
    port = free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / "vllm-cli-test.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lightspan.cli", "vllm", "--model", str(model), "--port", str(port),
                                 "--max-model-len", "1024", "--aliases", "gpt-4o-mini,claude-sonnet-4-5",
                                 "--", "--max-num-seqs", "4", "--enable-prompt-tokens-details"],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        inference.wait_healthy(url, proc, 300, log_path)
        yield proc, url, model
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _processes_with(str(model)):
            os.kill(pid, signal.SIGKILL)


def test_a_request_with_tools_is_served_and_its_prompt_renders_them(served):
    _, url, model = served
    body = {"model": "gpt-4o-mini", "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            "messages": [{"role": "user", "content": "What is 2 + 3?"}], "tools": TOOLS, "tool_choice": "auto"}
    resp = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    tokenizer = models.build_tokenizer()
    prompt = tokenizer.decode(resp.json()["prompt_token_ids"])
    assert "<tools>" in prompt and '"name": "add"' in prompt
    # a tool turn renders too: the assistant's call and the tool's result reach the prompt
    body["messages"] += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    resp = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    prompt = tokenizer.decode(resp.json()["prompt_token_ids"])
    assert "<tool_call>" in prompt and "<tool_response>\n5\n</tool_response>" in prompt


def test_a_prompt_shorter_than_vllms_cpu_block_is_reused_from_the_prefix_cache(served):
    """The 8 rollouts of a GRPO group share their prompt: the second request of a prompt of about 100
    tokens takes all its whole 32-token blocks from the prefix cache (lightspan's block_size), where
    vLLM's CPU default block of 128 tokens would cache none of it."""
    _, url, _ = served
    body = {"model": "policy", "max_tokens": 2, "temperature": 0.7,
            "messages": [{"role": "user", "content": "What is 12 + 34? " * 5}]}
    usage = [requests.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["usage"] for _ in range(2)]
    prompt = usage[1]["prompt_tokens"]
    assert 64 < prompt < 128
    assert usage[1]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // 32 * 32


def test_every_alias_is_served(served):
    _, url, _ = served
    names = {m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]}
    assert {"policy", "gpt-4o-mini", "claude-sonnet-4-5"} <= names


def test_stopping_lightspan_vllm_stops_vllm(served):
    proc, url, model = served
    assert _processes_with(str(model)), "vLLM is running"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    _until(lambda: not _processes_with(str(model)), 60, "vLLM's processes did not exit")
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/health", timeout=5)


def test_a_child_gets_sigterm_when_its_parent_is_killed(tmp_path):
    """kill -9 of `lightspan vllm` leaves no vLLM behind: the kernel signals the child (prctl)."""
    marker = f"sleep {4000 + os.getpid() % 1000}.5"
    code = ("import subprocess, sys; from lightspan import inference; "
            f"subprocess.Popen({marker.split()!r}, preexec_fn=inference._die_with_parent); "
            "print('started', flush=True); sys.stdin.read()")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "started"
        _until(lambda: _processes_with(marker), 10, "the child did not start")
        parent.kill()
        parent.wait(10)
        _until(lambda: not _processes_with(marker), 10, "the child outlived its killed parent")
    finally:
        for pid in _processes_with(marker):
            os.kill(pid, signal.SIGKILL)


# --- which flags, for which model (no server) ----------------------------------------------------

def _model_dir(tmp_path, template: str | None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = {} if template is None else {"chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def _cfg(model: Path, **kw) -> inference.VLLMConfig:
    return inference.VLLMConfig(model=str(model), python=sys.executable, **kw)


def test_a_template_that_drops_tools_is_served_wrapped_with_the_hermes_parser(tmp_path):
    model = _model_dir(tmp_path, models.CHATML_TEMPLATE)           # like SmolLM2's: no tools in it
    cmd = inference.command(_cfg(model))
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in cmd
    served = Path(cmd[cmd.index("--chat-template") + 1]).read_text()
    assert served == models.with_tool_rendering(models.CHATML_TEMPLATE)
    # without tools the wrapped template renders exactly as the model's own
    from jinja2 import Template

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert (Template(served).render(messages=msgs, add_generation_prompt=True, tools=None)
            == Template(models.CHATML_TEMPLATE).render(messages=msgs, add_generation_prompt=True))


@pytest.mark.parametrize("template, parser", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<|python_tag|>{% endif %}", "llama3_json"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]{% endif %}", "mistral"),
    ("{% if tools %}<tool_call>{% endif %}", "hermes"),
])
def test_a_template_that_renders_tools_gets_its_familys_parser(tmp_path, template, parser):
    cmd = inference.command(_cfg(_model_dir(tmp_path, template)))
    assert cmd[cmd.index("--tool-call-parser") + 1] == parser and "--chat-template" not in cmd


def test_an_unknown_tool_style_or_none_turns_tool_calling_off(tmp_path, caplog):
    model = _model_dir(tmp_path, "{% if tools %}<<call>>{% endif %}")
    assert "--enable-auto-tool-choice" not in inference.command(_cfg(model))
    assert "--tool-call-parser NAME" in caplog.text
    assert "--enable-auto-tool-choice" not in inference.command(_cfg(_model_dir(tmp_path / "b", models.CHATML_TEMPLATE),
                                                                     tool_call_parser="none"))
    assert "--block-size" not in inference.command(_cfg(model, block_size=0))
    cmd = inference.command(_cfg(model, tool_call_parser="pythonic", extra_args="--max-num-seqs '8'"))
    assert cmd[cmd.index("--block-size") + 1] == "32"
    assert cmd[cmd.index("--tool-call-parser") + 1] == "pythonic" and cmd[-2:] == ["--max-num-seqs", "8"]


def test_bad_settings_name_the_field(tmp_path):
    model = _model_dir(tmp_path, None)
    with pytest.raises(ConfigError, match="vllm.aliases"):
        _cfg(model, lora_rank=16, aliases=("gpt-4o-mini",))
    with pytest.raises(ConfigError, match="vllm.extra_args"):
        _cfg(model, extra_args="--x 'unclosed")
    with pytest.raises(ConfigError, match="vllm.chat_template"):
        _cfg(model, chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="vllm.block_size"):
        _cfg(model, block_size=24)
    with pytest.raises(ConfigError, match="vllm.reader_spin_s"):
        _cfg(model, reader_spin_s=float("nan"))
    with pytest.raises(ConfigError, match="vllm.reader_recheck_s"):
        _cfg(model, reader_recheck_s=float("inf"))


@pytest.mark.skipif(not Path(inference.VLLMConfig.python).exists(), reason="no vLLM venv (scripts/setup.sh)")
@pytest.mark.parametrize("spin, recheck, expected", [(0.25, 0.05, (0.25, 50)), (-1.0, -1.0, (1.0, 5000)),
                                                     (-1.0, 0.002, (1.0, 2))])
def test_the_servers_queue_readers_wait_as_configured(tmp_path, spin, recheck, expected):
    """The server's processes (in vLLM's own venv) read lightspan/vllm_site/sitecustomize.py: vLLM's
    shared-memory queue readers then busy-wait ``reader_spin_s`` after a read and sleep at most
    ``reader_recheck_s``, not vLLM's 1 s and 5 s; a negative value leaves vLLM's. The module's own
    source is what vLLM imports, its class and constant changed."""
    cfg = inference.VLLMConfig(model=str(_model_dir(tmp_path, None)), reader_spin_s=spin, reader_recheck_s=recheck)
    probe = ("import vllm.distributed.device_communicators.shm_broadcast as m, sys; "
             "print(m.SpinCondition.__init__.__defaults__[-1], m.SHM_READER_RECHECK_INTERVAL_MS, "
             "m.__file__.startswith(sys.prefix))")
    out = subprocess.run([cfg.python, "-c", probe], env=inference.environment(cfg), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    value, recheck_ms, in_venv = out.stdout.split()
    assert (float(value), int(recheck_ms)) == expected and in_venv == "True"


def test_a_vllm_whose_queue_moved_keeps_its_own_wait_and_says_so(monkeypatch):
    """The start-up hook changes nothing it does not recognise: a ``SpinCondition`` whose last
    parameter is not ``busy_loop_s`` keeps its defaults, a module without the recheck constant (or
    with one of another type) keeps it, each with a warning in the server's log."""
    for key in ("LIGHTSPAN_VLLM_READER_SPIN_S", "LIGHTSPAN_VLLM_READER_RECHECK_S"):
        monkeypatch.delenv(key, raising=False)    # (loaded here: no finder installed)
    spec = importlib.util.spec_from_file_location("vllm_site_hook", inference.VLLM_SITE / "sitecustomize.py")
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)
    monkeypatch.setattr(site, "_SPIN", "0")
    monkeypatch.setattr(site, "_RECHECK", "0.03")

    class Moved:
        def __init__(self, is_reader, busy_loop_s=1, poll_ms=None):
            pass

    class Known:
        def __init__(self, is_reader, busy_loop_s=1):
            pass

    moved = types.SimpleNamespace(SpinCondition=Moved, SHM_READER_RECHECK_INTERVAL_MS=5.0)
    with pytest.warns(RuntimeWarning) as caught:
        site._settle(moved)
    assert sorted(str(w.message).split(": ")[-1] for w in caught) == [
        "its readers keep vLLM's busy wait", "its readers keep vLLM's recheck"]
    known = types.SimpleNamespace(SpinCondition=Known, SHM_READER_RECHECK_INTERVAL_MS=5000)
    site._settle(known)
    assert Moved.__init__.__defaults__ == (1, None) and moved.SHM_READER_RECHECK_INTERVAL_MS == 5.0
    assert Known.__init__.__defaults__ == (0.0,) and known.SHM_READER_RECHECK_INTERVAL_MS == 30


def test_the_servers_environment_carries_the_readers_settings(tmp_path, monkeypatch):
    """Only the settings that are not negative reach the server, the hook's folder first on its
    ``PYTHONPATH`` only then; values of a parent's environment never leak through."""
    monkeypatch.setenv("LIGHTSPAN_VLLM_READER_RECHECK_S", "9")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    model = str(_model_dir(tmp_path, None))
    env = inference.environment(inference.VLLMConfig(model=model))
    assert (env["LIGHTSPAN_VLLM_READER_SPIN_S"], env["LIGHTSPAN_VLLM_READER_RECHECK_S"]) == ("0.005", "0.02")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(inference.VLLM_SITE), "/elsewhere"]
    env = inference.environment(inference.VLLMConfig(model=model, reader_spin_s=-1, reader_recheck_s=-1))
    assert "LIGHTSPAN_VLLM_READER_SPIN_S" not in env and "LIGHTSPAN_VLLM_READER_RECHECK_S" not in env
    assert env["PYTHONPATH"] == "/elsewhere"
