"""The names lightspan writes on its own spans, as OTEL_SEMCONV_STABILITY_OPT_IN asks (as the OTel
instrumentations honour it): unset, the older names; gen_ai_latest_experimental, the GenAI
conventions v0.1.0; gen_ai_latest_experimental/dup, both. RL-only data stays under lightspan.*."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightspan.tracing import semconv as sc

OLD, NEW, DUP = None, "gen_ai_latest_experimental", "http/dup,gen_ai_latest_experimental/dup"


def test_genai_names_follow_the_opt_in():
    attrs = {sc.GEN_AI_OPERATION_NAME: "chat", sc.GEN_AI_PROVIDER_NAME: "openai", sc.ROLLOUT_ID: "r-1",
             sc.GEN_AI_REQUEST_TOP_K: 5, sc.PROMPT_TOKEN_IDS: b"\x01\x00\x00\x00"}
    assert sc.genai(attrs, environ={}) == {sc.GEN_AI_OPERATION_NAME: "chat", sc.GEN_AI_SYSTEM: "openai",
                                           sc.ROLLOUT_ID: "r-1", sc.GEN_AI_REQUEST_TOP_K: 5.0,
                                           sc.PROMPT_TOKEN_IDS: b"\x01\x00\x00\x00"}
    new = sc.genai(attrs, environ={sc.SEMCONV_OPT_IN_ENV: "http, gen_ai_latest_experimental"})
    assert new == {sc.GEN_AI_OPERATION_NAME: "chat", sc.GEN_AI_PROVIDER_NAME: "openai", sc.ROLLOUT_ID: "r-1",
                   sc.GEN_AI_REQUEST_TOP_K: 5, sc.PROMPT_TOKEN_IDS: b"\x01\x00\x00\x00",
                   sc.GEN_AI_CONVERSATION_ID: "r-1"}
    assert isinstance(new[sc.GEN_AI_REQUEST_TOP_K], int)
    both = sc.genai(attrs, environ={sc.SEMCONV_OPT_IN_ENV: DUP})
    assert both[sc.GEN_AI_SYSTEM] == both[sc.GEN_AI_PROVIDER_NAME] == "openai"
    assert both[sc.GEN_AI_CONVERSATION_ID] == "r-1"
    # a conversation id given in the new names only: not written under the older ones
    assert sc.GEN_AI_CONVERSATION_ID not in sc.genai({sc.GEN_AI_CONVERSATION_ID: "c"}, environ={})



def test_env_reads_what_os_environ_holds_now(monkeypatch):
    """``semconv.env`` (read per call) is ``os.environ.get(name, "")`` at every moment: a variable set,
    changed and removed through ``os.environ`` reads so at once, non-ASCII values included; and an
    ``os.environ`` replaced by a plain dict is read with ``get``."""
    import os

    name = "LIGHTSPAN_TEST_ENV_READ"
    monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(sc.SEMCONV_OPT_IN_ENV, raising=False)
    assert sc.env(name) == ""
    monkeypatch.setenv(name, "gen_ai_latest_experimental")
    assert sc.env(name) == "gen_ai_latest_experimental" and sc.genai_names() == (True, False)
    monkeypatch.setenv(sc.SEMCONV_OPT_IN_ENV, NEW)
    assert sc.genai_names() == (False, True)
    os.environ[name] = "café ☕"
    assert sc.env(name) == "café ☕" == os.environ.get(name)
    monkeypatch.delenv(name)
    assert sc.env(name) == ""
    monkeypatch.setattr(os, "environ", {name: "a dict"})
    assert sc.env(name) == "a dict" and sc.env("LIGHTSPAN_TEST_UNSET") == ""

def _spans(monkeypatch, mode, run):
    if mode is None:
        monkeypatch.delenv(sc.SEMCONV_OPT_IN_ENV, raising=False)
    else:
        monkeypatch.setenv(sc.SEMCONV_OPT_IN_ENV, mode)
    provider, memory = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    run(provider.get_tracer("lightspan"))
    provider.shutdown()
    return memory.get_finished_spans()


@pytest.mark.parametrize("mode", [OLD, NEW, DUP])
def test_the_rollout_root_span(monkeypatch, mode):
    from opentelemetry import trace

    import lightspan.tracing as tracing

    def run(tracer):
        monkeypatch.setattr(trace, "get_tracer", lambda *a, **k: tracer)
        with tracing.rollout("task-1", rollout_id="r-7"):
            pass

    (root,) = _spans(monkeypatch, mode, run)
    assert root.attributes[sc.ROLLOUT_ID] == "r-7"                       # lightspan's own, in every mode
    assert root.attributes.get(sc.GEN_AI_CONVERSATION_ID) == (None if mode is None else "r-7")


@pytest.mark.parametrize("mode", [OLD, NEW])
def test_the_apis_reward_spans(monkeypatch, mode):
    from lightspan.collector.api import reward_request

    if mode is None:
        monkeypatch.delenv(sc.SEMCONV_OPT_IN_ENV, raising=False)
    else:
        monkeypatch.setenv(sc.SEMCONV_OPT_IN_ENV, mode)
    request, _ = reward_request({"rollout_id": "r-9", "value": 1.0}, 1, b"k" * 32)
    attrs = {kv.key for kv in request.resource_spans[0].scope_spans[0].spans[0].attributes}
    assert sc.ROLLOUT_ID in attrs and sc.REWARD in attrs
    assert (sc.GEN_AI_CONVERSATION_ID in attrs) == (mode == NEW)
