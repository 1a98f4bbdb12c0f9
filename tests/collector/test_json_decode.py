"""OTLP/JSON bodies are decoded side by side within ``max_json_bytes`` (issue 28, section 4): two
clients looping 7.5 MB JSON exports held every small export 6–8 s while they were decoded one at a
time (bench/collector_json_mix.py measures it; bench/README.md has the figures)."""

from __future__ import annotations

import json
import threading
import time

import requests

from lightspan.collector import signals
from tests.collector.helpers import query, traces_url

BIG_SPANS = 400


def otlp_json(spans: int, mark: int, pad: int = 0) -> bytes:
    doc = {"resourceSpans": [{"resource": {"attributes": [{"key": "lightspan.rollout.id",
                                                           "value": {"stringValue": f"json-{mark}"}}]},
                              "scopeSpans": [{"scope": {"name": "t"}, "spans": [
                                  {"traceId": f"{mark:016x}{i + 1:016x}", "spanId": f"{i + 1:016x}", "name": "chat",
                                   "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000100000000",
                                   "attributes": [{"key": "pad", "value": {"stringValue": "x" * pad}}]}
                                  for i in range(spans)]}]}]}
    return json.dumps(doc).encode()


class Decoder:
    """The collector's OTLP/JSON trace decoder, instrumented: a big body waits in it until released,
    and the bytes being decoded at once are recorded."""

    def __init__(self, big_from: int):
        self.parse, self.big_from = signals.SIGNALS["traces"]["json"], big_from
        self.release, self.big_inside = threading.Event(), threading.Event()
        self.lock, self.now, self.peak = threading.Lock(), 0, 0

    def __call__(self, body: bytes):
        with self.lock:
            self.now += len(body)
            self.peak = max(self.peak, self.now)
        try:
            if len(body) >= self.big_from and not self.release.is_set():
                self.big_inside.set()
                assert self.release.wait(30), "never released"
            return self.parse(body)
        finally:
            with self.lock:
                self.now -= len(body)


def post(collector, body: bytes, results: list | None = None, timeout: float = 30):
    answer = requests.post(traces_url(collector), data=body, headers={"Content-Type": "application/json"},
                           timeout=timeout)
    if results is not None:
        results.append(answer.status_code)
    return answer


def test_a_small_json_export_is_not_held_behind_a_big_one(collector_factory, data_dir, monkeypatch):
    big, second_big = otlp_json(BIG_SPANS, 1, pad=4000), otlp_json(BIG_SPANS, 2, pad=4000)   # ≈ 1.7 MB each
    collector = collector_factory(max_json_bytes=len(big) + len(big) // 2)        # room for one big body
    decoder = Decoder(big_from=len(big))
    monkeypatch.setitem(signals.SIGNALS["traces"], "json", decoder)
    results: list[int] = []
    senders = [threading.Thread(target=post, args=(collector, body, results)) for body in (big, second_big)]
    senders[0].start()
    try:
        assert decoder.big_inside.wait(30), "the big export never reached its decoding"
        senders[1].start()                     # waits: the two big bodies do not fit in max_json_bytes
        start = time.monotonic()
        small = [post(collector, otlp_json(2, 10 + n), timeout=10) for n in range(3)]   # while the big one decodes
        assert [a.status_code for a in small] == [200] * 3, [a.text[:200] for a in small]
        assert not decoder.release.is_set() and time.monotonic() - start < 10
    finally:
        decoder.release.set()
        for sender in senders:
            sender.join(60)
    assert results == [200, 200]
    assert decoder.peak <= collector.config.max_json_bytes       # the bound held: never both big bodies at once
    collector.flush()
    assert query(data_dir, "SELECT count(*) FROM spans") == [(2 * BIG_SPANS + 6,)]


def test_json_decoding_past_its_bound_is_told_to_retry(collector_factory, monkeypatch):
    """A body that cannot start decoding within read_timeout_s is refused 503 + Retry-After
    (retryable, nothing stored), never left waiting without bound."""
    big = otlp_json(BIG_SPANS, 1, pad=4000)
    collector = collector_factory(max_json_bytes=len(big) + 1000, read_timeout_s=1.0)
    decoder = Decoder(big_from=len(big))
    monkeypatch.setitem(signals.SIGNALS["traces"], "json", decoder)
    results: list[int] = []
    sender = threading.Thread(target=post, args=(collector, big, results))
    sender.start()
    try:
        assert decoder.big_inside.wait(30)
        refused = post(collector, otlp_json(BIG_SPANS // 2, 2, pad=4000), timeout=10)   # does not fit beside it
        assert refused.status_code == 503 and refused.headers.get("Retry-After"), refused.text[:200]
    finally:
        decoder.release.set()
        sender.join(60)
    assert results == [200]
