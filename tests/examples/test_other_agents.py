"""Agents of other frameworks and contracts, none changed for lightspan, under ``lightspan rollout``
against a real vLLM serving the tiny model and a real collector: agents written to Agent
Lightning's contract (examples/agl_compat: its environment variables, class runner and reward
events), an AutoGen AgentChat tutor with experts as ``AgentTool``, a LangGraph supervisor, a crewAI
crew and an OpenAI Agents SDK agent with its tracing on.

Each case runs two rollouts of one task and checks what a user would: the rollouts succeed, every
LLM call is stored with its token ids, the agents that score themselves have their rewards (Agent
Lightning's reward events, keyed to the rollout in their ``AGL_EVENT_URL``, or ``emit_reward``),
each call is attributed to the framework's own agent, and ``--agent-match`` selects the
calls of the agent to train. A grader's late reward then marks one rollout of each task solved
(the tiny model writes random bytes and solves none), so that every group has a nonzero advantage
and its transitions take part in training: the last test takes one training step on all the cases'
transitions and checks that each case's are in it (one step, not one per case: each costs a
trainer start-up).

The agents hard-code hosted model names (``auto``, ``gpt-4o``, ``gpt-4.1``); the server answers to
them (``lightspan vllm --aliases``). Their tool schemas and system prompts pass 1,024 bytes, the
tiny model's byte-level context, so this module serves a tiny model with a 4,096-token context.
crewAI and AutoGen run from environments of their own (:mod:`tests.agent_envs`). The tiny model
writes random bytes, so no task is solved and no tool is called: the supervisor never hands off,
the tutor never asks its experts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.agent_envs import agent_env
from tests.conftest import collector_process, free_port, running_vllm

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 2
ALIASES = ("auto", "gpt-4o", "gpt-4o-mini", "gpt-4.1")
BUILT: dict[str, int] = {}      # case -> transitions its build wrote (the training test checks them)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(vLLM URL, model dir): the tiny model with a 4,096-token context, under the agents' names."""
    from lightspan import inference
    from lightspan.models import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("agents-model") / "tiny")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    cfg = inference.VLLMConfig(model=str(model), port=free_port(), max_model_len=4096, aliases=ALIASES)
    with running_vllm(cfg, "vllm-agents-test.log"):
        yield cfg.url, model


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    data = tmp_path_factory.mktemp("agents-data")
    with collector_process(data, data / "collector.log") as running:
        yield running


def _python(env: str | None) -> str:
    return "python" if env is None else str(agent_env(env))


AGL_CLASS = "examples.agl_compat.math_agents"
# name: (environment extra or None for lightspan's, command after the interpreter, task, env_map,
#        extra variables, calls per rollout, agents of its calls, --agent-match, who rewards)
CASES = {
    "agl_calculator": ("autogen", ["examples/agl_compat/calculator_agent.py"],
                       {"question": "What is 2 + 3?", "result": "5"}, "QUESTION=input.question,RESULT=input.result",
                       {}, 1, {"calculator"}, "^calculator$", "event"),
    "agl_chat": (None, ["-m", "lightspan.rollout.agent_class", f"{AGL_CLASS}.ChatAgent"],
                 {"question": "What is 2 + 3?", "answer": "5"}, "QUESTION=input.question,ANSWER=input.answer",
                 {}, 1, {"agent"}, "", "event"),
    "agl_completion": (None, ["-m", "lightspan.rollout.agent_class", f"{AGL_CLASS}.CompletionAgent"],
                       {"question": "What is 2 + 3?", "answer": "5"},
                       "QUESTION=input.question,ANSWER=input.answer,TOKENIZER={model}",
                       {}, 1, {"agent"}, "", "event"),
    "autogen_agentchat": ("autogen", ["examples/frameworks/autogen_agentchat_agent.py"], {}, "",
                          {}, 2, {"tutor"}, "^tutor$", "grader"),
    "langgraph_supervisor": (None, ["examples/frameworks/langgraph_supervisor_agent.py"], {}, "",
                             {}, 1, {"supervisor"}, "^supervisor$", "grader"),
    "agents_sdk": (None, ["tests/agents/agents_sdk_agent.py"], {"prompt": "What is 2 + 3?", "answer": "5"}, "",
                   {}, 1, {"calculator"}, "^calculator$", "agent"),
    "crewai_crew": ("crewai", ["examples/frameworks/crewai_crew.py"],
                    {"topic": "adding 2 and 3", "answer": "5", "max_tokens": 16}, "",
                    {"CREWAI_DISABLE_TELEMETRY": "true"}, 2, {"Researcher", "Writer"}, "^Writer$", "agent"),
}
NEEDS = {"langgraph_supervisor": ("langgraph_supervisor", "opentelemetry.instrumentation.langchain"),
         "agents_sdk": ("agents", "opentelemetry.instrumentation.openai_agents")}


