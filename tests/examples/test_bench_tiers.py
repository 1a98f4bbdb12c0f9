"""bench/tiers.py: rollouts sent by the OTel SDK's exporter to a real collector, grouped per split,
policy version and task tier, with the agent's summary-line fields averaged."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from lightspan.tracing import semconv as sc
from tests.collector.conftest import collector_factory, data_dir  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_tiers", REPO / "bench" / "tiers.py")
tiers = importlib.util.module_from_spec(_spec)
sys.modules["bench_tiers"] = tiers
_spec.loader.exec_module(tiers)


def send(collector, rollout: str, task: str, split: str, version: int, reward: float | None,
         calls: list[tuple[int, int]]) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "agent", sc.ROLLOUT_ID: rollout,
                                                        sc.TASK_ID: task, sc.SPLIT: split}))
    provider.add_span_processor(SimpleSpanProcessor(
        OTLPSpanExporter(endpoint=f"http://127.0.0.1:{collector.http_port}/v1/traces", timeout=5)))
    tracer = provider.get_tracer("agent")
    with tracer.start_as_current_span("invoke_agent a", attributes={sc.GEN_AI_OPERATION_NAME: "invoke_agent"}):
        for prompt, completion in calls:
            with tracer.start_as_current_span("chat policy", attributes={
                    sc.GEN_AI_OPERATION_NAME: "chat", sc.MODEL_VERSION: version, sc.CAPTURE_STATUS: "ok",
                    sc.PROMPT_TOKEN_IDS: sc.encode_ids(list(range(prompt))),
                    sc.COMPLETION_TOKEN_IDS: sc.encode_ids(list(range(completion))),
                    sc.COMPLETION_LOGPROBS: sc.encode_floats([-0.5] * completion)}):
                pass
        if reward is not None:
            with tracer.start_as_current_span(sc.SPAN_REWARD, attributes={sc.REWARD: reward}):
                pass
    provider.shutdown()


def test_groups_per_split_version_and_tier(collector_factory, data_dir, tmp_path):
    collector = collector_factory()
    send(collector, "r1", "e-1", "train", 0, 1.0, [(10, 2), (14, 3)])
    send(collector, "r2", "e-2", "train", 0, 0.25, [(20, 4)])
    send(collector, "r3", "h-1", "train", 0, 0.0, [(30, 5), (40, 6), (50, 7)])
    send(collector, "r4", "e-1", "val", 1, 0.5, [(12, 2)])
    send(collector, "r5", "x-9", "train", 0, None, [(8, 1)])      # a task in no file, no reward yet
    collector.flush()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(t) for t in [{"id": "e-1", "tier": "easy"}, {"id": "e-2", "tier": "easy"},
                                                        {"id": "h-1", "tier": "hard"}]) + "\n")
    logs = data_dir / "rollout-logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "r1.log").write_text('INFO x\n{"score": 100, "steps": 4, "exit": "Submitted"}\n')
    (logs / "r2.log").write_text('{"score": 25, "steps": 8, "exit": "LimitsExceeded: 6 steps"}\n{"other": 1}\n')
    (logs / "r3.log").write_text('{"score": 0, "steps": "?"}\nnot json {"score"\n')

    out = tiers.summarize(data_dir, tiers.tiers_of([tasks]), ["score", "steps", "exit"])
    groups = {(g["split"], g["policy_version"], g["tier"]): g for g in out["groups"]}
    assert sorted(groups) == [("train", 0, "-"), ("train", 0, "easy"), ("train", 0, "hard"), ("val", 1, "easy")]
    easy = groups[("train", 0, "easy")]
    assert (easy["rollouts"], easy["solved"], easy["partly"], easy["reward_mean"]) == (2, 1, 1, 0.625)
    assert (easy["turns_mean"], easy["prompt_tokens_mean"], easy["completion_tokens_mean"]) == (1.5, 22, 4)   # 4.5 rounds to even
    assert easy["longest_prompt_max"] == 20 and (easy["score_mean"], easy["steps_mean"]) == (62.5, 6)
    assert easy["exit_counts"] == {"Submitted": 1, "LimitsExceeded": 1} and easy["exit_mean"] is None
    assert "exit_counts" not in groups[("train", 0, "hard")]
    hard = groups[("train", 0, "hard")]
    assert (hard["solved"], hard["partly"], hard["turns_mean"], hard["prompt_tokens_mean"]) == (0, 0, 3, 120)
    assert hard["score_mean"] == 0 and hard["steps_mean"] is None          # "?" is not a number
    assert groups[("val", 1, "easy")]["partly"] == 1 and groups[("val", 1, "easy")]["score_mean"] is None
    assert groups[("train", 0, "-")]["reward_mean"] == 0.0
    assert tiers.summarize(data_dir, {}, [], solved_at=0.5)["groups"][0]["solved"] >= 1
