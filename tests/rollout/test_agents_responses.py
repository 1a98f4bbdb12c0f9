"""Agents on the Responses API, run unchanged three ways against the session's vLLM: directly, under
``lightspan rollout`` (the instrumentor) and under ``lightspan rollout --gateway-url`` (the gateway):

- an OpenAI Agents SDK agent (streamed, as ``Runner.run`` calls it; a tool-call-only turn, then a
  text turn on the whole history, ``result.to_input_list()``);
- a pydantic-ai agent with a structured output type on its default ``openai:`` model, whose
  output tool makes a tool-call-only reply, streamed (``run_stream``) and not (``run_sync``).

Every call is stored once, with prompt ids, completion ids and one logprob per completion token;
the rollout reports no capture problem; and what the agent ends with (its history, its output) is
the same with and without lightspan, ids, timestamps and prompt cache counts aside (vLLM's
Responses route counts cached prompt tokens, its chat route does not: tracing/protocols/responses_convert.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests

from tests.conftest import collector_process, free_port

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
pytest.importorskip("agents")

AGENTS = {"agents_sdk": ("tests/agents/agents_sdk_responses_agent.py", {}, 2),
          "pydantic_ai": ("tests/agents/pydantic_ai_agent.py", {}, 1),
          "pydantic_ai_streamed": ("tests/agents/pydantic_ai_agent.py", {"AGENT_STREAM": "1"}, 1)}
"""name: (script, environment, LLM calls per run)"""
TASK = {"id": "sdk-add", "prompt": "What is 2 + 3?", "answer": "5"}


@pytest.fixture(scope="module")
def stack(vllm_server, tmp_path_factory):
    """(data dir, collector ports, gateway URL): a collector and a gateway process in front of vLLM."""
    from lightspan import inference
    from lightspan.runs import wait_http

    data = tmp_path_factory.mktemp("agents-responses")
    with collector_process(data, data / "collector.log") as (_, ports):
        port, log_path = free_port(), data / "gateway.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lightspan.cli", "gateway", "--upstream", vllm_server.url, "--port", str(port),
                 "--otlp-endpoint", f"http://127.0.0.1:{ports['grpc']}", "--data-dir", str(data)],
                env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100"}, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}/health", proc, 60, log_path)
            yield data, ports, url
        finally:
            inference.stop(proc)


# what differs from run to run by design (ids, times), or by the route (the prompt cache counts)
_ASIDE = frozenset({"id", "call_id", "tool_call_id", "timestamp", "run_id", "conversation_id", "provider_response_id",
                    "provider_url", "provider_details", "history_digest"})
_CACHE_COUNTS = frozenset({"cache_read_tokens", "cache_write_tokens"})


def _aside(obj):
    if isinstance(obj, dict):
        return {k: 0 if k in _CACHE_COUNTS else _aside(v) for k, v in obj.items() if k not in _ASIDE}
    if isinstance(obj, list):
        return [_aside(v) for v in obj]
    return obj


def _history(path) -> dict:
    """What the agent ended with (its histories, its output), with :func:`_aside` left out."""
    return _aside(json.loads(path.read_text()))


def _direct(vllm_server, tmp_path, agent: str) -> dict:
    script, extra, _ = AGENTS[agent]
    out = tmp_path / "direct.json"
    env = {**os.environ, "OPENAI_BASE_URL": f"{vllm_server.url}/v1", "OPENAI_API_KEY": "x",
           "LIGHTSPAN_TASK": json.dumps(TASK), "AGENT_OUTPUT": str(out), **extra}
    subprocess.run([sys.executable, script], env=env, check=True, capture_output=True, timeout=300)
    return _history(out)


def _rollout(stack, vllm_server, tmp_path, how: str, agent: str) -> tuple[dict, str]:
    data, ports, gateway = stack
    script, extra, _ = AGENTS[agent]
    out = tmp_path / f"{how}.json"
    tasks = tmp_path / "tasks.jsonl"
    task_id = f"{TASK['id']}-{agent}-{how}"
    tasks.write_text(json.dumps({**TASK, "id": task_id}) + "\n")
    where = (["--gateway-url", gateway] if how == "gateway" else ["--openai-base-url", f"{vllm_server.url}/v1"])
    run = subprocess.run(
        [sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(tasks), "--samples", "1", "--timeout-s",
         "300", "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}", "--data-dir", str(data),
         "--logs-dir", str(tmp_path / how), *where, "--", sys.executable, script],
        env={**os.environ, "AGENT_OUTPUT": str(out), "OTEL_BSP_SCHEDULE_DELAY": "200", **extra},
        text=True, capture_output=True, timeout=600, check=False)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in (tmp_path / how).glob("*.log"))
    assert run.returncode == 0, (run.stderr[-3000:], logs)
    requests.post(f"http://127.0.0.1:{ports['api']}/v1/flush", timeout=60).raise_for_status()
    return _history(out), task_id


@pytest.mark.parametrize("how", ["instrumentor", "gateway"])
@pytest.mark.parametrize("agent", list(AGENTS))
def test_a_responses_agent_trains_every_call_and_sees_what_it_would_without_lightspan(
        stack, vllm_server, tmp_path, how, agent):
    from lightspan import store

    if agent.startswith("pydantic_ai"):
        pytest.importorskip("pydantic_ai")
    calls = AGENTS[agent][2]
    expected = _direct(vllm_server, tmp_path, agent)
    history, task_id = _rollout(stack, vllm_server, tmp_path, how, agent)
    # the agent saw exactly what it sees without lightspan: nothing of the capture in its history
    assert history == expected
    assert '"logprob"' not in json.dumps(history)
    con = store.connect(stack[0])
    try:
        rows = con.execute("""SELECT capture_status, scope_name, len(prompt_token_ids), len(completion_token_ids),
                                     len(completion_logprobs) FROM llm_calls WHERE task_id = ?""", [task_id]).fetchall()
        problems = con.execute("SELECT num_llm_calls, num_uncaptured_calls, capture_problem FROM rollouts "
                               "WHERE task_id = ?", [task_id]).fetchall()
    finally:
        con.close()
    # each call (the Agents SDK: the tool call, then the text reply; pydantic-ai: its output tool's
    # call) one row, trainable: a logprob per token
    assert len(rows) == calls, rows
    assert all(r[0] == "ok" and r[2] > 0 and r[3] == r[4] > 0 for r in rows), rows
    if how == "gateway":
        assert {r[1] for r in rows} == {"lightspan.gateway"}
    assert problems == [(calls, 0, None)]
