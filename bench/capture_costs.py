"""The parts of bench/capture_overhead.py's report timed with ``timeit`` rather than A/B (its
docstring's 5 and 6, and the exporter's encoding of a captured span): what lightspan decodes and does
per call beside what the client decodes without it, what it costs calls it does not capture, and
the OTLP encoding of one span with and without its attributes. No server; best of 5.
"""

from __future__ import annotations

import json

import capture_stub


def encoding_cost(exporter) -> dict:
    """µs to OTLP-encode one exported span with lightspan's attributes and one without (the
    exporter thread's share of the overhead), and their sizes."""
    import timeit

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    out = {}
    for ok, name in ((False, "without"), (True, "with")):
        span = exporter.sample[ok]
        out[f"{name}_us"] = min(timeit.repeat(lambda: encode_spans([span]).SerializeToString(),
                                              number=500, repeat=5)) / 500 * 1e6
        out[f"{name}_bytes"] = len(encode_spans([span]).SerializeToString())
    return out


def breakdown(args) -> dict:
    """Where the overhead goes, in µs (best of 5, timeit; no server, no instrumentation), per
    non-streamed call (``chat_*``) and per stream (``stream_*``): ``decode_without`` (what the
    client decodes without lightspan: ``json`` on the answer without ids; for a stream, openai's SSE
    decoder over the body and ``json`` per event), ``decode_with`` (what lightspan decodes for a
    captured call, the answer with ids and logprobs: ``capture.loads``; for a stream,
    ``sse.SSEParser`` and ``loads`` per event), ``decode_with_client`` (the client's own decoding
    of that larger answer, as without lightspan's), ``lightspan_code`` (reading the decoded JSON,
    emptying what the caller did not ask for, encoding, setting the attributes on a span)."""
    import timeit

    from openai._streaming import ServerSentEvent, SSEDecoder
    from opentelemetry.sdk.trace import TracerProvider

    from lightspan.tracing.protocols.base import loads
    from lightspan.tracing.protocols.chat import Capture
    from lightspan.tracing.sse import SSEParser

    canned = capture_stub.bodies(args.prompt_tokens, args.completion_tokens)
    bodies = {(stream, ids, lp): canned[("chat", stream, ids, lp, False)]
              for stream in (False, True) for ids in (False, True) for lp in (False, True)}
    tracer = TracerProvider().get_tracer("bench")

    def us(fn, n):
        return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6

    def chunks(body: bytes) -> list[str]:
        return [line[6:].decode() for line in body.split(b"\n\n") if line.startswith(b"data: {")]

    def client_decodes(body: bytes, stream: bool):
        if not stream:
            return json.loads(body)
        return [sse.json() for sse in SSEDecoder().iter_bytes(iter([body])) if sse.data.startswith("{")]

    def lightspan_decodes(body: bytes, stream: bool):
        if not stream:
            return loads(body)
        events = SSEParser(lambda e, d, i, r: ServerSentEvent(event=e, data=d, id=i, retry=r)).feed(body)
        return [loads(sse.data) for sse in events if sse.data.startswith("{")]

    out = {}
    for mode, stream, n in (("chat", False, 2000), ("stream", True, 100)):
        full, bare = bodies[(stream, True, True)], bodies[(stream, False, False)]
        decoded = [json.loads(t) for t in (chunks(full) if stream else [full])]
        fresh = [json.dumps(d) for d in decoded]  # re-decoded in each run: the capture mutates them

        def own(fresh=fresh):
            cap = Capture("chat", caller_ids=False, caller_logprobs=False)
            for text in fresh:
                cap.add_json(json.loads(text), True)
            span = tracer.start_span("x")
            span.set_attributes(cap.attributes(1))
            span.end()

        def baseline(fresh=fresh):
            for text in fresh:
                json.loads(text)
            tracer.start_span("x").end()

        out[f"{mode}_decode_without_us"] = us(lambda: client_decodes(bare, stream), n)
        out[f"{mode}_decode_with_us"] = us(lambda: lightspan_decodes(full, stream), n)
        out[f"{mode}_decode_with_client_us"] = us(lambda: client_decodes(full, stream), n)
        out[f"{mode}_lightspan_code_us"] = us(own, n) - us(baseline, n)
    return out


def idle_costs() -> dict:
    """µs that lightspan adds to calls it does not capture (both clients of the A/B pay them): its
    JSON hook passing one response body through to the original decoder, and its span processor's
    ``on_start`` for one span. (Streams it does not capture are not touched at all.)"""
    import timeit

    import httpx2
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from lightspan.tracing.hooks import _JSON_HOOKS
    from lightspan.tracing.spans import NESTING

    hooks = {cls: (hook, original) for cls, hook, original in _JSON_HOOKS}
    assert httpx2.Response in hooks, "lightspan's hook is not installed"
    response = httpx2.Response(200, content=b'{"id": "x", "choices": []}')
    tracer = TracerProvider().get_tracer("bench")
    parent, span = tracer.start_span("rollout"), tracer.start_span("x")

    def us(fn, n=100_000):
        return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6

    hook, original = hooks[httpx2.Response]
    try:
        httpx2.Response.json = original  # this thread alone decodes JSON now: no call of the A/B is running
        plain = us(lambda: response.json())
    finally:
        httpx2.Response.json = hook
    with trace.use_span(parent):  # under a recording span, as in a rollout: the processor's longer path
        on_start = us(lambda: NESTING.on_start(span)) - us(lambda: None)
    return {"response_us": us(lambda: response.json()) - plain, "span_on_start_us": on_start}
