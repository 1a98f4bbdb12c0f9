"""Which calls are captured: capture URLs compared as a user reads them, and the protocol a path names."""

from __future__ import annotations

import pytest

from lightspan.tracing import protocols, urls
from lightspan.tracing.instrumentor import should_capture

LOOPBACKS = ["http://localhost:8000/v1", "http://127.0.0.1:8000/v1", "http://[::1]:8000/v1",
             "http://0.0.0.0:8000/v1", "http://127.0.1.1:8000/v1/", "HTTP://LocalHost:8000//v1/"]


@pytest.mark.parametrize("configured", LOOPBACKS)
@pytest.mark.parametrize("called", LOOPBACKS)
def test_loopback_spellings_are_one_host(configured, called):
    """The agent's base URL says localhost, --openai-base-url said 127.0.0.1 (or any other pair)."""
    assert should_capture(called, "/chat/completions", configured)


def test_what_a_capture_url_covers():
    assert should_capture("http://vllm:80/v1", "/chat/completions", "http://vllm/v1")   # default port
    assert should_capture("https://vllm/v1/", "responses", "https://vllm:443")
    assert not should_capture("http://vllm:8001/v1", "/chat/completions", "http://vllm:8000/v1")
    assert not should_capture("https://127.0.0.1:8000/v1", "/chat/completions", "http://127.0.0.1:8000/v1")
    assert not should_capture("http://vllm/v10", "/chat/completions", "http://vllm/v1")    # segments, not text
    assert should_capture("http://a:1/v1", "/chat/completions", "http://b:2/v1, http://a:1/v1")
    assert should_capture("http://127.0.0.1:8000/v1", "/chat/completions", "127.0.0.1:8000")  # no scheme: http
    # unset: every loopback server, nothing else; none: nothing (a gateway captures)
    assert should_capture("http://localhost:1234/v1", "/completions", "")
    assert not should_capture("https://api.openai.com/v1", "/chat/completions", "")
    assert not should_capture("http://127.0.0.1:8000/v1", "/chat/completions", "none")
    assert urls.gateway_mode(" None ")
    # a malformed entry is ignored (and logged), the others still count
    assert should_capture("http://a:1/v1", "/chat/completions", "http://:x, http://a:1/v1")


def test_the_protocol_of_a_path():
    def of(path, client="openai"):
        protocol = protocols.of(path, client)
        return protocol.name if protocol is not None else None

    assert of("/chat/completions") == "chat"
    assert of("/v1/completions?x=1") == "text_completion"
    assert of("/responses") == "responses"
    assert of("/responses/resp_1") is None and of("/responses/resp_1/cancel") is None
    assert of("/embeddings") is None
    # Anthropic Messages only through the anthropic client: openai's /threads/{id}/messages is not one
    assert of("/v1/messages", "anthropic") == "messages"
    assert of("/threads/t/messages") is None
    assert of("/v1/messages/count_tokens", "anthropic") is None
    # the anthropic client's base URL has no /v1: the whole URL is matched
    assert should_capture("http://127.0.0.1:8000", "/v1/messages", "http://127.0.0.1:8000/v1", client="anthropic")


@pytest.mark.parametrize("host", [
    "localhost", "LOCALHOST", "app.localhost", "localhost.localdomain", "ip6-localhost", "127.0.0.1", "127.1.2.3",
    "::1", "[::1]", "0:0:0:0:0:0:0:1", "::ffff:127.0.0.1", "0.0.0.0", "::", "[::]",
    "10.0.0.1", "vllm", "127.example.com", "api.openai.com", "::ffff:10.0.0.1"])
def test_this_machine_is_loopback_or_the_unspecified_address(host):
    """urls.names_this_machine (a URL's destination) and core.config.is_loopback (a bind address
    only this machine reaches) differ by the unspecified address only; tracing imports no other part,
    so the relation is pinned here."""
    from lightspan.core.config import is_loopback

    unspecified = host.strip("[]") in ("0.0.0.0", "::")
    assert urls.names_this_machine(host) == (is_loopback(host) or unspecified)
