"""Agents of the other protocols, run unchanged by ``lightspan rollout`` under ``opentelemetry-instrument``
against the session's real vLLM (through the recording proxy of tests/tracing/test_frameworks.py),
exporting to a real collector:

- an OpenAI Agents SDK agent with one tool and no model given (examples/frameworks/openai_agents_tools.py):
  the SDK's default model, ``OpenAIResponsesModel``, calls the Responses API;
- an ``anthropic``-client agent with a tool turn (examples/frameworks/anthropic_agent.py);
- an agent with a call of each capture outcome (tests/agents/capture_mix_agent.py): the call that
  cannot be captured is in the runner's summary, with its reason, and in the ``rollouts`` view.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import requests

from lightspan.tracing import semconv
from tests.conftest import collector_process
from tests.tracing.test_frameworks import _f32, vllm_returned

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 2


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    data = tmp_path_factory.mktemp("protocol-agents-data")
    with collector_process(data, data / "collector.log") as running:
        yield running


def _byte_symbol(b: int) -> str:
    """The byte-level BPE symbol of byte ``b`` (GPT-2's table: printable bytes are themselves, the
    others 256 + their rank)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """vLLM serving the tiny model made to end its turns early: every non-ASCII byte token is also an
    end-of-turn token (``eos_token_id`` in its generation config, which vLLM stops on). The random
    model otherwise writes until the length limit, and the Agents SDK raises on such an incomplete
    response; structured output (JSON, a regex) is ASCII and unaffected."""
    from transformers import AutoTokenizer

    from lightspan import inference
    from lightspan.models import build_tiny_model
    from tests.conftest import free_port, running_vllm

    model = build_tiny_model(tmp_path_factory.mktemp("eager-model") / "v0")
    tokenizer = AutoTokenizer.from_pretrained(model)
    stops = [tokenizer.convert_tokens_to_ids(_byte_symbol(b)) for b in range(128, 256)]
    config = json.loads((model / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], *stops]
    (model / "generation_config.json").write_text(json.dumps(config))
    cfg = inference.VLLMConfig(model=str(model), port=free_port(), max_model_len=1024)
    with running_vllm(cfg, "vllm-protocol-agents.log"):

        class Server:
            url = cfg.url
            model_name = cfg.served_model_name

        yield Server


def _rollout(name, script, collector, recorder, tmp_path, env=(), task=None):
    """Run ``script`` SAMPLES times under lightspan rollout; (summary, exchanges, store connection, logs)."""
    from lightspan import store

    data, ports = collector
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(task or {"id": f"{name}-task", "prompt": "What is 2 + 3?", "answer": "5"}) + "\n")
    recorder.clear()
    run = subprocess.run(
        [sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(tasks), "--samples", str(SAMPLES),
         "--concurrency", str(SAMPLES), "--timeout-s", "300", "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}",
         "--openai-base-url", f"{recorder.url}/v1", "--data-dir", str(data), "--logs-dir", str(tmp_path),
         "--", sys.executable, str(ROOT / script)],
        env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "200", **dict(env)}, text=True, capture_output=True,
        timeout=900, check=False)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("*.log"))
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["ok"] == SAMPLES, (summary, logs)
    requests.post(f"http://127.0.0.1:{ports['api']}/v1/flush", timeout=60).raise_for_status()
    with recorder.lock:
        exchanges = list(recorder.exchanges)
    return summary, exchanges, store.connect(data), run.stderr + logs


def _stored_calls(con, task_id):
    rows = con.execute("""
        SELECT rollout_id, capture_status, scope_name, prompt_token_ids, completion_token_ids, completion_logprobs
        FROM llm_calls WHERE task_id = ? ORDER BY start_time_unix_nano""", [task_id]).fetchall()
    return rows


