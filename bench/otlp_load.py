"""The load of the collector benchmarks: GenAI OTLP trace requests and the senders that export them.

:func:`genai_request` builds one pre-serialized ``ExportTraceServiceRequest`` of ``batch`` chat
spans (the attributes traceloop's OpenAI instrumentation writes, JSON messages, plus lightspan's
token ids and logprobs as little-endian bytes: ≈ 2.4 KB a span). :func:`send` exports such
requests from ``senders`` threads, one channel (OTLP/gRPC) or ``requests.Session`` (OTLP/HTTP
protobuf, keep-alive) each, every request with fresh ids; a refusal (UNAVAILABLE + RetryInfo, or a
503/429) is retried after its delay (the ``google.rpc.retryinfo-bin`` trailer, ``Retry-After``), as
the Python OTLP exporter does, and its time counts. It returns spans/s and MB/s acknowledged in the
measured window, p50/p99 export latency, refusals and errors.

Used by bench/collector_ingest.py and bench/collector_vs_phoenix.py (bench/ is not a package: they
put it on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time

import grpc

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
EXPORT_METHOD = f"/{TRACE_SERVICE}/Export"
RETRY_INFO_KEY = "google.rpc.retryinfo-bin"
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]

MARK = 6   # bytes every id of a request starts with: trace_id = mark + 10 bytes, span_id = mark + 2


def genai_request(batch: int, rng: random.Random, mark: bytes | None = None) -> bytes:
    """One ExportTraceServiceRequest of ``batch`` chat spans with token ids as bytes. With ``mark``
    (``MARK`` bytes) every id starts with it, so ``payload.replace(mark, new)`` gives fresh ids."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from lightspan.tracing import semconv as sc

    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    for key, value in (("service.name", "bench-agent"), (sc.ROLLOUT_ID, f"rollout-{rng.getrandbits(32):08x}"),
                       (sc.TASK_ID, f"task-{rng.randrange(100)}")):
        rs.resource.attributes.add(key=key).value.string_value = value
    scope = rs.scope_spans.add()
    scope.scope.name = "opentelemetry.instrumentation.openai.v1"
    trace_id = rng.randbytes(16) if mark is None else mark + rng.randbytes(16 - MARK)
    now = time.time_ns()
    for i in range(batch):
        prompt = [rng.randrange(50_000) for _ in range(256)]
        completion = [rng.randrange(50_000) for _ in range(64)]
        span_id = rng.randbytes(8) if mark is None else mark + i.to_bytes(8 - MARK, "big")
        span = scope.spans.add(trace_id=trace_id, span_id=span_id, name="openai.chat", kind=3,
                               start_time_unix_nano=now + i * 1000, end_time_unix_nano=now + i * 1000 + 5 * 10**8)
        attrs = {
            sc.GEN_AI_OPERATION_NAME: "chat", "gen_ai.system": "openai",
            sc.GEN_AI_REQUEST_MODEL: "policy", sc.GEN_AI_RESPONSE_MODEL: "policy",
            sc.GEN_AI_USAGE_INPUT_TOKENS: len(prompt), sc.GEN_AI_USAGE_OUTPUT_TOKENS: len(completion),
            sc.GEN_AI_INPUT_MESSAGES: json.dumps([{"role": "user", "content": "What is 17 + 25? " * 8}]),
            sc.GEN_AI_OUTPUT_MESSAGES: json.dumps([{"role": "assistant", "content": "17 + 25 = 42. " * 6}]),
            sc.PROMPT_TOKEN_IDS: sc.encode_ids(prompt), sc.COMPLETION_TOKEN_IDS: sc.encode_ids(completion),
            sc.COMPLETION_LOGPROBS: sc.encode_floats([-rng.random() for _ in completion]),
            sc.MODEL_VERSION: 3,
        }
        for key, value in attrs.items():
            v = span.attributes.add(key=key).value
            if isinstance(value, bytes):
                v.bytes_value = value
            elif isinstance(value, int):
                v.int_value = value
            else:
                v.string_value = value
        v = span.attributes.add(key=sc.GEN_AI_RESPONSE_FINISH_REASONS).value
        v.array_value.values.add().string_value = "stop"
    return request.SerializeToString()


def _http_export(session, url: str):
    """An OTLP/HTTP export function with the gRPC stub's shape: raises _Refused(delay) on 503/429."""
    def export(payload: bytes, timeout: float) -> None:
        answer = session.post(url, data=payload, timeout=timeout, headers={"Content-Type": "application/x-protobuf"})
        if answer.status_code in (429, 503):
            raise _Refused(float(answer.headers.get("Retry-After", 1)), True)
        if answer.status_code != 200:
            raise _Refused(1.0, False)
    return export


class _Refused(Exception):
    def __init__(self, delay: float, retryable: bool):
        self.delay, self.retryable = delay, retryable


def send(port: int, payloads: list[tuple[bytes, bytes]], batch: int, senders: int, warmup_s: float,
         seconds: float, transport: str = "grpc") -> dict:
    """``senders`` threads export round-robin for warmup + seconds; counts only the measured window.
    ``payloads``: (request, its mark); every request sent gets fresh ids (a new mark)."""
    start = time.monotonic()
    window = (start + warmup_s, start + warmup_s + seconds)
    results = [dict(acked=0, bytes=0, refused=0, errors=0, latencies=[]) for _ in range(senders)]

    def sender(k: int) -> None:
        out = results[k]
        # a channel of its own (its own TCP connection), like separate agent processes
        if transport == "http":
            import requests
            channel = requests.Session()
            export = _http_export(channel, f"http://127.0.0.1:{port}/v1/traces")
        else:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS + [
                ("grpc.use_local_subchannel_pool", 1)])
            export = channel.unary_unary(EXPORT_METHOD)
        i = k
        while True:
            t0 = time.monotonic()
            if t0 >= window[1]:
                break
            template, mark = payloads[i % len(payloads)]
            payload = template.replace(mark, os.urandom(MARK))   # real spans never repeat an id
            i += 1
            try:
                export(payload, timeout=30)
            except _Refused as refusal:
                if window[0] <= t0:
                    out["refused" if refusal.retryable else "errors"] += 1
                time.sleep(min(refusal.delay, max(0.0, window[1] - time.monotonic())))
                continue
            except grpc.RpcError as error:
                if window[0] <= t0:
                    out["refused" if error.code() == grpc.StatusCode.UNAVAILABLE else "errors"] += 1
                delay = 1.0
                for key, value in error.trailing_metadata() or ():
                    if key == RETRY_INFO_KEY:
                        from google.rpc import error_details_pb2
                        info = error_details_pb2.RetryInfo.FromString(value)
                        delay = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
                time.sleep(min(delay, max(0.0, window[1] - time.monotonic())))
                continue
            t1 = time.monotonic()
            if window[0] <= t0 and t1 <= window[1]:
                out["acked"] += batch
                out["bytes"] += len(payload)
                out["latencies"].append(t1 - t0)
        channel.close()

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    latencies = sorted(x for r in results for x in r["latencies"])
    acked = sum(r["acked"] for r in results)
    return {
        "spans_per_s": acked / seconds,
        "mb_per_s": sum(r["bytes"] for r in results) / seconds / 1e6,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else float("nan"),
        "refused": sum(r["refused"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "acked_in_window": acked,
    }