def _rollout(case: str, served, collector, tmp_path) -> tuple[list[str], object]:
    """Run the case's two rollouts; return (rollout ids, a store connection)."""
    from lightspan import store

    env_name, args, task, env_map, variables, *_ = CASES[case]
    url, model = served
    data, ports = collector
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": f"{case}-1", **task}) + "\n")
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "200", **variables}
    mapped = ["--env-map", env_map.format(model=model)] if env_map else []
    run = subprocess.run(
        [sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(tasks), "--samples", str(SAMPLES),
         "--concurrency", str(SAMPLES), "--timeout-s", "240", "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}",
         "--openai-base-url", f"{url}/v1", "--collector-api-url", f"http://127.0.0.1:{ports['api']}",
         "--data-dir", str(data), "--logs-dir", str(tmp_path), *mapped, "--", _python(env_name), *args],
        env=env, cwd=ROOT, text=True, capture_output=True, timeout=900, check=False)
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in tmp_path.glob("*.log"))
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    assert outcome["ok"] == SAMPLES, (outcome, logs)
    requests.post(f"http://127.0.0.1:{ports['api']}/v1/flush", timeout=60).raise_for_status()
    con = store.connect(data)
    rollout_ids = sorted(r for (r,) in con.execute("SELECT DISTINCT rollout_id FROM spans WHERE name = ? AND "
                                                   "task_id = ?", ["lightspan.runner", f"{case}-1"]).fetchall())
    assert len(rollout_ids) == SAMPLES
    return rollout_ids, con


# (agl_completion: the CompletionAgent decodes choices[0].token_ids it never asked for, as Agent
# Lightning's proxy always adds them; the instrumentor returns the ids to an AGL_ caller)
@pytest.mark.parametrize("case", list(CASES))
def test_an_unchanged_agent_runs_is_captured_rewarded_and_attributed(case, served, collector, tmp_path):
    from lightspan import store
    from lightspan.lightningrl.builder import build_transitions
    from lightspan.lightningrl.config import TransitionsConfig

    for module in NEEDS.get(case, ()):
        pytest.importorskip(module, reason="pip install 'lightspan[examples]'")
    *_, calls, agents, agent_match, rewarder = CASES[case]
    data, ports = collector
    rollout_ids, con = _rollout(case, served, collector, tmp_path)

    # every LLM call is stored once, with the token ids vLLM returned
    rows = con.execute("SELECT rollout_id, capture_status, len(prompt_token_ids), len(completion_token_ids) "
                       "FROM llm_calls WHERE rollout_id IN (SELECT unnest(?))", [rollout_ids]).fetchall()
    assert len(rows) >= SAMPLES * calls and {r[0] for r in rows} == set(rollout_ids), rows
    assert all(status == "ok" and n_prompt > 0 and n_completion > 0 for _, status, n_prompt, n_completion in rows), rows

    # every rollout has its reward: the agent's own (an Agent Lightning reward event posted to its
    # rollout's AGL_EVENT_URL, or emit_reward), or none (the agent does not score itself)
    rewards = dict(con.execute("SELECT rollout_key, count(*) FROM rewards WHERE rollout_key IN (SELECT unnest(?)) "
                               "GROUP BY ALL", [rollout_ids]).fetchall())
    scopes = con.execute("SELECT DISTINCT scope_name FROM spans WHERE reward IS NOT NULL AND rollout_id IN "
                         "(SELECT unnest(?))", [rollout_ids]).fetchall()
    con.close()
    assert rewards == ({} if rewarder == "grader" else {rid: 1 for rid in rollout_ids}), rewards
    if rewarder == "event":   # stored by the collector from the event, as a reward of that rollout
        assert scopes == [("lightspan.collector.rewards",)]
    # then a grader marks the first rollout solved, the second not (the tiny model solves none):
    # each group has a nonzero advantage, so its transitions take part in the training step
    for rid, value in zip(rollout_ids, (1.0, 0.0)):
        requests.post(f"http://127.0.0.1:{ports['api']}/v1/rewards", json={"rollout_id": rid, "value": value,
                      "name": "grader"}, timeout=30).raise_for_status()
    requests.post(f"http://127.0.0.1:{ports['api']}/v1/flush", timeout=60).raise_for_status()

    # each call is attributed to the framework's own agent...
    con = store.connect(data)
    table, metrics = build_transitions(con, TransitionsConfig(data_dir=str(data), incremental=False, grace_s=0))
    ours = [t for t in table.to_pylist() if t["rollout_id"] in rollout_ids]
    assert {t["agent_name"] for t in ours} == agents, metrics
    assert len(ours) == len(rows)
    con.close()
    # ...and --agent-match keeps the calls of the agent to train
    out = subprocess.run([sys.executable, "-m", "lightspan.cli", "transitions", "build", "--data-dir", str(data),
                          "--agent-match", agent_match, "--grace-s", "0"], check=True, text=True,
                         capture_output=True).stdout
    built = json.loads(out.strip().splitlines()[-1])
    selected = [t for t in ours if re.search(agent_match, t["agent_name"])]
    assert built["transitions/calls"] == len(selected) > 0, built
    BUILT[case] = len(selected)


def test_one_training_step_takes_every_agents_transitions(served, collector):
    """One ``lightspan train --mode once`` step over the transitions the cases above built."""
    from lightspan import store

    if not BUILT:
        pytest.skip("runs after the agent cases of this module")
    url, model = served
    data, _ = collector
    con = store.connect(data)
    total = con.execute("SELECT count(*) FROM transitions").fetchone()[0]
    con.close()
    assert total == sum(BUILT.values())
    subprocess.run([sys.executable, "-m", "lightspan.cli", "train", "--mode", "once", "--data-dir", str(data),
                    "--model", str(model), "--vllm-url", url, "--learning-rate", "1e-3", "--loss-type", "grpo",
                    "--sync", "reload", "--seed", "0"], check=True)
    assert json.loads((data / "policy.json").read_text())["version"] == 1
    steps = store.connect(data).execute("SELECT policy_version, num_transitions FROM train_steps").fetchall()
    assert steps == [(1, total)], (steps, BUILT)
