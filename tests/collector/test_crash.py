"""Crash: the real collector service under load from gRPC and HTTP clients, killed with SIGKILL
at random moments 20 times on the same data directory; afterwards every acknowledged span is
in the ``spans`` view exactly once, with the content it was sent with."""

from __future__ import annotations

import random
import threading
import time

import grpc
import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)

from lightspan.collector.server import EXPORT_METHOD
from lightspan.tracing import semconv as sc
from tests.collector.helpers import query, wait_for
from tests.collector.process import CollectorProcess

KILLS = 20
SENDERS = (("grpc", 0), ("grpc", 1), ("http", 2), ("http", 3))   # (transport, sender id)


class Ledger:
    """What the clients sent and what the collector acknowledged, span by span."""

    def __init__(self):
        self.lock = threading.Lock()
        self.acked: dict[tuple[str, str], str] = {}   # (trace_id hex, span_id hex) → span name
        self.acked_requests = 0
        self.failed_requests = 0                       # connection lost, refused: not acknowledged
        self.unexpected: list[str] = []                # an answer no crash explains (400, 500, ...)


def batch(sender: int, seq: int, size: int) -> tuple[bytes, dict]:
    """A request of ``size`` spans with ids unique to (sender, seq, i); the span name repeats them."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = "crash-test"
    rs.resource.attributes.add(key=sc.ROLLOUT_ID).value.string_value = f"rollout-{sender}-{seq}"
    spans = rs.scope_spans.add()
    now = time.time_ns()
    ids = {}
    trace_id = (0x10 + sender).to_bytes(4, "big") + seq.to_bytes(12, "big")
    for i in range(size):
        span_id = (i + 1).to_bytes(8, "big")
        name = f"s{sender}-{seq}-{i}"
        span = spans.spans.add(trace_id=trace_id, span_id=span_id, name=name, kind=3,
                               start_time_unix_nano=now, end_time_unix_nano=now + 1000)
        span.attributes.add(key=sc.PROMPT_TOKEN_IDS).value.bytes_value = sc.encode_ids([seq % 50_000, i, sender])
        ids[(trace_id.hex(), span_id.hex())] = name
    return request.SerializeToString(), ids


def sender_loop(transport: str, sender: int, service: CollectorProcess, ledger: Ledger,
                stop: threading.Event, seqs: dict, rng: random.Random) -> None:
    channel = grpc.insecure_channel(service.grpc_target) if transport == "grpc" else None
    session = requests.Session()
    try:
        while not stop.is_set():
            seqs[sender] += 1
            payload, ids = batch(sender, seqs[sender], rng.randint(1, 8))
            try:
                if transport == "grpc":
                    answer = channel.unary_unary(EXPORT_METHOD)(payload, timeout=10)
                else:
                    response = session.post(service.url("http", "/v1/traces"), data=payload, timeout=10,
                                            headers={"Content-Type": "application/x-protobuf"})
                    if response.status_code != 200:
                        with ledger.lock:
                            ledger.failed_requests += 1
                            if response.status_code != 503:
                                ledger.unexpected.append(f"HTTP {response.status_code}: {response.text[:200]}")
                        continue
                    answer = response.content
            except grpc.RpcError as error:
                with ledger.lock:
                    ledger.failed_requests += 1
                    if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        ledger.unexpected.append(f"gRPC {error.code()}: {error.details()}")
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    stop.wait(0.01)    # the server is gone: don't spin until the test notices
                continue
            except requests.RequestException:
                with ledger.lock:
                    ledger.failed_requests += 1
                stop.wait(0.01)
                continue
            partial = ExportTraceServiceResponse.FromString(answer).partial_success
            with ledger.lock:
                if partial.rejected_spans:
                    ledger.unexpected.append(f"{transport}: partial_success {partial}")
                ledger.acked.update(ids)
                ledger.acked_requests += 1
    finally:
        if channel is not None:
            channel.close()
        session.close()


def test_kill_9_under_load_loses_no_acknowledged_span(tmp_path):
    rng = random.Random(20261130)
    data_dir = tmp_path / "data"
    # flushes every 50 ms and compaction past 3 small files: kills land in the WAL write, the
    # fsync, a Parquet write, a WAL truncation and a compaction as well as between them
    service = CollectorProcess(data_dir, tmp_path / "collector.log", flush_interval_s=0.05, compact_min_files=3)
    ledger, seqs = Ledger(), {sender: 0 for _, sender in SENDERS}
    kills_under_load = 0
    for round_ in range(KILLS):
        if round_ % 5 == 2:
            # killed while starting: during the WAL replay, before the receivers serve (the
            # random delay picks the moment of the kill; nothing is timed)
            service.spawn()
            time.sleep(rng.uniform(0.0, 1.5))
            service.kill()
            continue
        service.start()
        stop = threading.Event()
        threads = [threading.Thread(target=sender_loop, args=(t, s, service, ledger, stop, seqs,
                                                              random.Random(rng.random())))
                   for t, s in SENDERS]
        for thread in threads:
            thread.start()
        with ledger.lock:
            target = ledger.acked_requests + rng.randint(1, 60)
        wait_for(lambda target=target: ledger.acked_requests >= target, timeout=60, what=f"{target} acknowledged requests")
        service.kill()                                 # mid-load: requests are in flight
        kills_under_load += 1
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    service.start()                                    # the last replay, then a clean stop
    assert service.stop() == 0
    assert ledger.unexpected == []
    assert kills_under_load == 16 and ledger.acked_requests >= 16 and len(ledger.acked) >= 16
    assert not list((data_dir / "wal").glob("*.wal"))     # a clean stop leaves the WAL empty
    stored = query(data_dir, "SELECT trace_id, span_id, name FROM spans")
    by_key = {(t, s): name for t, s, name in stored}
    assert len(by_key) == len(stored)                  # exactly once in the view
    missing = [key for key in ledger.acked if key not in by_key]
    assert missing == [], f"{len(missing)} acknowledged spans lost, e.g. {missing[:3]}"
    assert all(by_key[key] == name for key, name in ledger.acked.items())
    assert ledger.failed_requests > 0                  # the kills cut requests in flight
    records = service.records()
    assert sum(r["spans"] for r in records if r["msg"].startswith("replayed")) > 0
    assert any(r["msg"].startswith("compacted") for r in records)   # kills could land in a compaction
