"""Both generations of GenAI names are read alike: spans as traceloop's 0.62 instrumentations, the
OTel GenAI conventions before v0.1.0 and v0.1.0 itself write them, sent by the SDK's exporter to a
real collector, give the same columns, calls and agent attribution (one test per name pair)."""

from __future__ import annotations

import time

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from lightspan.tracing import semconv as sc
from tests.collector.helpers import query
from tests.lightningrl.helpers import build

CALL = {sc.PROMPT_TOKEN_IDS: sc.encode_ids([1, 2, 3]), sc.COMPLETION_TOKEN_IDS: sc.encode_ids([4, 5]),
        sc.COMPLETION_LOGPROBS: sc.encode_floats([-0.5, -0.25]), sc.CAPTURE_STATUS: "ok"}

# usage as each producer writes it: (older names: traceloop 0.62) and (v0.1.0)
USAGE = {
    "older": {sc.LLM_REQUEST_TYPE: "chat", sc.GEN_AI_SYSTEM: "openai", sc.GEN_AI_USAGE_PROMPT_TOKENS: 30,
              sc.GEN_AI_USAGE_COMPLETION_TOKENS: 7, "gen_ai.usage.cache_read_input_tokens": 20,
              "gen_ai.usage.cache_creation_input_tokens": 4, "gen_ai.usage.reasoning_tokens": 3},
    "v0.1.0": {sc.GEN_AI_OPERATION_NAME: "chat", sc.GEN_AI_PROVIDER_NAME: "openai", sc.GEN_AI_USAGE_INPUT_TOKENS: 30,
               sc.GEN_AI_USAGE_OUTPUT_TOKENS: 7, sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 20,
               sc.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: 4, sc.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: 3},
}
# the span an agent runs as: before v0.1.0 a workflow (invoke_workflow, gen_ai.workflow.name, and
# gen_ai.agent.id on the internal span); in v0.1.0 invoke_agent with gen_ai.agent.name; traceloop's
AGENT = {
    "older": ("invoke_workflow planner", {sc.GEN_AI_OPERATION_NAME: "invoke_workflow",
                                          sc.GEN_AI_WORKFLOW_NAME: "planner", sc.GEN_AI_AGENT_ID: "asst_1"}),
    "older, unnamed": ("invoke_workflow planner", {sc.GEN_AI_OPERATION_NAME: "invoke_workflow"}),
    "v0.1.0": ("invoke_agent planner", {sc.GEN_AI_OPERATION_NAME: "invoke_agent", sc.GEN_AI_AGENT_NAME: "planner"}),
    "traceloop": ("planner.agent", {sc.TRACELOOP_SPAN_KIND: "agent", sc.TRACELOOP_ENTITY_NAME: "planner"}),
}


def send(collector, rollout: str, agent: tuple[str, dict], usage: dict) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "svc", sc.ROLLOUT_ID: rollout,
                                                        sc.TASK_ID: "t"}))
    provider.add_span_processor(SimpleSpanProcessor(
        OTLPSpanExporter(endpoint=f"http://127.0.0.1:{collector.http_port}/v1/traces", timeout=5)))
    tracer = provider.get_tracer("producer")
    with tracer.start_as_current_span(agent[0], attributes=agent[1]):
        with tracer.start_as_current_span("chat policy", attributes={**usage, **CALL}):
            pass
        # v0.1.0's tool span: stored as any span, never taken for a call
        with tracer.start_as_current_span("execute_tool add", attributes={
                sc.GEN_AI_OPERATION_NAME: "execute_tool", sc.GEN_AI_TOOL_NAME: "add", sc.GEN_AI_TOOL_CALL_ID: "call_1"}):
            pass
        with tracer.start_as_current_span(sc.SPAN_REWARD, attributes={sc.REWARD: 1.0}):
            pass
    provider.shutdown()


@pytest.mark.parametrize("names", sorted(USAGE))
def test_usage_names(collector_factory, data_dir, names):
    collector = collector_factory()
    send(collector, "r", AGENT["v0.1.0"], USAGE[names])
    collector.flush()
    assert query(data_dir, """SELECT operation_name, input_tokens, output_tokens, cache_read_input_tokens,
                                     cache_creation_input_tokens, reasoning_output_tokens FROM llm_calls""") == [
        ("chat", 30, 7, 20, 4, 3)]


@pytest.mark.parametrize("names", sorted(AGENT))
def test_agent_names(collector_factory, data_dir, names):
    collector = collector_factory()
    send(collector, f"r-{names}", AGENT[names], USAGE["v0.1.0"])
    collector.flush()
    transitions, metrics = build(data_dir, now=time.time_ns() + 3600 * 10**9, min_group_size=1,
                                 agent_match="^planner$")
    assert transitions.column("agent_name").to_pylist() == ["planner"]      # one call: the tool span is none
    assert query(data_dir, "SELECT count(*) FROM llm_calls") == [(1,)]
