"""Benchmark: bench/capture_floor.py's arms counted in machine instructions — everything the calling
thread executes, the interpreter's C work (orjson, packing, ``set_attributes``, allocation, the
garbage collector) as well as its bytecodes, the same on every run whatever the machine's load.

    .venv/bin/python bench/capture_instructions.py [--modes messages,messages_stream,responses] [--calls 200]
                                                   [--warmup 30] [--functions 25] [--keep DIR]

It runs itself under ``valgrind --tool=callgrind`` (instrumentation off until the arms run: the
imports go at valgrind's plain speed). Clients, tracing and canned answers as bench/capture_opcodes.py
(capture_floor's ``clients_of`` and ``_arms``, capture_overhead's ``_tracing``, the stub's bodies
answered in process by an ``httpx2.MockTransport``; its answers are made once per request and
memoised, so the transport's own work is a dict lookup). Per mode and arm: ``--warmup`` calls, the
span processor flushed, then ``--calls`` calls with callgrind's counters on (a small C library built
here with gcc gives Python ``CALLGRIND_ZERO_STATS`` and ``CALLGRIND_DUMP_STATS_AT``), the garbage
collector on as in the timed benchmark. ``--separate-threads=yes``: only the calling thread's
instructions are read (the span exporter's thread, like ``time.thread_time``, not counted).

Printed per mode: instructions per call per arm (``Ir``), each arm's excess over ``without``,
lightspan's excess over the floor's (``span``) and their ratio; with ``--functions N``, the N
functions (inclusive of what they call, excluding the mocked server) whose instructions per call
differ most between the floor and lightspan (from ``callgrind_annotate --inclusive=yes``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
_C = r"""
#include <valgrind/callgrind.h>
void ls_zero(void) { CALLGRIND_ZERO_STATS; }
void ls_on(void) { CALLGRIND_START_INSTRUMENTATION; }
void ls_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


def _library(folder: str):
    src, lib = os.path.join(folder, "ls_callgrind.c"), os.path.join(folder, "ls_callgrind.so")
    Path(src).write_text(_C)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
    return ctypes.CDLL(lib)


def _mock(clients: dict, canned: dict) -> None:
    """bench/capture_opcodes.py's transport, each request's answer made once."""
    import httpx2

    import capture_stub

    made: dict = {}

    def handler(request):
        key = (request.url.path, request.content)
        found = made.get(key)
        if found is None:
            found = made[key] = capture_stub.answer(canned, request.url.path, json.loads(request.content))
        return httpx2.Response(200, headers={"content-type": found[0]}, content=found[1])

    transport = httpx2.MockTransport(handler)
    for group in clients.values():
        for client in (group.values() if isinstance(group, dict) else (group,)):
            client._client._transport = transport


def _inside(args) -> None:
    """Under callgrind: run the arms, one dump per mode and arm."""
    sys.path.insert(0, str(HERE))
    import capture_floor as cf
    import capture_overhead as co
    import capture_stub

    lib = _library(args.keep)
    provider, _ = co._tracing()
    stub = None
    if args.server:   # the stub's server over loopback, as the timed benchmark
        stub, url = co._start_stub(args.prompt_tokens, args.completion_tokens)
        clients = cf.clients_of(url, provider)
    else:
        clients = cf.clients_of("http://127.0.0.1:9/v1", provider)
        _mock(clients, capture_stub.bodies(args.prompt_tokens, args.completion_tokens))
    tracer = provider.get_tracer("bench.floor")
    prompt = cf.prompt_of(args.prompt_chars)
    lib.ls_on()
    for mode in [m for m in cf.MODES if m in args.modes.split(",")]:
        arms = cf._arms(mode, clients, tracer, prompt, args.completion_tokens)
        for name in cf.ARMS:
            for _ in range(args.warmup):
                arms[name]()
            provider.force_flush()
            gc.collect()
            arm = arms[name]
            lib.ls_zero()
            for _ in range(args.calls):
                arm()
            lib.ls_dump(f"{mode}.{name}".encode())
    if stub is not None:
        stub.kill()
        stub.wait()


