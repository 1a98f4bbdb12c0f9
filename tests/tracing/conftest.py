"""Fixtures of the instrumentor tests (the provider they share is in tests/tracing/otel.py)."""

from __future__ import annotations

import pytest

from tests.tracing.otel import ensure_traceloop


@pytest.fixture(scope="session")
def _traceloop():
    """traceloop's OpenAI instrumentation on the shared provider, once per session."""
    ensure_traceloop()
