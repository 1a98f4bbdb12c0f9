"""Run by tests/tracing/test_openai_versions.py with another ``openai`` release installed: traceloop's
and lightspan's instrumentations on an in-memory exporter, one call of each shape to
``OPENAI_BASE_URL``; prints what the client saw and what the spans hold, as JSON."""

import asyncio
import json
import sys

from opentelemetry import trace
from opentelemetry.instrumentation.openai import OpenAIInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

exporter, provider = InMemorySpanExporter(), TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
OpenAIInstrumentor().instrument()

from lightspan.tracing import semconv  # noqa: E402
from lightspan.tracing.instrumentor import LightspanInstrumentor  # noqa: E402

LightspanInstrumentor().instrument()

import openai  # noqa: E402

client, aclient = openai.OpenAI(), openai.AsyncOpenAI()
messages = [{"role": "user", "content": "hi"}]
seen = []
chat = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
seen.append(chat.choices[0].logprobs is None)
seen.append(all(c.choices[0].logprobs is None for c in client.chat.completions.create(
    model="policy", messages=messages, max_tokens=4, stream=True) if c.choices))
raw = client.chat.completions.with_raw_response.create(model="policy", messages=messages, max_tokens=4)
seen.append(raw.parse().choices[0].message.content is not None)


async def streamed():
    stream = await aclient.chat.completions.create(model="policy", messages=messages, max_tokens=4, stream=True)
    return [c async for c in stream]


seen.append(len(asyncio.run(streamed())) > 1)
if hasattr(client, "responses"):
    response = client.responses.create(model="policy", input="hi", max_output_tokens=4)
    seen.append((response.model_extra or {}).get("input_messages") is None)
    seen.append(list(client.responses.create(model="policy", input="hi", max_output_tokens=4, stream=True))[-1].type)
spans = []
for s in sorted(exporter.get_finished_spans(), key=lambda s: s.start_time):
    a = s.attributes
    if a.get(semconv.CAPTURE_STATUS) in (None, "duplicate"):
        continue
    spans.append({"name": s.name, "status": a[semconv.CAPTURE_STATUS],
                  "prompt": semconv.decode_ids(a.get(semconv.PROMPT_TOKEN_IDS, b"")),
                  "completion": [semconv.decode_ids(b) for b in a.get(semconv.COMPLETION_TOKEN_IDS, ())]})
json.dump({"openai": openai.__version__, "seen": seen, "spans": spans}, sys.stdout)