def test_an_agents_sdk_agent_with_a_tool_on_its_default_model(collector, recorder, vllm_server, tmp_path):
    pytest.importorskip("agents")
    # OPENAI_DEFAULT_MODEL names the served model (or serve the SDK's default name: lightspan vllm --aliases);
    # the SDK's own trace exporter would post to OpenAI's servers
    env = {"OPENAI_DEFAULT_MODEL": vllm_server.model_name, "OPENAI_AGENTS_DISABLE_TRACING": "1"}
    summary, exchanges, con, logs = _rollout("agents_sdk_tools", "examples/frameworks/openai_agents_tools.py",
                                             collector, recorder, tmp_path, env)
    # converted to chat completions, as vLLM's /v1/responses converts them, with the capture fields
    assert exchanges and {path for path, *_ in exchanges} == {"/v1/chat/completions"}, logs
    sent = [request for _, request, *_ in exchanges]
    assert all(r["return_token_ids"] is True and r["tools"][0]["function"]["name"] == "add" for r in sent)
    rows = _stored_calls(con, "agents_sdk_tools-task")
    # one row per call: traceloop's openai.response span of each call is marked as lightspan's duplicate
    assert len(rows) == len(exchanges) and {r[2] for r in rows} == {"lightspan.instrumentor"}, rows
    # every call ok with vLLM's ids and a logprob per token (the tool call, an empty reply's end of turn too)
    assert [r[1] for r in rows] == ["ok"] * len(exchanges), rows
    expected = Counter(vllm_returned(e) for e in exchanges)
    assert Counter((tuple(r[3]), tuple(r[4]), tuple(_f32(r[5]))) for r in rows) == expected
    assert summary["capture"]["calls"] == len(exchanges) == summary["capture"]["captured"]
    con.close()


def test_an_anthropic_client_agent(collector, recorder, tmp_path):
    pytest.importorskip("anthropic")
    summary, exchanges, con, logs = _rollout("anthropic", "examples/frameworks/anthropic_agent.py", collector,
                                             recorder, tmp_path)
    # converted to chat completions, as vLLM's /v1/messages converts them, with the capture fields
    assert exchanges and {path for path, *_ in exchanges} == {"/v1/chat/completions"}, logs
    assert all(r["return_token_ids"] is True and r["tools"][0]["function"]["name"] == "add"
               for _, r, *_ in exchanges)
    rows = _stored_calls(con, "anthropic-task")
    assert [r[1] for r in rows] == ["ok"] * len(exchanges), rows
    expected = Counter(vllm_returned(e) for e in exchanges)
    assert Counter((tuple(r[3]), tuple(r[4]), tuple(_f32(r[5]))) for r in rows) == expected
    assert summary["capture"]["captured"] == len(exchanges) and not summary["capture"]["not_captured"]
    con.close()


def test_calls_that_cannot_be_captured_are_shown(collector, recorder, vllm_server, tmp_path):
    summary, exchanges, con, logs = _rollout(
        "mix", "tests/agents/capture_mix_agent.py", collector, recorder, tmp_path,
        {"OTHER_BASE_URL": f"{vllm_server.url}/v1"})
    capture = summary["capture"]
    # per rollout: the localhost-spelled call and the converted tool-call-only Responses call captured;
    # the other server's call and the two Responses calls that asked for include themselves not
    assert capture["calls"] == 5 * SAMPLES and capture["captured"] == 2 * SAMPLES
    assert capture["not_captured"] == {"other_url": SAMPLES, "no_logprobs": 2 * SAMPLES}
    assert "is not a capture URL" in capture["reasons"]["other_url"]
    assert "LIGHTSPAN_CAPTURE_URLS" in capture["reasons"]["other_url"]
    assert "/v1/responses" in capture["reasons"]["no_logprobs"] and "include" in capture["reasons"]["no_logprobs"]
    assert "not captured (no_logprobs)" in logs and "not captured (other_url)" in logs   # said, with the fix
    rows = con.execute("""
        SELECT num_uncaptured_calls, capture_problem, capture_reason FROM rollouts
        WHERE task_id = 'mix-task' AND num_llm_calls > 0""").fetchall()
    assert len(rows) == SAMPLES
    assert all(n == 3 and problem == "no_logprobs" and "include" in reason for n, problem, reason in rows), rows
    statuses = Counter(status for _, status, *_ in _stored_calls(con, "mix-task"))
    assert statuses == {"ok": 2 * SAMPLES, "other_url": SAMPLES, "no_logprobs": 2 * SAMPLES}
    paths = Counter(path for path, *_ in exchanges)
    assert paths == {"/v1/chat/completions": 2 * SAMPLES, "/v1/responses": 2 * SAMPLES}
    con.close()
