"""Benchmark: the agent-side cost of lightspan's instrumentor per LLM call, side by side with the
same agent under traceloop's OpenAI instrumentation alone, for each protocol (``--apis``: openai
chat completions and Responses, anthropic Messages), streamed and not.

    .venv/bin/python bench/capture_overhead.py [--calls 2000] [--vllm-url http://127.0.0.1:8000]

1. A stub HTTP server on loopback (bench/capture_stub.py), in its own process, answers
   ``POST /v1/chat/completions``, ``/v1/responses`` and ``/v1/messages`` with canned answers shaped
   exactly as vLLM 0.32's (field for field, from recorded ones), for a ``--prompt-tokens`` prompt
   and ``--completion-tokens`` completion tokens: with the ids and sampled-token logprobs when the
   request asks for them (lightspan's instrumentor does), with those fields ``null`` when it does
   not, as vLLM does. It stands in for vLLM only to isolate the client's side: with a real model
   the server's time dwarfs and blurs the client's. Streamed calls get one event per token, as vLLM
   sends them. An Anthropic call without lightspan goes to ``/v1/messages``; with it, converted, to
   the chat completions (tracing/protocols/anthropic_convert.py), so its overhead includes the conversion.
2. One agent process: an SDK tracer provider with a BatchSpanProcessor whose exporter encodes
   every batch to OTLP protobuf and drops it (the network is not measured), traceloop's OpenAI
   instrumentation (the one we ship with) on, lightspan's instrumentor on, and two ``openai``
   clients: one built *before* lightspan's instrumentor was installed (an openai resource keeps
   the ``post`` it was built with, so lightspan never sees its calls: the baseline) and one built
   after (captured; the script checks that every one of its calls was). Calls alternate between
   the two (ABBA…), so the noise of a shared machine hits both alike (the anthropic client likewise,
   with its own tracing of its calls on in both). The prompt is
   ``--prompt-chars`` characters (≈ 1k tokens of English for a BPE tokenizer).
3. Per call: the calling thread's CPU time (``time.thread_time``: the client-side time of the
   call, without the stub's) and its wall time. Reported: medians over ``--calls`` calls each.
   The exporter's encoding runs in its own thread; its extra cost per captured span is timed in 5.
4. Overhead = median with − median without, in CPU time; as a share of the client-side time of a
   call (the CPU time per call without lightspan). With ``--vllm-url``, the same A/B against that
   real vLLM (``--vllm-calls`` calls per client and mode; same prompt length, capped by its
   context; ``--completion-tokens`` tokens, ``ignore_eos``): the baseline client gets vLLM's answer
   without ids, the captured one the answer with them; the overhead's share of the client's CPU
   per call and of the call's time.
5. A breakdown (timeit, no server; best of 5): decoding — what the client decodes without
   lightspan (vLLM's answer without ids: ``json``; for a stream, openai's SSE decoder and ``json``
   per event) against what lightspan decodes for a captured call (the answer with ids and
   logprobs: orjson; for a stream, lightspan's SSE parser and orjson per event), and what the
   client's own decoding would take on that larger answer — and lightspan's own work on the
   decoded data (reading ids and logprobs, emptying what the caller did not ask for, encoding,
   setting the attributes), per non-streamed call and per stream. A captured stream can cost less
   than an uncaptured one: lightspan's SSE parser is faster than openai's; the breakdown gives
   lightspan's gross cost beside the net overhead of 4.
6. What lightspan costs calls it does not capture, which both clients of 2.-4. pay alike and so is
   not in the overhead: its JSON hook passing a response through, and its span processor's
   ``on_start`` per span.

7. With ``--spool``, the span spool that ``lightspan rollout`` turns on (tracing/spool.py: every
   span written to a file as it ends, so that a process that dies loses nothing): per protocol and
   mode, the captured client's calls with the spool on (``with``) against the same client's calls
   with it off (``without``, today's path), alternating; results ``spool_chat``, ``spool_stream``, …

Prints a summary and one JSON line (the numbers recorded in bench/README.md, "Capture overhead"),
with the load average (1 min) before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import capture_stub
from capture_costs import breakdown, encoding_cost, idle_costs

MODEL = capture_stub.MODEL


# --- the stub server (bench/capture_stub.py, its own process) ---------------------------------

def _start_stub(prompt_tokens: int, completion_tokens: int, ids_for_all: bool = False) -> tuple[subprocess.Popen, str]:
    import requests

    from lightspan.runs import free_ports

    port = free_ports(1)[0]
    flags = ["--ids-for-all"] if ids_for_all else []
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("capture_stub.py")), str(port),
                             "--prompt-tokens", str(prompt_tokens), "--completion-tokens", str(completion_tokens), *flags])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": MODEL}, timeout=1)
            return proc, f"http://127.0.0.1:{port}/v1"
        except requests.RequestException:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the stub server did not start")


# --- the agent side ------------------------------------------------------------------------------

def _tracing():
    """An SDK provider whose exporter encodes each batch to OTLP protobuf and drops it."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class EncodeAndDrop(SpanExporter):
        def __init__(self):
            self.bytes = 0
            self.spans = 0
            self.captured = 0
            self.sample = {}  # one exported span with lightspan's attributes (True) and one without

        def export(self, spans):
            self.bytes += len(encode_spans(spans).SerializeToString())
            self.spans += len(spans)
            for span in spans:
                # (a streamed Responses call of the real vLLM keeps its ids, not every logprob: no_logprobs)
                ok = span.attributes.get("lightspan.capture.status") in ("ok", "no_logprobs")
                self.captured += ok
                self.sample.setdefault(ok, span)
            return SpanExportResult.SUCCESS

        def shutdown(self):
            pass

    exporter = EncodeAndDrop()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor

    OpenAIInstrumentor().instrument(tracer_provider=provider)
    return provider, exporter


