"""Shared helpers of the collector tests: configs, spans from the real SDK, queries, raw calls."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightspan import store
from lightspan.collector.config import CollectorConfig
from lightspan.collector.server import EXPORT_METHOD, Collector
from lightspan.tracing import semconv as sc

NEVER = 1e9  # flush_interval_s: only flush() and stop() write Parquet


def config(data_dir, **overrides) -> CollectorConfig:
    values = dict(data_dir=str(data_dir), grpc_port=0, http_port=0, api_port=0, flush_interval_s=NEVER)
    values.update(overrides)
    return CollectorConfig(**values)



def build_provider(rollout: str, processor_exporter=None):
    resource = Resource.create({"service.name": "agent", sc.ROLLOUT_ID: rollout, sc.TASK_ID: "task-1"})
    provider = TracerProvider(resource=resource)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(processor_exporter or memory))
    return provider, memory


def agent_run(provider, calls: int = 2) -> None:
    tracer = provider.get_tracer("test-agent")
    with tracer.start_as_current_span("agent"):
        for i in range(calls):
            with tracer.start_as_current_span("chat") as span:
                span.set_attribute(sc.GEN_AI_OPERATION_NAME, "chat")
                span.set_attribute(sc.PROMPT_TOKEN_IDS, sc.encode_ids([100 + i, 101, 102]))
                span.set_attribute(sc.COMPLETION_TOKEN_IDS, [sc.encode_ids([7, i]), sc.encode_ids([9])])
                span.set_attribute(sc.COMPLETION_LOGPROBS, [sc.encode_floats([-0.5, -1.5]), sc.encode_floats([-2.0])])
                span.set_attribute(sc.MODEL_VERSION, 3)


def make_spans(rollout: str = "rollout-1", calls: int = 2):
    provider, memory = build_provider(rollout)
    agent_run(provider, calls)
    provider.shutdown()
    return memory.get_finished_spans()


def grpc_exporter(collector: Collector, timeout: float = 5) -> GrpcExporter:
    return GrpcExporter(endpoint=f"127.0.0.1:{collector.grpc_port}", insecure=True, timeout=timeout)


def http_exporter(collector: Collector, **kwargs) -> HttpExporter:
    return HttpExporter(endpoint=f"http://127.0.0.1:{collector.http_port}/v1/traces", timeout=5, **kwargs)


def traces_url(collector: Collector) -> str:
    return f"http://127.0.0.1:{collector.http_port}/v1/traces"


def api_url(collector: Collector, path: str) -> str:
    return f"http://127.0.0.1:{collector.api_port}{path}"


def query(data_dir, sql: str):
    con = store.connect(data_dir)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def raw_rows(data_dir) -> int:
    """Rows in the Parquet files, duplicates included."""
    files = list(Path(data_dir, "spans").rglob("*.parquet"))
    if not files:
        return 0
    return query(data_dir, f"SELECT count(*) FROM read_parquet({[str(f) for f in files]})")[0][0]


def grpc_call(collector: Collector, payload: bytes):
    """One raw OTLP/gRPC call: (response bytes, None) or (None, RpcError)."""
    with grpc.insecure_channel(f"127.0.0.1:{collector.grpc_port}") as channel:
        export = channel.unary_unary(EXPORT_METHOD)
        try:
            return export(payload, timeout=5), None
        except grpc.RpcError as error:
            return None, error


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def request_bytes(spans) -> bytes:
    return encode_spans(spans).SerializeToString()


def with_bad_span(spans) -> bytes:
    """A valid request whose last span has a 15-byte trace id."""
    request = encode_spans(spans)
    bad = request.resource_spans[0].scope_spans[0].spans.add()
    bad.CopyFrom(request.resource_spans[0].scope_spans[0].spans[0])
    bad.trace_id = bad.trace_id[:15]
    return request.SerializeToString()


