"""``lightspan reward judge`` against a real vLLM (the tiny model) and a real collector: scores are
parsed and posted with their provenance, malformed answers are retried then counted, re-runs post
nothing new, and failed or rewarded rollouts are never judged."""

from __future__ import annotations

import hashlib
import json

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from lightspan.collector.server import Collector
from lightspan.core.config import ConfigError
from lightspan.lightningrl import judge
from lightspan.tracing import semconv as sc
from tests.collector.helpers import config, grpc_exporter, query

RUBRIC = "Right answer: 1. Wrong: 0."
# key -> (task, runner outcome or None, the agent's own reward or None)
ROLLOUTS = {"j-a1": ("task-a", "ok", None), "j-a2": ("task-a", "ok", None), "j-a3": ("task-a", "ok", None),
            "j-af": ("task-a", "failed", None), "j-ar": ("task-a", "ok", 1.0), "j-b1": ("task-b", "ok", None)}
UNRATED = ["j-a1", "j-a2", "j-a3", "j-b1"]


def _rollout(provider: TracerProvider, key: str, task: str, outcome: str | None, reward: float | None) -> None:
    tracer = provider.get_tracer("test-agent")
    with tracer.start_as_current_span("agent.run"):
        with tracer.start_as_current_span("chat") as span:
            span.set_attribute(sc.GEN_AI_OPERATION_NAME, "chat")
            span.set_attribute(sc.GEN_AI_INPUT_MESSAGES, json.dumps(
                [{"role": "user", "parts": [{"type": "text", "content": f"2+{len(key)}?"}]}]))
            span.set_attribute(sc.GEN_AI_OUTPUT_MESSAGES, json.dumps(
                [{"role": "assistant", "parts": [{"type": "text", "content": key[-1]}]}]))
            span.set_attribute(sc.PROMPT_TOKEN_IDS, sc.encode_ids([72, 105]))
            span.set_attribute(sc.COMPLETION_TOKEN_IDS, [sc.encode_ids([52])])
            span.set_attribute(sc.COMPLETION_LOGPROBS, [sc.encode_floats([-0.25])])
        if reward is not None:
            with tracer.start_as_current_span(sc.SPAN_REWARD) as span:
                span.set_attribute(sc.REWARD, reward)
    if outcome is not None:
        with tracer.start_as_current_span(sc.SPAN_RUNNER) as span:
            span.set_attribute(sc.ROLLOUT_OUTCOME, outcome)


@pytest.fixture
def stored(tmp_path):
    """A running collector holding the ROLLOUTS; yields (collector, rubric path)."""
    collector = Collector(config(tmp_path / "data")).start()
    try:
        for key, (task, outcome, reward) in ROLLOUTS.items():
            provider = TracerProvider(resource=Resource.create({"service.name": "agent", sc.ROLLOUT_ID: key,
                                                                sc.TASK_ID: task, sc.SPLIT: "train"}))
            provider.add_span_processor(SimpleSpanProcessor(grpc_exporter(collector)))
            _rollout(provider, key, task, outcome, reward)
            provider.shutdown()
        collector.flush()
        rubric = tmp_path / "rubric.md"
        rubric.write_text(RUBRIC)
        yield collector, rubric
    finally:
        collector.stop()


@pytest.fixture
def judge_server(vllm_server, tiny_model):
    """The suite's vLLM serving the tiny model's own weights: a test elsewhere (an example's training
    step) may have left its trained weights there, and the judge's answers are read as the base's."""
    from lightspan.trainer.sync import ReloadSync

    ReloadSync(vllm_server.url).push(str(tiny_model), 0)
    return vllm_server


def _cfg(collector: Collector, rubric, vllm_server, **kw) -> judge.JudgeConfig:
    values = dict(rubric=str(rubric), data_dir=str(collector.data_dir), judge_url=f"{vllm_server.url}/v1",
                  judge_model=vllm_server.model_name, collector_url=f"http://127.0.0.1:{collector.api_port}",
                  max_chars_per_rollout=80, max_reason_chars=8, max_tokens=160, attempts=2)
    return judge.JudgeConfig(**{**values, **kw})


def _judge_rewards(collector):
    collector.flush()
    return query(collector.data_dir, "SELECT rollout_key, reward, source, judge_model, rubric_sha256, comment "
                                     "FROM rewards WHERE source = 'judge' ORDER BY rollout_key")