def _call(client, prompt: str, max_tokens: int, stream: bool, model: str = MODEL, extra_body=None,
          api: str = "chat") -> None:
    """One call of ``api`` (chat completions, the Responses API, Anthropic Messages), read to its end."""
    messages = [{"role": "user", "content": prompt}]
    if api == "responses":
        kw = {"model": model, "input": prompt, "max_output_tokens": max_tokens, "temperature": 0.7}
        create = client.responses.create
    elif api == "messages":   # (anthropic 2.x takes the temperature as an extra field)
        kw = {"model": model, "messages": messages, "max_tokens": max_tokens}
        extra_body = {"temperature": 0.7, **(extra_body or {})}
        create = client.messages.create
    else:
        kw = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.7}
        create = client.chat.completions.create
    if extra_body:
        kw["extra_body"] = extra_body
    if stream:
        for _ in create(**kw, stream=True):
            pass
    else:
        create(**kw)


APIS = ("chat", "responses", "messages")
"""The protocols timed: openai chat completions and Responses, anthropic Messages."""


def _clients(url: str) -> dict:
    """An openai and an anthropic client of ``url`` (``…/v1``), their resources built now."""
    import anthropic
    from openai import OpenAI

    openai_client = OpenAI(base_url=url, api_key="bench", max_retries=0)
    anthropic_client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="bench", max_retries=0)
    openai_client.chat.completions, openai_client.responses, anthropic_client.messages  # noqa: B018
    return {"chat": openai_client, "responses": openai_client, "messages": anthropic_client}


def _ab(clients: dict, call, calls: int, provider, exporter, warmup: int = 20, switch=None) -> dict:
    """Medians of the calling thread's CPU time and of the wall time per call, ``without`` and
    ``with`` lightspan, calls alternating (ABBA…); checks that every ``with`` call was captured.
    ``switch(name)``, when given, runs before each call (the spool arm: both arms are the captured
    client, the spool on for ``with`` only)."""
    for client in clients.values():  # warm-up: connections, caches
        for _ in range(warmup):
            call(client)
    provider.force_flush()
    captured0, cpu, wall = exporter.captured, {k: [] for k in clients}, {k: [] for k in clients}
    for i in range(calls):
        for name in (("without", "with") if i % 2 else ("with", "without")):
            if switch is not None:
                switch(name)
            c0, t0 = time.thread_time(), time.perf_counter()
            call(clients[name])
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.thread_time() - c0)
    provider.force_flush()
    expected = calls * (2 if clients["with"] is clients["without"] else 1)
    assert exporter.captured - captured0 == expected, "not every call of the captured client was captured"
    r = {k: {"cpu_ms": statistics.median(cpu[k]) * 1e3, "wall_ms": statistics.median(wall[k]) * 1e3} for k in clients}
    r["overhead_cpu_ms"] = r["with"]["cpu_ms"] - r["without"]["cpu_ms"]
    r["overhead_wall_ms"] = r["with"]["wall_ms"] - r["without"]["wall_ms"]
    r["overhead_share_of_client_cpu"] = r["overhead_cpu_ms"] / r["without"]["cpu_ms"]
    r["overhead_share_of_wall"] = r["overhead_cpu_ms"] / r["without"]["wall_ms"]
    return r


