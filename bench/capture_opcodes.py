"""Benchmark: bench/capture_floor.py's arms counted instead of timed — the Python opcodes one call
executes and the C functions it calls, the same on every run whatever the machine's load.

    .venv/bin/python bench/capture_opcodes.py [--modes messages,messages_stream,responses] [--warmup 30]
                                              [--functions 25]

The arms, clients, tracing and canned answers are capture_floor's (``clients_of``, ``_arms``),
capture_overhead's (``_tracing``) and capture_stub's (``bodies``, ``answer``); only the transport
differs: every client's HTTP client gets an ``httpx2.MockTransport`` that answers from the stub's
bodies in this process (its own work, and the span exporter's thread, are not counted). Per mode and
arm: ``--warmup`` calls, the span processor flushed, then one call counted with ``sys.settrace``
(``f_trace_opcodes``: one event per bytecode executed) and ``sys.setprofile`` (``c_call`` events),
the garbage collector off. Printed: the counts, each arm's excess over ``without``, lightspan's
excess over the floor's (``span``) and their ratio. A streamed floor can count below ``without``
(its decoder splits the bytes itself; the client's own parses every line in Python), so for a stream
lightspan − floor is the figure to read. ``--functions N``: the N functions of lightspan's (the package
imported: a tree first on ``PYTHONPATH`` too) and the benchmark's, not the libraries', that execute
the most opcodes, per arm.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
from pathlib import Path

import capture_floor as cf
import capture_overhead as co
import capture_stub

ROOT = str(Path(__file__).resolve().parent.parent)
_PAUSED = [False]   # inside the mocked server: not counted


def _mock(clients: dict, canned: dict) -> None:
    """Every client's HTTP client answers from ``canned`` (capture_stub's bodies), in process."""
    import httpx2

    def handler(request):
        _PAUSED[0] = True
        try:
            content_type, body = capture_stub.answer(canned, request.url.path, json.loads(request.content))
            return httpx2.Response(200, headers={"content-type": content_type}, content=body)
        finally:
            _PAUSED[0] = False

    transport = httpx2.MockTransport(handler)
    for group in clients.values():
        for client in (group.values() if isinstance(group, dict) else (group,)):
            client._client._transport = transport


def count(fn, functions: bool = False) -> dict:
    """Opcodes and C calls of one ``fn()`` in this thread (and, with ``functions``, opcodes per
    function: (file, line, name) -> count)."""
    ops, calls = [0], [0]
    per: collections.Counter = collections.Counter()

    def local(frame, event, arg):
        if event == "opcode" and not _PAUSED[0]:
            ops[0] += 1
            if functions:
                code = frame.f_code
                per[(code.co_filename, code.co_firstlineno, code.co_name)] += 1
        return local

    def on_call(frame, event, arg):
        frame.f_trace_opcodes = True
        return local

    def profile(frame, event, arg):
        if event == "c_call" and not _PAUSED[0]:
            calls[0] += 1

    gc.collect()
    gc.disable()
    sys.settrace(on_call)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        sys.settrace(None)
        gc.enable()
    return {"opcodes": ops[0], "c_calls": calls[0], "functions": per}


def measure(args) -> dict:
    provider, _ = co._tracing()
    url = "http://127.0.0.1:9/v1"   # (loopback: a capture URL; never reached, the transport is mocked)
    clients = cf.clients_of(url, provider)
    _mock(clients, capture_stub.bodies(args.prompt_tokens, args.completion_tokens))
    tracer = provider.get_tracer("bench.floor")
    prompt = cf.prompt_of(args.prompt_chars)
    out = {}
    for mode in [m for m in cf.MODES if m in args.modes.split(",")]:
        arms = cf._arms(mode, clients, tracer, prompt, args.completion_tokens)
        out[mode] = {}
        for name in cf.ARMS:
            for _ in range(args.warmup):
                arms[name]()
            provider.force_flush()
            out[mode][name] = count(arms[name], functions=args.functions > 0)
    return out


def _roots() -> tuple:
    """This repository, and the ``lightspan`` package imported (a tree first on ``PYTHONPATH``)."""
    import lightspan.tracing

    return ROOT, str(Path(lightspan.tracing.__file__).parent.parent)


def _ours(path: str, roots: tuple):
    """``path`` relative to the root of ours that holds it (not the libraries'), else None."""
    if "/.venv/" in path or "site-packages" in path:
        return None
    for root in roots:
        if path.startswith(root + "/"):
            return path[len(root) + 1:]
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="messages,messages_stream,responses",
                   help="comma-separated: " + ", ".join(cf.MODES))
    p.add_argument("--warmup", type=int, default=30, help="calls per arm before the one counted")
    p.add_argument("--functions", type=int, default=0, help="list the N functions of this repository with the most opcodes")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--prompt-chars", type=int, default=4000)
    p.add_argument("--completion-tokens", type=int, default=64)
    args = p.parse_args()
    results = measure(args)
    summary = {}
    for mode, arms in results.items():
        base = arms["without"]
        print(f"{mode}:")
        for name in cf.ARMS:
            r = arms[name]
            print(f"  {name:10s} {r['opcodes']:8,d} opcodes ({r['opcodes'] - base['opcodes']:+7,d})"
                  f"  {r['c_calls']:6,d} C calls ({r['c_calls'] - base['c_calls']:+5,d})")
        floor, ours = arms["span"]["opcodes"] - base["opcodes"], arms["lightspan"]["opcodes"] - base["opcodes"]
        ratio = ours / floor if floor > 0 else float("nan")
        print(f"  lightspan - floor: {ours - floor:+,d} opcodes; ratio of excesses lightspan / floor {ratio:.2f}x")
        summary[mode] = {name: {"opcodes": r["opcodes"], "c_calls": r["c_calls"]} for name, r in arms.items()}
        summary[mode]["ratio"] = ratio
        if args.functions:
            for name in ("span", "lightspan"):
                roots = _roots()
                per = {(_ours(path, roots), line, fn): v for (path, line, fn), v in arms[name]["functions"].items()
                       if _ours(path, roots)}
                print(f"  {name}: its {sum(per.values()):,d} opcodes in lightspan's and the benchmark's code, the most first:")
                for (path, line, fn), n in sorted(per.items(), key=lambda kv: -kv[1])[:args.functions]:
                    print(f"    {n:6,d}  {fn} ({path}:{line})")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
