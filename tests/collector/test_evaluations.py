"""gen_ai.evaluation.result events as rewards: an evaluator on the OTel SDK's own log API and its
OTLP exporters (HTTP and gRPC) scores the spans an agent sent, as a log record in the evaluated
span's context, as one naming only gen_ai.response.id, and as a span event; the collector decides
the source; one value per key; late spans; WAL replay; the transition builder trains on them."""

from __future__ import annotations

import json
import shutil
import time

import requests
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as GrpcLogExporter
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HttpLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from lightspan.collector.server import Collector
from lightspan.tracing import semconv as sc
from tests.collector.helpers import config, query
from tests.lightningrl.helpers import build

EVENT = sc.GEN_AI_EVALUATION_RESULT
ROLLOUT = "rollout-eval-1"


def agent_run(collector, rollout: str = ROLLOUT, *, service: str = "agent", span_event: dict | None = None) -> dict:
    """An agent's spans as the SDK exports them: an invoke_agent root and one chat call with token
    ids and a response id; returns their hex ids."""
    provider = TracerProvider(resource=Resource.create({"service.name": service, sc.ROLLOUT_ID: rollout,
                                                        sc.TASK_ID: "task-1"}))
    provider.add_span_processor(SimpleSpanProcessor(
        HttpSpanExporter(endpoint=f"http://127.0.0.1:{collector.http_port}/v1/traces", timeout=5)))
    tracer = provider.get_tracer("agent")
    with tracer.start_as_current_span("invoke_agent solver") as root:
        root.set_attribute(sc.GEN_AI_OPERATION_NAME, "invoke_agent")
        with tracer.start_as_current_span("chat policy") as chat:
            chat.set_attribute(sc.GEN_AI_OPERATION_NAME, "chat")
            chat.set_attribute(sc.GEN_AI_RESPONSE_ID, f"chatcmpl-{rollout}")
            chat.set_attribute(sc.PROMPT_TOKEN_IDS, sc.encode_ids([1, 2, 3]))
            chat.set_attribute(sc.COMPLETION_TOKEN_IDS, sc.encode_ids([4, 5]))
            chat.set_attribute(sc.COMPLETION_LOGPROBS, sc.encode_floats([-0.5, -0.25]))
            chat.set_attribute(sc.CAPTURE_STATUS, "ok")
            if span_event is not None:
                chat.add_event(EVENT, span_event)
    provider.shutdown()
    return {"trace": f"{root.get_span_context().trace_id:032x}", "root": f"{root.get_span_context().span_id:016x}",
            "chat": f"{chat.get_span_context().span_id:016x}", "response": f"chatcmpl-{rollout}"}


def evaluate(exporter, evaluations: list[tuple[dict | None, dict]], resource: dict | None = None) -> None:
    """An evaluator process: one gen_ai.evaluation.result event per (evaluated span, attributes),
    through the SDK's log API, parented to the evaluated span when one is given."""
    provider = LoggerProvider(resource=Resource.create(resource or {"service.name": "phoenix-evals"}))
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    logger = provider.get_logger("evaluator")
    for target, attributes in evaluations:
        context = None
        if target is not None:
            span = NonRecordingSpan(SpanContext(int(target["trace"], 16), int(target["span"], 16), is_remote=True,
                                                trace_flags=TraceFlags(TraceFlags.SAMPLED)))
            context = trace.set_span_in_context(span)
        logger.emit(event_name=EVENT, attributes=attributes, context=context)
    provider.shutdown()


class _Ids(IdGenerator):
    """The ids an evaluation named before its span existed."""

    def __init__(self, trace_id: str, span_id: str):
        self.trace_id, self.span_id = int(trace_id, 16), int(span_id, 16)

    def generate_trace_id(self) -> int:
        return self.trace_id

    def generate_span_id(self) -> int:
        return self.span_id


