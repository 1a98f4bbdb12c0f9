"""Fixtures of the instrumentor tests (the provider they share is in tests/tracing/otel.py)."""

from __future__ import annotations

import threading

import pytest

from tests.tracing.otel import ensure_traceloop


@pytest.fixture(scope="session")
def _traceloop():
    """traceloop's OpenAI instrumentation on the shared provider, once per session."""
    ensure_traceloop()


@pytest.fixture(scope="module")
def recorder(vllm_server):
    """The recording proxy in front of the module's vLLM (tests/tracing/test_frameworks.py): what
    vLLM returned, to compare the stored ids with."""
    from tests.tracing.test_frameworks import _Recorder

    server = _Recorder(vllm_server.url)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
