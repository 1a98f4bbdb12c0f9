"""Benchmark: the floor under the capture overhead of a non-streamed Responses call — what any
client-side capture must pay, with none of lightspan's code — beside lightspan's overhead.

    .venv/bin/python bench/capture_floor.py [--calls 800] [--rounds 3]

Same stub, agent process and tracing as bench/capture_overhead.py (traceloop's OpenAI
instrumentation on, an exporter that encodes and drops), four arms, calls rotating among them:

- ``without``: an openai client built before lightspan's instrumentor (the baseline);
- ``data``: the same client, asking vLLM for what lightspan asks for (``enable_response_messages``,
  the output text's logprobs: ``extra_body``), its answer decoded with orjson and those fields
  emptied before the client builds its models, as lightspan does; nothing read, nothing recorded;
- ``span``: ``data``, plus the one span a capture must open for the call (traceloop opens none for
  an answer cut at its length limit, as the stub's is, and one only after the call for a
  completed one): started before the request with the GenAI start attributes (the input
  messages, as JSON), current during it, then the ids and logprobs read from the decoded answer,
  packed, and set with the other attributes lightspan records, and ended;
- ``lightspan``: a client built after lightspan's instrumentor (captured).

Reported per arm: the median CPU time of the calling thread per call, over ``--calls`` calls each,
in each of ``--rounds`` rounds; the overhead of each arm against ``without``. ``span`` is a floor for
lightspan: the bytes vLLM sends and the span the capture must hold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import orjson

import capture_overhead as co

ARMS = ("without", "data", "span", "lightspan")
_CAPTURE_FIELDS = {"enable_response_messages": True, "include": ["message.output_text.logprobs"]}
_DECODED: list = []   # the floor arms' decoded answer (set while one of their calls runs)


def _floor_json(hooked):
    """``Response.json`` for the floor arms (orjson, then the capture fields emptied), the hooked
    one for every other call."""
    def json_(self, **kwargs):
        if not _DECODED or _DECODED[0] is not None:
            return hooked(self, **kwargs)
        data = orjson.loads(self.content)
        _DECODED[0] = (data.get("input_messages"), data.get("output_messages"),
                       [p.get("logprobs") for item in data.get("output") or () for p in item.get("content") or ()])
        data["input_messages"] = data["output_messages"] = None
        for item in data.get("output") or ():
            for part in item.get("content") or ():
                part["logprobs"] = None
        return data
    return json_


def _span_call(tracer, client, prompt: str, tokens: int) -> None:
    """The ``span`` arm: one call inside the one span a capture must hold, recorded as lightspan does."""
    from opentelemetry import trace

    from lightspan.tracing import semconv

    start = {semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_REQUEST_MODEL: co.MODEL,
             semconv.GEN_AI_SYSTEM: "openai",
             semconv.GEN_AI_INPUT_MESSAGES: orjson.dumps(
                 [{"role": "user", "parts": [{"type": "text", "content": prompt}]}]).decode()}
    span = tracer.start_span(f"chat {co.MODEL}", kind=trace.SpanKind.CLIENT, attributes=start)
    with trace.use_span(span, end_on_exit=False):
        inputs, outputs, parts = _data_call(client, prompt, tokens)
    logprobs = [e["logprob"] for lps in parts for e in lps or ()]
    span.set_attributes({
        semconv.CAPTURE_STATUS: "ok", semconv.PROMPT_TOKEN_IDS: semconv.encode_ids(inputs[0]["tokens"]),
        semconv.COMPLETION_TOKEN_IDS: (semconv.encode_ids(outputs[0]["tokens"]),),
        semconv.COMPLETION_LOGPROBS: (semconv.encode_floats(logprobs),), semconv.MODEL_VERSION: 1,
        semconv.GEN_AI_REQUEST_TEMPERATURE: 0.7, semconv.GEN_AI_RESPONSE_MODEL: co.MODEL,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: len(inputs[0]["tokens"]),
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: len(outputs[0]["tokens"]),
        semconv.GEN_AI_RESPONSE_FINISH_REASONS: ("length",),
        semconv.GEN_AI_OUTPUT_MESSAGES: orjson.dumps([{"role": "assistant", "parts": []}]).decode()})
    span.end()


def _data_call(client, prompt: str, tokens: int) -> tuple:
    """The ``data`` arm: one call asking for the capture's fields; (input messages, output messages,
    the output parts' logprobs) of its decoded answer."""
    _DECODED[:] = [None]
    try:
        co._call(client, prompt, tokens, False, api="responses", extra_body=_CAPTURE_FIELDS)
        return _DECODED[0]
    finally:
        _DECODED.clear()


def measure(args) -> dict:
    import httpx2

    from lightspan.tracing.instrumentor import LightspanInstrumentor

    provider, exporter = co._tracing()
    stub, url = co._start_stub(args.prompt_tokens, args.completion_tokens)
    prompt = ("The quick brown fox jumps over the lazy dog. " * (args.prompt_chars // 45 + 1))[:args.prompt_chars]
    plain = co._clients(url)["responses"]
    LightspanInstrumentor().instrument(tracer_provider=provider)
    httpx2.Response.json = _floor_json(httpx2.Response.json)   # (lightspan's hook underneath)
    captured = co._clients(url)["responses"]
    tracer = provider.get_tracer("bench.floor")
    n = args.completion_tokens
    arms = {"without": lambda: co._call(plain, prompt, n, False, api="responses"),
            "data": lambda: _data_call(plain, prompt, n),
            "span": lambda: _span_call(tracer, plain, prompt, n),
            "lightspan": lambda: co._call(captured, prompt, n, False, api="responses")}
    rounds = []
    try:
        for _ in range(args.rounds):
            for arm in arms.values():   # warm-up
                for _ in range(20):
                    arm()
            cpu = {name: [] for name in arms}
            for i in range(args.calls):
                order = ARMS[i % 4:] + ARMS[:i % 4]   # each arm in each position alike
                for name in order:
                    c0 = time.thread_time()
                    arms[name]()
                    cpu[name].append(time.thread_time() - c0)
            medians = {name: statistics.median(v) * 1e3 for name, v in cpu.items()}
            rounds.append({"cpu_ms": medians,
                           "overhead_ms": {name: medians[name] - medians["without"] for name in ARMS[1:]}})
    finally:
        stub.kill()
        stub.wait()
    provider.force_flush()
    # (the span arm's spans say "ok" too)
    assert exporter.captured == 2 * args.rounds * (args.calls + 20), "not every captured call was captured"
    return {"rounds": rounds,
            "median_overhead_ms": {name: statistics.median(r["overhead_ms"][name] for r in rounds) for name in ARMS[1:]}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=800, help="calls per arm and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=1000, help="prompt_token_ids in the stub's response")
    p.add_argument("--prompt-chars", type=int, default=4000, help="characters of the prompt the agent sends")
    p.add_argument("--completion-tokens", type=int, default=64)
    args = p.parse_args()
    results = {"load_before": os.getloadavg()[0], **measure(args), "load_after": os.getloadavg()[0]}
    for i, r in enumerate(results["rounds"]):
        print(f"round {i + 1}: without {r['cpu_ms']['without']:.3f} ms CPU per call; overhead "
              + ", ".join(f"{name} {r['overhead_ms'][name]:+.3f}" for name in ARMS[1:]) + " ms")
    m = results["median_overhead_ms"]
    print("median over rounds: " + ", ".join(f"{name} {m[name]:+.3f} ms" for name in ARMS[1:]))
    print(f"load average (1 min): {results['load_before']:.2f} before, {results['load_after']:.2f} after")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
