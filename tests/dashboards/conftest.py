"""Fixtures of the dashboard tests: a real collector holding hand-built rollouts, transitions and
train steps whose every number is known, so the UI's answers can be checked against them."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
import requests
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from lightspan import store
from lightspan.collector.server import Collector
from lightspan.dashboards import web
from lightspan.tracing import semconv as sc
from tests.collector.helpers import config, grpc_exporter, query


@dataclass
class Rollout:
    key: str
    task: str
    split: str
    agent: str
    reward: float | None       # None: the agent gives none (the annotation queue's)
    version: int
    outcome: str | None = None  # the runner's outcome span: ok, failed, timeout; None: no runner span
    capture: tuple[str, str] | None = None   # (capture status, reason) of the second call: not captured


ROLLOUTS = [Rollout("r-a1", "task-a", "train", "planner", 1.0, 1), Rollout("r-a2", "task-a", "train", "planner", 0.0, 1),
            Rollout("r-b1", "task-b", "train", "coder", 0.5, 2), Rollout("r-v1", "task-v", "val", "planner", 0.25, 2)]
TOOL_CALL = {"type": "tool_call", "id": "call_1", "name": "search", "arguments": {"query": "2 + 2"}}


def run_agent(provider: TracerProvider, r: Rollout) -> None:
    """One rollout as an agent would trace it: a root span, two chat calls with token ids
    (the first asks for a tool), a tool span between them, then the reward (if it has one), then
    the runner's outcome span (if it has one)."""
    tracer = provider.get_tracer("test-agent")
    with tracer.start_as_current_span("agent.run"):
        for i in range(2):
            with tracer.start_as_current_span(f"chat {i}") as span:
                span.set_attribute(sc.GEN_AI_OPERATION_NAME, "chat")
                span.set_attribute(sc.GEN_AI_REQUEST_MODEL, "policy")
                span.set_attribute(sc.GEN_AI_AGENT_NAME, r.agent)
                span.set_attribute(sc.GEN_AI_INPUT_MESSAGES, json.dumps(
                    [{"role": "user", "parts": [{"type": "text", "content": f"<b>question</b> {i}"}]}]))
                output = [TOOL_CALL] if i == 0 else [{"type": "text", "content": "4"}]
                span.set_attribute(sc.GEN_AI_OUTPUT_MESSAGES, json.dumps([{"role": "assistant", "parts": output}]))
                span.set_attribute(sc.PROMPT_TOKEN_IDS, sc.encode_ids([72, 105, 10 + i]))
                span.set_attribute(sc.COMPLETION_TOKEN_IDS, [sc.encode_ids([52, 33, 65 + i])])
                span.set_attribute(sc.COMPLETION_LOGPROBS, [sc.encode_floats([-0.25, -3.0, -0.5 - i])])
                span.set_attribute(sc.MODEL_VERSION, r.version)
                if i == 1 and r.capture is not None:
                    span.set_attribute(sc.CAPTURE_STATUS, r.capture[0])
                    span.set_attribute(sc.CAPTURE_REASON, r.capture[1])
                else:
                    span.set_attribute(sc.CAPTURE_STATUS, "ok")     # as lightspan's instrumentor records it
            if i == 0:
                with tracer.start_as_current_span("tool search"):
                    time.sleep(0.002)   # a visible bar in the waterfall
        if r.reward is not None:
            with tracer.start_as_current_span(sc.SPAN_REWARD) as span:
                span.set_attribute(sc.REWARD, r.reward)
    if r.outcome is not None:
        with tracer.start_as_current_span(sc.SPAN_RUNNER) as span:
            span.set_attribute(sc.ROLLOUT_OUTCOME, r.outcome)
            span.set_attribute(sc.ROLLOUT_EXIT_CODE, 0 if r.outcome == "ok" else 3)


@dataclass
class UIStore:
    collector: Collector
    data_dir: Path
    base: str
    calls: dict            # rollout key -> [span_id of call 0, span_id of call 1]

    def url(self, path: str) -> str:
        return f"{self.base}{path}"


