"""One tracer provider with traceloop's OpenAI instrumentation for the instrumentor tests (a plain
module, not conftest: test modules import it, and must see the same provider as the fixture)."""

from __future__ import annotations

import contextlib

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightspan.tracing.instrumentor import LightspanInstrumentor

# One provider and one traceloop instrumentation for the whole session: traceloop 0.62's
# uninstrument() leaves its wrappers in place under openai 3.x, so instrumenting it again per test
# would nest two of its spans around every call.
_EXPORTER = InMemorySpanExporter()
_PROVIDER = TracerProvider()
_PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))


_TRACELOOP = []


def ensure_traceloop() -> None:
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor

    if not _TRACELOOP:
        OpenAIInstrumentor().instrument(tracer_provider=_PROVIDER)
        _TRACELOOP.append(True)


@contextlib.contextmanager
def _instrumented():
    _EXPORTER.clear()
    LightspanInstrumentor().instrument(tracer_provider=_PROVIDER)
    previous = trace._TRACER_PROVIDER  # instrumentors take the provider; the global one cannot be reset
    trace._TRACER_PROVIDER = _PROVIDER
    try:
        yield _EXPORTER
    finally:
        trace._TRACER_PROVIDER = previous
        LightspanInstrumentor().uninstrument()