def _dumps(folder: str) -> dict:
    """(mode, arm) -> the dump file of the calling thread (the one with the most instructions)."""
    best: dict = {}
    for f in Path(folder).glob("callgrind.out.*"):
        head = f.read_text(errors="replace")[:4000]
        m = re.search(r"^desc: Trigger: Client Request: (\S+)", head, re.M)
        total = re.search(r"^(?:summary|totals): (\d+)", f.read_text(errors="replace"), re.M)
        if not m or not total:
            continue
        key = tuple(m.group(1).split("."))
        if key not in best or int(total.group(1)) > best[key][1]:
            best[key] = (f, int(total.group(1)))
    return best


def _functions(path: Path, calls: int) -> dict:
    """function -> inclusive instructions per call (callgrind_annotate)."""
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(path)],
                         capture_output=True, text=True, check=True).stdout
    per = {}
    for line in out.splitlines():
        m = re.match(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S.*)$", line)
        if m and ":" in m.group(2):
            per[m.group(2).strip()] = int(m.group(1).replace(",", "")) / calls
    return per


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="messages,messages_stream,responses")
    p.add_argument("--calls", type=int, default=200, help="calls counted per arm")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--functions", type=int, default=0)
    p.add_argument("--server", action="store_true", help="the stub's HTTP server, not the mocked transport")
    p.add_argument("--sim", action="store_true", help="callgrind's cache and branch simulation too")
    p.add_argument("--keep", default=None, help="folder for callgrind's dumps (default: a temporary one)")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--prompt-chars", type=int, default=4000)
    p.add_argument("--completion-tokens", type=int, default=64)
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inside:
        _inside(args)
        return
    folder = args.keep or tempfile.mkdtemp(prefix="capture-callgrind-")
    os.makedirs(folder, exist_ok=True)
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("keep", "inside", "server", "sim")]
    argv += ["--server"] if args.server else []
    sim = ["--cache-sim=yes", "--branch-sim=yes"] if args.sim else []
    subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes", *sim,
                    f"--callgrind-out-file={folder}/callgrind.out.%p", sys.executable, __file__, "--inside",
                    f"--keep={folder}", *argv],
                   check=True, env={**os.environ, "PYTHONHASHSEED": "0"}, stderr=subprocess.DEVNULL)
    dumps = _dumps(folder)
    summary = {}
    modes = sorted({mode for mode, _ in dumps}, key=args.modes.split(",").index)
    for mode in modes:
        per = {arm: dumps[(mode, arm)][1] / args.calls for arm in ("without", "data", "span", "lightspan")}
        base = per["without"]
        print(f"{mode}: instructions per call (callgrind Ir, the calling thread, {args.calls} calls)")
        for arm, v in per.items():
            print(f"  {arm:10s} {v:12,.0f} ({v - base:+10,.0f})")
        floor, ours = per["span"] - base, per["lightspan"] - base
        print(f"  lightspan - floor: {ours - floor:+,.0f}; ratio of excesses lightspan / floor {ours / floor:.2f}x")
        summary[mode] = {**per, "ratio": ours / floor}
        if args.functions:
            f_span = _functions(dumps[(mode, "span")][0], args.calls)
            f_ours = _functions(dumps[(mode, "lightspan")][0], args.calls)
            diff = {k: f_ours.get(k, 0) - f_span.get(k, 0) for k in set(f_span) | set(f_ours)}
            print("  functions, inclusive per call: lightspan - floor (floor, lightspan)")
            for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.functions]:
                print(f"    {d:+10,.0f}  ({f_span.get(k, 0):10,.0f} {f_ours.get(k, 0):10,.0f})  {k[:150]}")
    print(json.dumps({"folder": folder, "modes": summary}))


if __name__ == "__main__":
    main()