def late_span(collector, trace_id: str, span_id: str, rollout: str) -> None:
    """The evaluated chat span, sent only now (an agent's exporter that retried, say)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "agent", sc.ROLLOUT_ID: rollout}),
                              id_generator=_Ids(trace_id, span_id))
    provider.add_span_processor(SimpleSpanProcessor(
        HttpSpanExporter(endpoint=f"http://127.0.0.1:{collector.http_port}/v1/traces", timeout=5)))
    provider.get_tracer("agent").start_span("chat policy", attributes={sc.GEN_AI_OPERATION_NAME: "chat"}).end()
    provider.shutdown()


def http_logs(collector):
    return HttpLogExporter(endpoint=f"http://127.0.0.1:{collector.http_port}/v1/logs", timeout=5)


def grpc_logs(collector):
    return GrpcLogExporter(endpoint=f"127.0.0.1:{collector.grpc_port}", insecure=True, timeout=5)


def rewards(data_dir, rollout: str = ROLLOUT):
    return query(data_dir, f"""SELECT reward_name, reward, source, call_span_id, comment FROM rewards
                              WHERE rollout_key = '{rollout}' ORDER BY reward_name""")


def test_log_records_in_context_by_response_id_and_of_the_root_span_are_rewards(collector_factory, data_dir):
    collector = collector_factory()
    ids = agent_run(collector)
    chat, root = {"trace": ids["trace"], "span": ids["chat"]}, {"trace": ids["trace"], "span": ids["root"]}
    evaluate(http_logs(collector), [
        (chat, {sc.GEN_AI_EVALUATION_NAME: "Relevance", sc.GEN_AI_EVALUATION_SCORE_VALUE: 0.8,
                sc.GEN_AI_EVALUATION_SCORE_LABEL: "relevant", sc.GEN_AI_EVALUATION_EXPLANATION: "on topic"}),
        (chat, {sc.GEN_AI_EVALUATION_NAME: "Hallucination", sc.GEN_AI_EVALUATION_SCORE_LABEL: "factual"}),
        (root, {sc.GEN_AI_EVALUATION_NAME: "task_success", sc.GEN_AI_EVALUATION_SCORE_VALUE: 1}),
    ])
    # a second evaluator knows the completion only by its id (gRPC this time)
    evaluate(grpc_logs(collector), [(None, {sc.GEN_AI_EVALUATION_NAME: "correctness",
                                            sc.GEN_AI_EVALUATION_SCORE_VALUE: 0.5,
                                            sc.GEN_AI_RESPONSE_ID: ids["response"]})],
             resource={"service.name": "langfuse-evals"})
    collector.flush()
    assert rewards(data_dir) == [
        ("Relevance", 0.8, "phoenix-evals", ids["chat"], "on topic"),       # the call's reward
        ("correctness", 0.5, "langfuse-evals", ids["chat"], None),          # found by its response id
        ("task_success", 1.0, "phoenix-evals", None, None),                 # the root span: the rollout's
    ]
    # a label without a value is stored, never trained on; every evaluation is in the evaluations view
    assert query(data_dir, f"""SELECT name, value, label, evaluator, evaluated_span_id FROM evaluations
                              WHERE rollout_key = '{ROLLOUT}' ORDER BY name""") == [
        ("Hallucination", None, "factual", "phoenix-evals", ids["chat"]),
        ("Relevance", 0.8, "relevant", "phoenix-evals", ids["chat"]),
        ("correctness", 0.5, None, "langfuse-evals", ids["chat"]),
        ("task_success", 1.0, None, "phoenix-evals", ids["root"])]
    assert query(data_dir, f"SELECT final_reward, status FROM rollouts WHERE rollout_key = '{ROLLOUT}'") == [
        (1.0, "rewarded")]
    snapshot = collector.metrics.snapshot()
    assert (snapshot["evaluations_received_total"], snapshot["evaluations_stored_total"],
            snapshot["evaluations_unvalued_total"], snapshot["evaluations_unmatched_total"]) == (4, 4, 1, 0)
    # the builder trains on them with no glue: the rollout's one call is a transition
    transitions, _ = build(data_dir, now=time.time_ns() + 3600 * 10**9, min_group_size=1)
    assert transitions.column("rollout_id").to_pylist() == [ROLLOUT]


def test_the_collector_decides_the_source(collector_factory, data_dir):
    """A policy never forges its own reward: whatever service name the agent's own process gives, its
    evaluations are the agent's; an evaluator's service is never a person's or the API's."""
    collector = collector_factory()
    ids = agent_run(collector, span_event={sc.GEN_AI_EVALUATION_NAME: "self_check",
                                           sc.GEN_AI_EVALUATION_SCORE_VALUE: 1.0})
    chat = {"trace": ids["trace"], "span": ids["chat"]}
    # the agent's process (the runner gave it the rollout's ids) naming itself "human"
    evaluate(http_logs(collector), [(chat, {sc.GEN_AI_EVALUATION_NAME: "own_process",
                                            sc.GEN_AI_EVALUATION_SCORE_VALUE: 1.0})],
             resource={"service.name": "human", sc.ROLLOUT_ID: ROLLOUT})
    # the agent's service, without the runner's attributes
    evaluate(http_logs(collector), [(chat, {sc.GEN_AI_EVALUATION_NAME: "same_service",
                                            sc.GEN_AI_EVALUATION_SCORE_VALUE: 1.0})],
             resource={"service.name": "agent"})
    # an evaluator of its own that calls itself "human", and one that claims a source
    evaluate(http_logs(collector), [(chat, {sc.GEN_AI_EVALUATION_NAME: "named_human",
                                            sc.GEN_AI_EVALUATION_SCORE_VALUE: 0.0,
                                            sc.REWARD_SOURCE: "human"})],
             resource={"service.name": "human"})
    collector.flush()
    assert [(name, source) for name, _, source, _, _ in rewards(data_dir)] == [
        ("named_human", "evaluator:human"), ("own_process", "agent"), ("same_service", "agent"),
        ("self_check", "agent")]
    assert query(data_dir, "SELECT count(*) FROM rewards WHERE source IN ('human', 'api', 'judge')") == [(0,)]


def test_label_values_map_a_label_to_a_value(collector_factory, data_dir):
    collector = collector_factory(evaluation_label_values={"factual": 1.0, "Hallucination/hallucinated": -1.0})
    ids = agent_run(collector)
    chat = {"trace": ids["trace"], "span": ids["chat"]}
    evaluate(http_logs(collector), [
        (chat, {sc.GEN_AI_EVALUATION_NAME: "Hallucination", sc.GEN_AI_EVALUATION_SCORE_LABEL: "hallucinated"}),
        (chat, {sc.GEN_AI_EVALUATION_NAME: "Groundedness", sc.GEN_AI_EVALUATION_SCORE_LABEL: "factual"}),
        (chat, {sc.GEN_AI_EVALUATION_NAME: "Tone", sc.GEN_AI_EVALUATION_SCORE_LABEL: "friendly"}),  # unmapped
        (chat, {sc.GEN_AI_EVALUATION_NAME: "Broken", sc.ERROR_TYPE: "TimeoutError"}),           # failed
        (chat, {sc.GEN_AI_EVALUATION_SCORE_VALUE: 1.0}),                                         # no name
    ])
    collector.flush()
    assert [(name, value) for name, value, *_ in rewards(data_dir)] == [("Groundedness", 1.0),
                                                                       ("Hallucination", -1.0)]
    snapshot = collector.metrics.snapshot()
    assert (snapshot["evaluations_invalid_total"], snapshot["evaluations_unvalued_total"]) == (2, 1)
    assert query(data_dir, f"SELECT count(*) FROM logs WHERE event_name = '{EVENT}'") == [(5,)]   # all stored


def test_one_value_per_key_across_restarts(collector_factory, data_dir):
    collector = collector_factory()
    ids = agent_run(collector)
    chat = {"trace": ids["trace"], "span": ids["chat"]}
    relevance = {sc.GEN_AI_EVALUATION_NAME: "Relevance", sc.GEN_AI_EVALUATION_SCORE_VALUE: 0.8}
    evaluate(http_logs(collector), [(chat, relevance)])
    evaluate(http_logs(collector), [(chat, relevance)])          # re-sent: the same value, stored once
    doc = {"resourceLogs": [{"resource": {"attributes": [{"key": "service.name",
                                                          "value": {"stringValue": "phoenix-evals"}}]},
                             "scopeLogs": [{"logRecords": [{
                                 "eventName": EVENT, "traceId": ids["trace"], "spanId": ids["chat"],
                                 "timeUnixNano": str(time.time_ns()),
                                 "attributes": [{"key": sc.GEN_AI_EVALUATION_NAME, "value": {"stringValue": "Relevance"}},
                                                {"key": sc.GEN_AI_EVALUATION_SCORE_VALUE, "value": {"doubleValue": 0.1}}]}]}]}]}
    url = f"http://127.0.0.1:{collector.http_port}/v1/logs"
    answer = requests.post(url, json=doc, timeout=5)             # another value before the flush
    assert answer.status_code == 200
    assert answer.json()["partialSuccess"]["rejectedLogRecords"] == "1"
    assert "stored as 0.8, not 0.1" in answer.json()["partialSuccess"]["errorMessage"]
    collector.flush()
    assert [(n, v) for n, v, *_ in rewards(data_dir)] == [("Relevance", 0.8)]
    collector.stop()
    again = collector_factory()                                  # a restart: the store says what is stored
    answer = requests.post(f"http://127.0.0.1:{again.http_port}/v1/logs", json=doc, timeout=5)
    assert answer.json()["partialSuccess"]["rejectedLogRecords"] == "1"
    assert again.metrics.snapshot()["evaluations_conflicting_total"] == 1
    again.flush()
    assert [(n, v) for n, v, *_ in rewards(data_dir)] == [("Relevance", 0.8)]


def test_an_evaluation_before_its_span_waits_for_it(collector_factory, data_dir):
    collector = collector_factory()
    trace_id, span_id = "ab" * 16, "cd" * 8
    evaluate(http_logs(collector), [({"trace": trace_id, "span": span_id},
                                     {sc.GEN_AI_EVALUATION_NAME: "early", sc.GEN_AI_EVALUATION_SCORE_VALUE: 1.0})])
    collector.flush()
    assert query(data_dir, "SELECT count(*) FROM rewards") == [(0,)]            # waiting for its span
    late_span(collector, trace_id, span_id, "late-rollout")
    collector.flush()
    assert rewards(data_dir, "late-rollout") == [("early", 1.0, "phoenix-evals", span_id, None)]


def test_an_unmatched_evaluation_is_stored_by_its_trace(collector_factory, data_dir):
    collector = collector_factory(evaluation_wait_s=0)
    trace_id = "ef" * 16
    evaluate(http_logs(collector), [({"trace": trace_id, "span": "12" * 8},
                                     {sc.GEN_AI_EVALUATION_NAME: "orphan", sc.GEN_AI_EVALUATION_SCORE_VALUE: 0.5})])
    collector.flush()
    assert rewards(data_dir, trace_id) == [("orphan", 0.5, "phoenix-evals", "12" * 8, None)]
    assert collector.metrics.snapshot()["evaluations_unmatched_total"] == 1


def test_wal_replay_and_a_crash_while_waiting(collector_factory, data_dir, tmp_path):
    collector = collector_factory()
    ids = agent_run(collector)
    collector.flush()
    # acknowledged, only in the WAL: a replay derives the reward
    evaluate(http_logs(collector), [({"trace": ids["trace"], "span": ids["chat"]},
                                     {sc.GEN_AI_EVALUATION_NAME: "Relevance", sc.GEN_AI_EVALUATION_SCORE_VALUE: 0.8})])
    crashed = tmp_path / "crashed"
    shutil.copytree(data_dir, crashed)
    # waiting for a span that never came when the collector died: it waits again after the restart
    early = {"trace": "99" * 16, "span": "88" * 8}
    evaluate(http_logs(collector), [(early, {sc.GEN_AI_EVALUATION_NAME: "early",
                                             sc.GEN_AI_EVALUATION_SCORE_VALUE: 1.0})])
    collector.flush()
    waited = tmp_path / "waited"
    shutil.copytree(data_dir, waited)
    recovered = Collector(config(crashed)).start()
    try:
        assert rewards(crashed) == [("Relevance", 0.8, "phoenix-evals", ids["chat"], None)]
    finally:
        recovered.stop()
    restarted = Collector(config(waited)).start()
    try:
        assert restarted.evaluations_waiting == 1
        late_span(restarted, early["trace"], early["span"], "r-early")
        restarted.flush()
        assert rewards(waited, "r-early") == [("early", 1.0, "phoenix-evals", early["span"], None)]
    finally:
        restarted.stop()


def test_lightspans_rewards_as_evaluation_events():
    from lightspan.collector import evaluation_requests, evaluations, otlp_logs

    request = evaluation_requests.event_records([
        {"name": "judge", "value": 0.75, "comment": "solved", "source": "judge", "rollout_id": "r-1",
         "time_unix_nano": 1_800_000_000 * 10**9, "trace_id": "ab" * 16, "span_id": "cd" * 8},
        {"name": "human", "value": 1, "source": "human", "rollout_id": "r-2", "time_unix_nano": 1}])
    table, rejected, _ = otlp_logs.flatten_logs(request, 5)
    assert rejected == 0
    rows = table.to_pylist()
    assert [r["event_name"] for r in rows] == [EVENT, EVENT]
    assert (rows[0]["trace_id"], rows[0]["span_id"], rows[1]["trace_id"]) == ("ab" * 16, "cd" * 8, None)
    attrs = [{k: json.loads(v) for k, v in r["attributes"]} for r in rows]
    assert attrs[0][sc.GEN_AI_EVALUATION_NAME] == "judge" and attrs[0][sc.GEN_AI_EVALUATION_SCORE_VALUE] == 0.75
    assert attrs[0][sc.GEN_AI_EVALUATION_EXPLANATION] == "solved"
    assert attrs[1][sc.GEN_AI_EVALUATION_SCORE_VALUE] == 1.0
    # read back by a lightspan collector, they are evaluations again (the source stays the collector's)
    found, invalid = evaluations.from_logs(table)
    assert invalid == 0 and [(e.name, e.value) for e in found] == [("judge", 0.75), ("human", 1.0)]


def test_config_of_evaluations(tmp_path):
    import pytest

    from lightspan.collector.config import CollectorConfig
    from lightspan.core.config import ConfigError, resolve

    path = tmp_path / "lightspan.toml"
    path.write_text('[collector]\nevaluation_label_values = { pass = 1.0, "Relevance/irrelevant" = 0 }\n')
    cfg = resolve(CollectorConfig, section="collector", file=path, environ={})
    assert cfg.evaluation_label_values == {"pass": 1.0, "Relevance/irrelevant": 0}
    cfg = resolve(CollectorConfig, section="collector", environ={
        "LIGHTSPAN_COLLECTOR_EVALUATION_LABEL_VALUES": '{"pass": 1}'})
    assert cfg.evaluation_label_values == {"pass": 1}
    with pytest.raises(ConfigError, match="evaluation_label_values"):
        CollectorConfig(evaluation_label_values={"pass": "yes"})
    with pytest.raises(ConfigError, match="evaluation_wait_s"):
        CollectorConfig(evaluation_wait_s=-1.0)
