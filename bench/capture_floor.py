"""Benchmark: the floor under lightspan's capture overhead per call — what any client-side capture
must pay, with none of lightspan's code — beside lightspan's overhead, and their ratio, for a
non-streamed Responses call and an Anthropic Messages call, plain and streamed.

    .venv/bin/python bench/capture_floor.py [--calls 800] [--rounds 3] [--modes responses,messages,messages_stream]

Same stub, agent process and tracing as bench/capture_overhead.py (traceloop's OpenAI
instrumentation on, the ``anthropic`` SDK's own tracing on, an exporter that encodes and drops),
four arms per mode, calls rotating among them (each arm in each position alike):

- ``without``: a client built before lightspan's instrumentor (the baseline; an Anthropic call goes
  to ``/v1/messages``);
- ``data``: what the capture asks vLLM for, with no code of lightspan's. Responses: the same
  client asking for ``enable_response_messages`` and the output text's logprobs (``extra_body``),
  its answer decoded with orjson and those fields emptied before the client builds its models, as
  lightspan does; nothing read, nothing recorded. Anthropic (``/v1/messages`` gives no ids): the
  call sent as the chat completion with the ids and logprobs, its answer made the Anthropic
  message or events (bench/capture_floor_converted.py);
- ``span``: ``data``, plus the span the capture must hold, recorded as lightspan does. Responses
  (traceloop opens no span for an answer cut at its length limit, as the stub's is, and one only
  after the call for a completed one): one span started before the request with the GenAI start
  attributes (the input messages, as JSON), current during it, then the ids and logprobs read from
  the decoded answer, packed, and set with the other attributes lightspan records, and ended.
  Anthropic: those attributes set on the SDK's own span of the call (lightspan adopts it);
- ``lightspan``: a client built after lightspan's instrumentor (captured).

Reported per mode: the median CPU time of the calling thread per call per arm, over ``--calls``
calls each, in each of ``--rounds`` rounds (the modes take turns within a round); the overhead of
each arm against ``without``; the **ratio** of lightspan's overhead to the floor's (``span``'s), per
round, and the median over rounds. ``span`` is the floor: the bytes vLLM sends, the caller's answer
made of them and the span the capture must hold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import orjson

import capture_overhead as co

import capture_floor_converted as fa

ARMS = ("without", "data", "span", "lightspan")
MODES = ("responses", "responses_chat", "messages", "messages_stream")
_CAPTURE_FIELDS = {"enable_response_messages": True, "include": ["message.output_text.logprobs"]}


def _responses_decoded(out: list):
    """The Responses floor arms' decoder (fa.ON_JSON): orjson, the capture fields kept in ``out``
    (input messages, output messages, the output parts' logprobs) and emptied."""
    def on(content: bytes) -> dict:
        data = orjson.loads(content)
        out[:] = [data.get("input_messages"), data.get("output_messages"),
                  [p.get("logprobs") for item in data.get("output") or () for p in item.get("content") or ()]]
        data["input_messages"] = data["output_messages"] = None
        for item in data.get("output") or ():
            for part in item.get("content") or ():
                part["logprobs"] = None
        return data
    return on


def _data_call(client, prompt: str, tokens: int) -> list:
    """The Responses ``data`` arm: one call asking for the capture's fields; (input messages, output
    messages, the output parts' logprobs) of its decoded answer."""
    out: list = []
    fa.ON_JSON[0] = _responses_decoded(out)
    try:
        co._call(client, prompt, tokens, False, api="responses", extra_body=_CAPTURE_FIELDS)
        return out
    finally:
        fa.ON_JSON[0] = None


def _span_call(tracer, client, prompt: str, tokens: int) -> None:
    """The Responses ``span`` arm: one call inside the one span a capture must hold, recorded as lightspan does."""
    def call():
        inputs, outputs, parts = _data_call(client, prompt, tokens)
        return (inputs[0]["tokens"], outputs[0]["tokens"], [e["logprob"] for lps in parts for e in lps or ()], "")
    _in_span(tracer, prompt, call)


def _span_chat_call(tracer, client, prompt: str, tokens: int) -> None:
    """The ``responses_chat`` ``span`` arm: as :func:`_span_call`, the call sent as a chat completion."""
    def call():
        co._call(client, prompt, tokens, False, api="responses")
        return client.responses._floor
    _in_span(tracer, prompt, call)


def _in_span(tracer, prompt: str, call) -> None:
    """``call()`` (-> prompt ids, ids, logprobs, text) inside the one span a Responses capture must
    hold (traceloop opens none for an answer cut at its length limit, as the stub's is, and one only
    after the call for a completed one): started before with the GenAI start attributes, current
    during the call, then the ids and logprobs packed and set with the other attributes lightspan
    records, and ended."""
    from opentelemetry import trace

    from lightspan.tracing import semconv

    start = {semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_REQUEST_MODEL: co.MODEL,
             semconv.GEN_AI_SYSTEM: "openai",
             semconv.GEN_AI_INPUT_MESSAGES: orjson.dumps(
                 [{"role": "user", "parts": [{"type": "text", "content": prompt}]}]).decode()}
    span = tracer.start_span(f"chat {co.MODEL}", kind=trace.SpanKind.CLIENT, attributes=start)
    with trace.use_span(span, end_on_exit=False):
        prompt_ids, ids, logprobs, text = call()
    span.set_attributes({
        semconv.CAPTURE_STATUS: "ok", semconv.PROMPT_TOKEN_IDS: semconv.encode_ids(prompt_ids),
        semconv.COMPLETION_TOKEN_IDS: (semconv.encode_ids(ids),),
        semconv.COMPLETION_LOGPROBS: (semconv.encode_floats(logprobs),), semconv.MODEL_VERSION: 1,
        semconv.GEN_AI_REQUEST_TEMPERATURE: 0.7, semconv.GEN_AI_RESPONSE_MODEL: co.MODEL,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: len(prompt_ids), semconv.GEN_AI_USAGE_OUTPUT_TOKENS: len(ids),
        semconv.GEN_AI_RESPONSE_FINISH_REASONS: ("length",),
        semconv.GEN_AI_OUTPUT_MESSAGES: orjson.dumps([{"role": "assistant", "parts": [
            {"type": "text", "content": text}] if text else [], "finish_reason": "length"}]).decode()})
    span.end()


def _arms(mode: str, clients: dict, tracer, prompt: str, n: int) -> dict:
    """The four arms of one mode: name -> a function making one call."""
    if mode == "responses":
        plain, captured = clients["plain"]["responses"], clients["captured"]["responses"]
        return {"without": lambda: co._call(plain, prompt, n, False, api="responses"),
                "data": lambda: _data_call(plain, prompt, n),
                "span": lambda: _span_call(tracer, plain, prompt, n),
                "lightspan": lambda: co._call(captured, prompt, n, False, api="responses")}
    if mode == "responses_chat":
        floor, captured = clients["floor_responses"], clients["captured"]["responses"]
        return {"without": lambda: co._call(clients["plain"]["responses"], prompt, n, False, api="responses"),
                "data": lambda: co._call(floor, prompt, n, False, api="responses"),
                "span": lambda: _span_chat_call(tracer, floor, prompt, n),
                "lightspan": lambda: co._call(captured, prompt, n, False, api="responses")}
    stream = mode == "messages_stream"
    return {arm: (lambda c=c: co._call(c, prompt, n, stream, api="messages"))
            for arm, c in (("without", clients["plain"]["messages"]), ("data", clients["floor_data"]),
                           ("span", clients["floor_span"]), ("lightspan", clients["captured"]["messages"]))}


def _round(arms: dict, calls: int) -> dict:
    """One round of one mode: 20 warm-up calls per arm, then ``calls`` per arm, rotating; the
    median CPU ms per call per arm, the overheads against ``without`` and lightspan's ratio to the floor."""

    for arm in arms.values():
        for _ in range(20):
            arm()
    cpu = {name: [] for name in arms}
    for i in range(calls):
        for name in ARMS[i % 4:] + ARMS[:i % 4]:   # each arm in each position alike
            c0 = time.thread_time()
            arms[name]()
            cpu[name].append(time.thread_time() - c0)
    medians = {name: statistics.median(v) * 1e3 for name, v in cpu.items()}
    over = {name: medians[name] - medians["without"] for name in ARMS[1:]}
    return {"cpu_ms": medians, "overhead_ms": over, "ratio": over["lightspan"] / over["span"]}


def prompt_of(chars: int) -> str:
    """The agent's prompt, ``chars`` characters of English."""
    return ("The quick brown fox jumps over the lazy dog. " * (chars // 45 + 1))[:chars]


def clients_of(url: str, provider) -> dict:
    """The clients of every arm, of ``url`` (``…/v1``): those built before lightspan's instrumentor
    (``plain``, the floor's), then the instrumentor on ``provider`` and the captured ones."""
    import httpx2

    from lightspan.tracing.instrumentor import LightspanInstrumentor

    clients = {"plain": co._clients(url), "floor_data": fa.floor_client(url, False),
               "floor_span": fa.floor_client(url, True), "floor_responses": fa.responses_client(url)}
    LightspanInstrumentor().instrument(tracer_provider=provider)
    httpx2.Response.json = fa.json_hook(httpx2.Response.json)   # (lightspan's hook underneath)
    clients["captured"] = co._clients(url)
    return clients


def measure(args) -> dict:
    provider, exporter = co._tracing()
    stub, url = co._start_stub(args.prompt_tokens, args.completion_tokens)
    prompt = prompt_of(args.prompt_chars)
    clients = clients_of(url, provider)
    tracer = provider.get_tracer("bench.floor")
    modes = [m for m in MODES if m in args.modes.split(",")]
    arms = {mode: _arms(mode, clients, tracer, prompt, args.completion_tokens) for mode in modes}
    rounds: dict = {mode: [] for mode in modes}
    try:
        for _ in range(args.rounds):
            for mode in modes:
                provider.force_flush()
                before = exporter.captured
                rounds[mode].append(_round(arms[mode], args.calls))
                provider.force_flush()   # (the floor's spans say "ok" too)
                assert exporter.captured - before == 2 * (args.calls + 20), f"{mode}: not every call was captured"
    finally:
        stub.kill()
        stub.wait()
    out = {}
    for mode, rs in rounds.items():
        med = {name: statistics.median(r["overhead_ms"][name] for r in rs) for name in ARMS[1:]}
        ratios = sorted(r["ratio"] for r in rs)
        out[mode] = {"rounds": rs, "median_overhead_ms": med, "median_ratio": statistics.median(ratios),
                     "ratio_range": (ratios[0], ratios[-1]), "ratio_of_medians": med["lightspan"] / med["span"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=800, help="calls per arm and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--prompt-tokens", type=int, default=1000, help="prompt_token_ids in the stub's response")
    p.add_argument("--prompt-chars", type=int, default=4000, help="characters of the prompt the agent sends")
    p.add_argument("--completion-tokens", type=int, default=64)
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    results = measure(args)
    results = {"load_before": load_before, "modes": results, "load_after": os.getloadavg()[0]}
    for mode, r in results["modes"].items():
        for i, rd in enumerate(r["rounds"]):
            print(f"{mode:16s} round {i + 1}: without {rd['cpu_ms']['without']:.3f} ms CPU per call; overhead "
                  + ", ".join(f"{name} {rd['overhead_ms'][name]:+.3f}" for name in ARMS[1:])
                  + f" ms; lightspan / floor {rd['ratio']:.2f}x")
        m = r["median_overhead_ms"]
        print(f"{mode:16s} median over rounds: " + ", ".join(f"{name} {m[name]:+.3f} ms" for name in ARMS[1:])
              + f"; ratio lightspan / floor {r['median_ratio']:.2f}x (rounds {r['ratio_range'][0]:.2f}"
              f"-{r['ratio_range'][1]:.2f}x)")
    print(f"load average (1 min): {results['load_before']:.2f} before, {results['load_after']:.2f} after")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