def test_finished_unrewarded_rollouts_are_scored_once_with_their_provenance(stored, judge_server):
    vllm_server = judge_server
    collector, rubric = stored
    cfg = _cfg(collector, rubric, vllm_server)
    stats = judge.judge_once(cfg)
    assert stats["judge/groups"] == 2 and stats["judge/groups_malformed"] == 0      # task-a's three, task-b's one
    assert stats["judge/rollouts_scored"] == len(UNRATED)
    rows = _judge_rewards(collector)
    assert [r[0] for r in rows] == UNRATED                    # never the failed or the already rewarded one
    digest = hashlib.sha256(RUBRIC.encode()).hexdigest()
    for _, value, source, model, rubric_hash, _comment in rows:
        assert value in judge.SCORES and source == "judge" and model == vllm_server.model_name and rubric_hash == digest
    # rewarded now: a re-run finds nothing to judge, and re-posting the same scores stores nothing new
    assert judge.judge_once(cfg)["judge/groups"] == 0
    judge.post_rewards(cfg, [{"rollout_id": r[0], "value": r[1], "name": cfg.reward_name, "id": f"judge-{digest[:16]}",
                              "source": "judge", "judge_model": r[3], "rubric_sha256": r[4], "comment": r[5]}
                             for r in rows])
    assert _judge_rewards(collector) == rows
    statuses = dict(query(collector.data_dir, "SELECT rollout_key, status FROM rollouts"))
    assert statuses["j-af"] == "failed" and all(statuses[k] == "rewarded" for k in UNRATED)


def test_malformed_answers_are_retried_then_counted_never_guessed(stored, judge_server):
    vllm_server = judge_server
    collector, rubric = stored
    # without the schema the tiny model's answer is noise: every attempt is malformed
    stats = judge.judge_once(_cfg(collector, rubric, vllm_server, structured=False, attempts=2, max_tokens=24))
    assert stats["judge/groups_malformed"] == stats["judge/groups"] == 2
    assert stats["judge/calls"] == 4 and stats["judge/rollouts_scored"] == 0
    assert _judge_rewards(collector) == []


# --- pure pieces ----------------------------------------------------------------------------------

def test_parse_scores_takes_exactly_one_score_in_range_per_rollout():
    assert judge.parse_scores('noise {"scores": {"r2": {"score": 1, "reason": "b"}, '
                              '"r1": {"score": 0.5, "reason": "a\x01"}}} tail', 2) == [(0.5, "a\x01"), (1.0, "b")]
    for bad, why in [("no json", "not JSON"), ('{"scores": []}', "no \"scores\" object"),
                     ('{"scores": {"r1": {"score": 1}}}', "wanted exactly"),
                     ('{"scores": {"r1": {"score": 1.5}, "r2": {"score": 0}}}', "r1: score 1.5"),
                     ('{"scores": {"r1": {"score": true}, "r2": {"score": 0}}}', "r1: score True")]:
        with pytest.raises(judge.MalformedJudgement, match=why):
            judge.parse_scores(bad, 2)


def test_a_trajectory_shows_each_message_once_tool_calls_included():
    first_in = [{"role": "user", "parts": [{"type": "text", "content": "2+3?"}]}]
    first_out = [{"role": "assistant", "parts": [{"type": "tool_call", "name": "add", "arguments": {"a": 2}}]}]
    second_in = first_in + [{"role": "assistant", "parts": first_out[0]["parts"]},
                            {"role": "tool", "parts": [{"type": "tool_call_response", "response": "5"}]}]
    second_out = [{"role": "assistant", "parts": [{"type": "text", "content": "5"}], "finish_reason": "stop"}]
    text = judge.trajectory([(json.dumps(first_in), json.dumps(first_out)),
                             (json.dumps(second_in), json.dumps(second_out))], 1000)
    assert text.splitlines() == ["user: 2+3?", 'assistant: [calls add({"a": 2})]', "tool: [tool result: 5]",
                                 "assistant: 5"]
    assert judge.trajectory([(json.dumps(first_in), "x" * 50)], 10).startswith("…")


def test_the_schema_names_every_rollout_and_the_config_checks_its_fields(tmp_path):
    doc = judge.schema(3, 40)
    assert doc["properties"]["scores"]["required"] == ["r1", "r2", "r3"]
    with pytest.raises(ConfigError, match="judge.rubric"):
        judge.JudgeConfig(rubric=str(tmp_path / "missing.md"))
    (tmp_path / "r.md").write_text("x")
    with pytest.raises(ConfigError, match="judge.every"):
        judge.JudgeConfig(rubric=str(tmp_path / "r.md"), mode="every", every="soon")