TRAIN_STEPS = [  # (run_id, step, reward_mean, loss, num_tokens, step_seconds, sync_seconds, time offset s)
    ("run-old", 1, 0.1, 0.9, 100, 2.0, 0.5, 0),
    ("run-new", 1, 0.2, 0.5, 300, 1.5, 0.25, 10),
    ("run-new", 2, 0.4, 0.25, 600, 2.0, 0.125, 20),
]


def transition_rows(calls: dict) -> list[dict]:
    """Per-call transitions of the train rollouts: credit = the rollout's reward (identical),
    advantage = reward minus the task's mean."""
    rows, now = [], time.time_ns()
    means = {"task-a": 0.5, "task-b": 0.5}
    for r in ROLLOUTS:
        if r.split != "train":
            continue
        for i, span_id in enumerate(calls[r.key]):
            rows.append({"transition_id": f"{r.key}/{span_id}", "rollout_id": r.key, "task_id": r.task, "split": r.split,
                         "agent_name": r.agent, "call_index": i, "num_calls": 2, "prompt_token_ids": [72, 105],
                         "completion_token_ids": [52, 33, 65], "completion_logprobs": [-0.25, -3.0, -0.5],
                         "model_version": r.version, "reward": r.reward, "credit": r.reward,
                         "advantage": r.reward - means[r.task], "credit_policy": "identical",
                         "advantage_estimator": "grpo", "build_id": "build-1", "created_unix_nano": now})
    return rows


def send(collector: Collector, rollouts: list[Rollout], token: str | None = None) -> dict:
    """Trace ``rollouts`` into ``collector`` through the real SDK (with the collector's bearer
    ``token``, if it has one) and flush; {rollout key: its calls' span ids}."""
    headers = {"authorization": f"Bearer {token}"} if token else None
    for r in rollouts:
        resource = Resource.create({"service.name": f"svc-{r.agent}", sc.ROLLOUT_ID: r.key, sc.TASK_ID: r.task,
                                    sc.SPLIT: r.split})
        provider = TracerProvider(resource=resource)
        exporter = GrpcExporter(endpoint=f"127.0.0.1:{collector.grpc_port}", insecure=True, timeout=5, headers=headers)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        run_agent(provider, r)
        provider.shutdown()
    collector.flush()
    calls = {}
    for key, span_id in query(collector.data_dir, "SELECT rollout_key, span_id FROM llm_calls "
                                                  "ORDER BY rollout_key, start_time_unix_nano"):
        calls.setdefault(key, []).append(span_id)
    return calls


@pytest.fixture(scope="module")
def ui_store(tmp_path_factory) -> UIStore:
    data_dir = tmp_path_factory.mktemp("ui-data")
    collector = Collector(routes=web.routes(), config=config(data_dir)).start()
    try:
        for r in ROLLOUTS:
            resource = Resource.create({"service.name": f"svc-{r.agent}", sc.ROLLOUT_ID: r.key, sc.TASK_ID: r.task,
                                        sc.SPLIT: r.split})
            provider = TracerProvider(resource=resource)
            provider.add_span_processor(SimpleSpanProcessor(grpc_exporter(collector)))
            run_agent(provider, r)
            provider.shutdown()
        assert collector.flush() == 5 * len(ROLLOUTS)
        calls = {}
        for key, span_id in query(data_dir, "SELECT rollout_key, span_id FROM llm_calls "
                                            "ORDER BY rollout_key, start_time_unix_nano"):
            calls.setdefault(key, []).append(span_id)
        transitions = pa.Table.from_pylist(transition_rows(calls), schema=store.TRANSITION_SCHEMA)
        store.write_table(data_dir, "transitions", transitions)
        t0 = time.time_ns()
        steps = [{"run_id": run, "step": step, "policy_version": step, "time_unix_nano": t0 + offset * 10**9,
                  "num_transitions": 4, "num_tokens": tokens, "reward_mean": reward, "advantage_abs_mean": 0.5,
                  "loss": loss, "clip_ratio": 0.0, "is_ratio_mean": 1.0, "entropy": 2.0, "kl": 0.0,
                  "staleness_mean": 0.5, "skipped_stale": 0, "step_seconds": seconds, "sync_seconds": sync,
                  "sync_max_abs_logprob_diff": 1e-6}
                 for run, step, reward, loss, tokens, seconds, sync, offset in TRAIN_STEPS]
        names = store.TRAIN_STEP_SCHEMA.names
        rows = [{k: s.get(k) for k in names} for s in steps]
        store.write_table(data_dir, "train_steps", pa.Table.from_pylist(rows, schema=store.TRAIN_STEP_SCHEMA))
        yield UIStore(collector, data_dir, f"http://127.0.0.1:{collector.api_port}", calls)
    finally:
        collector.stop()