def _vllm_target(args) -> dict:
    """The real server's base URL, served model, and a prompt as long as its context allows."""
    import requests

    model = requests.get(f"{args.vllm_url}/v1/models", timeout=10).json()["data"][0]
    limit = model.get("max_model_len") or 1024
    chars = min(args.prompt_chars, limit - args.completion_tokens - 64)  # byte-level tiny models: 1 char ≈ 1 token
    prompt = ("The quick brown fox jumps over the lazy dog. " * (chars // 45 + 1))[:chars]
    return {"url": f"{args.vllm_url}/v1", "model": model["id"], "prompt": prompt}


def _mode(api: str, stream: bool) -> str:
    """A result's name: ``chat`` / ``stream`` as before, ``responses`` / ``responses_stream``, …"""
    return ("stream" if stream else "chat") if api == "chat" else api + ("_stream" if stream else "")


def measure(args) -> dict:
    """The A/B of every protocol and mode: against the stub, then (``--vllm-url``) the real vLLM. The
    clients made before the instrumentor keep the unwrapped ``post`` (the baseline); the anthropic
    baseline calls vLLM's ``/v1/messages``, the captured client its chat completions, converted."""
    from lightspan.tracing.instrumentor import LightspanInstrumentor

    provider, exporter = _tracing()
    stub, url = _start_stub(args.prompt_tokens, args.completion_tokens, args.ids_for_all)
    prompt = ("The quick brown fox jumps over the lazy dog. " * (args.prompt_chars // 45 + 1))[:args.prompt_chars]
    vllm = _vllm_target(args) if args.vllm_url else None
    baselines = {"stub": _clients(url), **({"vllm": _clients(vllm["url"])} if vllm else {})}
    LightspanInstrumentor().instrument(tracer_provider=provider)
    results = {}
    apis = [a for a in APIS if a in args.apis.split(",")]
    try:
        captured = _clients(url)
        for api in apis:
            for stream in (False, True):
                results[_mode(api, stream)] = _ab(
                    {"without": baselines["stub"][api], "with": captured[api]},
                    lambda c, stream=stream, api=api: _call(c, prompt, args.completion_tokens, stream, api=api),
                    args.calls, provider, exporter)
        if args.spool:   # today's path (captured) against the same calls with the span spool on
            from lightspan.tracing.spool import Spool

            spool = Spool(os.path.join(args.spool_dir or os.getcwd(), f".capture-bench-{os.getpid()}.spool"),
                          provider.resource)
            provider.add_span_processor(spool)
            try:
                for api in apis:
                    for stream in (False, True):
                        results["spool_" + _mode(api, stream)] = _ab(
                            {"without": captured[api], "with": captured[api]},
                            lambda c, stream=stream, api=api: _call(c, prompt, args.completion_tokens, stream,
                                                                    api=api),
                            args.calls, provider, exporter, switch=lambda name: setattr(spool, "active", name == "with"))
            finally:
                spool.active = False
                spool.shutdown()
                os.unlink(spool.path)
    finally:
        stub.kill()
        stub.wait()
    results["export_encoding_us"] = encoding_cost(exporter)
    results["idle_us"] = idle_costs()
    if vllm:
        captured = _clients(vllm["url"])
        first = captured["chat"].chat.completions.create(
            model=vllm["model"], messages=[{"role": "user", "content": vllm["prompt"]}],
            max_tokens=args.completion_tokens, extra_body={"ignore_eos": True})
        usage = first.usage
        results["vllm"] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}
        for api in apis:
            for stream in (False, True):
                results["vllm"][_mode(api, stream)] = _ab(
                    {"without": baselines["vllm"][api], "with": captured[api]},
                    lambda c, stream=stream, api=api: _call(c, vllm["prompt"], args.completion_tokens, stream,
                                                            vllm["model"], {"ignore_eos": True}, api),
                    args.vllm_calls, provider, exporter, warmup=3)
    return results


def _ab_line(r: dict) -> str:
    """One A/B result of :func:`_ab`, as printed."""
    return (f"without lightspan: {r['without']['cpu_ms']:.3f} ms CPU, {r['without']['wall_ms']:.3f} ms wall  |  "
            f"with: {r['with']['cpu_ms']:.3f} ms CPU, {r['with']['wall_ms']:.3f} ms wall  |  overhead "
            f"{r['overhead_cpu_ms']:+.3f} ms CPU ({r['overhead_share_of_client_cpu']:+.1%} of the client's CPU per "
            f"call, {r['overhead_share_of_wall']:+.2%} of the call's time), {r['overhead_wall_ms']:+.3f} ms wall")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per client and mode (alternating)")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="prompt_token_ids in the stub's response")
    p.add_argument("--prompt-chars", type=int, default=4000, help="characters of the prompt the agent sends")
    p.add_argument("--completion-tokens", type=int, default=64)
    p.add_argument("--vllm-url", default="", help="also time a real call to this vLLM (e.g. http://127.0.0.1:8000)")
    p.add_argument("--vllm-calls", type=int, default=100, help="real calls per client and mode (alternating)")
    p.add_argument("--ids-for-all", action="store_true",
                   help="the stub sends token ids to the baseline client too (as if it had asked): the overhead "
                        "left is lightspan's code and the logprobs it asks for, not the ids' bytes")
    p.add_argument("--apis", default=",".join(APIS), help="protocols to time, comma-separated: " + ", ".join(APIS))
    p.add_argument("--spool", action="store_true",
                   help="also time the span spool (tracing/spool.py, on in lightspan rollout): the captured client's "
                        "calls with the spool on against the same calls without it (today's path), alternating")
    p.add_argument("--spool-dir", default="", help="where the spool file goes (default: the working directory)")
    args = p.parse_args()
    results = {"load_before": os.getloadavg()[0]}
    results.update(measure(args))
    results["breakdown"] = breakdown(args)
    results["load_after"] = os.getloadavg()[0]
    modes = [m for m in results if isinstance(results[m], dict) and "overhead_cpu_ms" in results[m]]
    for mode in modes:
        print(f"{mode:16s}  {_ab_line(results[mode])}")
    e = results["export_encoding_us"]
    print(f"OTLP encoding of the call's span in the exporter thread: {e['without_us']:.0f} µs ({e['without_bytes']} B)"
          f" without, {e['with_us']:.0f} µs ({e['with_bytes']} B) with lightspan's attributes")
    d = results["breakdown"]
    for mode, unit in (("chat", "call"), ("stream", "stream")):
        print(f"{mode:6s} per {unit}: the client decodes vLLM's answer without ids in "
              f"{d[f'{mode}_decode_without_us']:.0f} µs; lightspan decodes the answer with ids and logprobs in "
              f"{d[f'{mode}_decode_with_us']:.0f} µs (the client's own decoding would take "
              f"{d[f'{mode}_decode_with_client_us']:.0f} µs) and reads and records it in "
              f"{d[f'{mode}_lightspan_code_us']:.0f} µs")
    i = results["idle_us"]
    print(f"calls not captured (both clients pay it): {i['response_us']:.2f} µs per response, "
          f"{i['span_on_start_us']:.2f} µs per span started")
    print(f"load average (1 min): {results['load_before']:.2f} before, {results['load_after']:.2f} after")
    if "vllm" in results:
        v = results["vllm"]
        print(f"real vLLM calls ({v['prompt_tokens']} prompt + {v['completion_tokens']} completion tokens):")
        for mode in modes:
            print(f"  {mode:16s}  {_ab_line(v[mode])}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
