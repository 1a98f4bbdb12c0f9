"""Fixtures of the attack suite: collectors, a gateway in front of a recording upstream, raw HTTP.

The upstream is a stand-in for vLLM that records every request line and header it receives, so a
test can prove what did (not) reach vLLM; it answers OpenAI-shaped JSON and SSE and can set a
cookie. Everything else is the real thing: the collector and the gateway as they run.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightspan.rollout.gateway import Gateway, GatewayConfig
from tests.collector.conftest import collector_factory, data_dir  # noqa: F401 (fixtures)

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def completion(stream: bool) -> list[bytes]:
    chunk = {"id": "c", "object": "chat.completion.chunk", "model": "policy", "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop", "token_ids": [7],
                          "logprobs": {"content": [{"token": "a", "logprob": -0.5}]}}]}
    if stream:
        return [b"data: " + json.dumps(chunk).encode() + b"\n\n", b"data: [DONE]\n\n"]
    answer = {"id": "c", "object": "chat.completion", "model": "policy", "prompt_token_ids": [1, 2],
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop",
                           "token_ids": [7], "logprobs": {"content": [{"token": "a", "logprob": -0.5}]}}],
              "usage": {"prompt_tokens": 2, "completion_tokens": 1}}
    return [json.dumps(answer).encode()]


class Upstream:
    """A recording stand-in for vLLM: ``requests`` holds (method, path, headers) of every call."""

    def __init__(self, set_cookie: str | None = None):
        self.requests: list[tuple[str, str, dict]] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                upstream.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                stream = b'"stream": true' in body or b'"stream":true' in body
                parts = completion(stream) if self.path.endswith("completions") else [b'{"data": [{"id": "policy"}]}']
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream" if stream else "application/json")
                if set_cookie:
                    self.send_header("Set-Cookie", set_cookie)
                self.send_header("Content-Length", str(sum(map(len, parts))))
                self.end_headers()
                for part in parts:
                    self.wfile.write(part)

            do_GET = do_POST = do_PUT = do_DELETE = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def paths(self) -> list[str]:
        return [path for _, path, _ in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream():
    server = Upstream()
    yield server
    server.close()


@pytest.fixture
def gateway_factory(tmp_path):
    """Start gateways (in front of an upstream) with config overrides; spans in ``gw.exporter``."""
    started = []

    def make(upstream: Upstream, **overrides) -> Gateway:
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        gw = Gateway(GatewayConfig(upstream=upstream.url, port=0, data_dir=str(tmp_path), **overrides), provider)
        gw.start()
        gw.exporter = exporter
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()


def port_of(gw: Gateway) -> int:
    return urlsplit(gw.url).port


def raw_request(port: int, request: bytes, timeout: float = 10.0) -> bytes:
    """Send bytes as they are (no client-side normalisation of the path) and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer.split(b" ", 2)[1])


def rss_bytes(pid: str = "self") -> int:
    """VmRSS of a process, from /proc."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


class PeakRSS:
    """The peak resident memory of this process (or ``pid``) while the block runs, sampled every 5 ms."""

    def __init__(self, pid: int | None = None):
        self.pid = str(pid) if pid else "self"
        self.baseline = self.peak = 0

    def __enter__(self) -> "PeakRSS":
        self.baseline = self.peak = rss_bytes(self.pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.baseline