REASON = "the stream ended before its usage chunk"
QUALITY_ROLLOUTS = [Rollout("f-ok1", "task-f", "train", "planner", 1.0, 1, "ok"),
                    Rollout("f-ok2", "task-f", "train", "planner", 0.0, 1, "ok"),
                    Rollout("f-fail", "task-f", "train", "planner", None, 1, "failed"),
                    Rollout("f-new1", "task-f", "train", "planner", None, 2, "ok"),
                    Rollout("f-new2", "task-g", "val", "planner", None, 2, None, ("no_token_ids", REASON))]
# the quality page's store: judge and person agree on f-ok1 and not on f-ok2; the person's score is
# each one's final reward
QUALITY_POSTED = [{"rollout_id": "f-ok1", "value": 1.0, "name": "judge", "source": "judge", "judge_model": "m"},
                  {"rollout_id": "f-ok2", "value": 1.0, "name": "judge", "source": "judge", "judge_model": "m"},
                  {"rollout_id": "f-ok1", "value": 1.0, "name": "human", "source": "human", "comment": "right"},
                  {"rollout_id": "f-ok2", "value": 0.0, "name": "human", "source": "human", "comment": "wrong sum",
           "correction": "2 + 2 = 4"}]
QUALITY_STEPS = [(1, 2.0, 0.5), (2, 0.25, 0.5), (3, 0.125, None)]     # (step, entropy, entropy_floor)


@pytest.fixture(scope="module")
def quality_store(tmp_path_factory) -> str:
    """The API base URL of a collector holding QUALITY_ROLLOUTS, the judge and human scores of
    QUALITY_POSTED and the train steps of QUALITY_STEPS."""
    data = tmp_path_factory.mktemp("quality-data")
    collector = Collector(routes=web.routes(), config=config(data)).start()
    try:
        send(collector, QUALITY_ROLLOUTS)
        for reward in QUALITY_POSTED:
            answer = requests.post(f"http://127.0.0.1:{collector.api_port}/v1/rewards", json=reward, timeout=30)
            assert answer.status_code == 200, answer.text
        collector.flush()
        t0 = time.time_ns()
        rows = [{"run_id": "run-1", "step": step, "policy_version": step, "time_unix_nano": t0 + step,
                 "num_transitions": 2, "num_tokens": 6, "entropy": entropy, "entropy_floor": floor}
                for step, entropy, floor in QUALITY_STEPS]
        rows = [{k: r.get(k) for k in store.TRAIN_STEP_SCHEMA.names} for r in rows]
        store.write_table(data, "train_steps", pa.Table.from_pylist(rows, schema=store.TRAIN_STEP_SCHEMA))
        yield f"http://127.0.0.1:{collector.api_port}"
    finally:
        collector.stop()


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (tests/dashboards/browser.py), one per module; skipped where none is installed."""
    from tests.dashboards.browser import Browser, chromium_path

    executable = chromium_path()
    if executable is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs Debian's chromium package where apt-get exists)")
    b = Browser(executable)
    yield b
    b.close()
