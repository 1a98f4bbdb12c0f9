"""A real collector holding rollouts whose outcomes and rewards are known, for the view and export tests."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import requests
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from lightspan import store
from lightspan.collector.server import Collector
from lightspan.tracing import semconv as sc
from tests.collector.helpers import config, grpc_exporter

# key -> (policy version, the agent's reward or None, the runner's outcome or None)
ROLLOUTS = {"x1": (1, 1.0, "ok"), "x2": (1, 0.0, "ok"), "x3": (1, 1.0, "ok"), "x4": (1, None, "failed"),
            "x5": (1, None, None), "y1": (2, 1.0, "ok"), "y2": (2, 1.0, "ok")}
# posted after the agents' rewards, in this order: y1's final reward becomes the person's 0.25
POSTED = [{"rollout_id": "y1", "value": 1.0, "name": "judge", "source": "judge", "judge_model": "m",
           "rubric_sha256": "a" * 64, "comment": "fine"},
          {"rollout_id": "y1", "value": 0.25, "name": "human", "source": "human", "comment": "off by one",
           "correction": "The answer is 5."}]


def _rollout(provider, key: str, version: int, reward, outcome) -> None:
    tracer = provider.get_tracer("test-agent")
    with tracer.start_as_current_span("agent.run"):
        with tracer.start_as_current_span("chat") as span:
            span.set_attribute(sc.GEN_AI_OPERATION_NAME, "chat")
            span.set_attribute(sc.GEN_AI_AGENT_NAME, "solver" if key != "x3" else "checker")
            span.set_attribute(sc.GEN_AI_INPUT_MESSAGES, json.dumps(
                [{"role": "user", "parts": [{"type": "text", "content": f"question {key}"}]}]))
            span.set_attribute(sc.GEN_AI_OUTPUT_MESSAGES, json.dumps(
                [{"role": "assistant", "parts": [{"type": "text", "content": f"answer {key}"}]}]))
            span.set_attribute(sc.PROMPT_TOKEN_IDS, sc.encode_ids([1, 2, len(key)]))
            span.set_attribute(sc.COMPLETION_TOKEN_IDS, [sc.encode_ids([7, 8])])
            span.set_attribute(sc.COMPLETION_LOGPROBS, [sc.encode_floats([-0.5, -0.25])])
            span.set_attribute(sc.MODEL_VERSION, version)
        if reward is not None:
            with tracer.start_as_current_span(sc.SPAN_REWARD) as span:
                span.set_attribute(sc.REWARD, reward)
    if outcome is not None:
        with tracer.start_as_current_span(sc.SPAN_RUNNER) as span:
            span.set_attribute(sc.ROLLOUT_OUTCOME, outcome)
            span.set_attribute(sc.ROLLOUT_EXIT_CODE, 0 if outcome == "ok" else 3)


@pytest.fixture(scope="module")
def known_store(tmp_path_factory):
    """(data directory, transitions written) of a stopped collector's store."""
    data = tmp_path_factory.mktemp("known-store")
    collector = Collector(config(data)).start()
    try:
        for key, (version, reward, outcome) in ROLLOUTS.items():
            provider = TracerProvider(resource=Resource.create({"service.name": "agent", sc.ROLLOUT_ID: key,
                                                                sc.TASK_ID: "task-x", sc.SPLIT: "train"}))
            provider.add_span_processor(SimpleSpanProcessor(grpc_exporter(collector)))
            _rollout(provider, key, version, reward, outcome)
            provider.shutdown()
        for reward in POSTED:
            resp = requests.post(f"http://127.0.0.1:{collector.api_port}/v1/rewards", json=reward, timeout=30)
            assert resp.status_code == 200, resp.text
        collector.flush()
    finally:
        collector.stop()
    rows = [{"transition_id": f"{k}/t", "rollout_id": k, "task_id": "task-x", "split": "train", "agent_name": "solver",
             "call_index": 0, "num_calls": 1, "prompt_token_ids": [1, 2], "completion_token_ids": [7, 8],
             "completion_logprobs": [-0.5, -0.25], "model_version": v, "temperature": 0.7, "reward": r, "credit": r,
             "advantage": r - 0.5, "credit_policy": "identical", "advantage_estimator": "grpo", "build_id": "b1",
             "created_unix_nano": 1000 + i, "completion_mask": None}
            for i, (k, (v, r, _)) in enumerate(ROLLOUTS.items()) if r is not None]
    store.write_table(data, "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))
    return data, rows
