"""The agent sees through the instrumentor exactly what it sees without it, per protocol, streamed
and not (tests/tracing/agent_view.py): the SDK objects of a greedy call straight to vLLM (a URL
lightspan does not capture) and of the same call captured are equal, ids aside, and the captured
one's span is ``ok``: nothing lightspan asked for (token ids, logprobs) reaches the agent but as
vLLM's own ``null``. The gateway's side is in tests/rollout/test_gateway_protocols.py."""

from __future__ import annotations

import pytest

from lightspan.tracing import semconv
from tests.tracing.agent_view import PROTOCOLS, aside, call
from tests.tracing.test_protocols import _calls, captured  # noqa: F401  (a fixture)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _client(protocol: str, url: str):
    if protocol == "messages":
        import anthropic

        return anthropic.Anthropic(base_url=url, api_key="x")
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="x")


@pytest.mark.parametrize("stream", [False, True], ids=["response", "stream"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_agent_sees_what_it_sees_without_lightspan(captured, vllm_server, monkeypatch, protocol, stream):
    exporter, _ = captured
    client = _client(protocol, vllm_server.url)
    monkeypatch.setenv("LIGHTSPAN_CAPTURE_URLS", "http://127.0.0.1:9")   # vLLM is not a capture URL: untouched
    plain = call(client, protocol, stream)
    assert not _calls(exporter) or {s.attributes[semconv.CAPTURE_STATUS] for s in _calls(exporter)} == {"other_url"}
    exporter.clear()
    monkeypatch.setenv("LIGHTSPAN_CAPTURE_URLS", vllm_server.url)
    seen = call(client, protocol, stream)
    (span,) = _calls(exporter)
    assert span.attributes[semconv.CAPTURE_STATUS] == "ok", span.attributes
    assert aside(seen, protocol) == aside(plain, protocol)


def test_only_the_chunks_vllm_sends_for_the_ids_alone_are_dropped():
    from lightspan.tracing.protocols.chat import Capture, only_for_capture

    def chunk(delta, finish=None):
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "token_ids": [7]}]}

    assert only_for_capture(chunk({})) and only_for_capture(chunk({"content": None}))
    assert not only_for_capture(chunk({"content": ""})) and not only_for_capture(chunk({}, "length"))
    assert not only_for_capture(chunk({"role": "assistant"})) and not only_for_capture({"choices": [], "usage": {}})
    # only where the caller asked for neither ids nor logprobs (vLLM would send it to the caller then)
    assert Capture.for_request({"messages": []}, "chat").drops_empty_chunks
    assert not Capture.for_request({"messages": [], "logprobs": True}, "chat").drops_empty_chunks
    assert not Capture.for_request({"messages": [], "return_token_ids": True}, "chat").drops_empty_chunks
    assert not Capture.for_request({"prompt": "x"}, "text_completion").drops_empty_chunks
