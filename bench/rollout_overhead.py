"""Benchmark: CPU per rollout of ``lightspan rollout`` in worker mode and in process mode, beside a
bare ``python agent.py``, in the same run.

    .venv/bin/python bench/rollout_overhead.py [--rollouts 32] [--rounds 5] [--concurrency 4] [--batches 8]

1. A stub server on loopback, in its own process, stands in for vLLM and the collector: it answers
   ``POST /v1/chat/completions`` with a canned answer shaped as vLLM 0.32's (bench/capture_overhead.py's
   bodies: with token ids and logprobs when the request asks for them), and ``POST /v1/traces`` as an
   OTLP/HTTP receiver that decodes each request and keeps, per ``lightspan.rollout.id`` of the
   resource (or of the runner's span), the names of its spans; ``GET /spans`` returns and clears them.
   With a real model the server's time would dwarf and blur the client's.
2. The agent, ``bench/agents/three_calls.py``: three chat calls with the openai client and a reward span.
3. Each round runs, in turn, ``--rollouts`` rollouts three ways, on one task file of ``--rollouts``
   tasks × 1 sample:
   - **worker**: ``lightspan rollout --mode worker`` (``--concurrency`` at once);
   - **process**: ``lightspan rollout --mode process`` (each rollout ``opentelemetry-instrument python agent.py``);
   - **bare**: ``python agent.py`` once per task, one after the other, with the task in its environment
     and no instrumentation (nothing exported).
   - **kept**: ``--batches`` such batches through one ``Runner`` (rollout/runner.py), as an experiment
     runs every step's rollouts since session 21: the runner's start and the zygote's warm-up paid once
     for all of them. Its CPU per rollout is the whole process's over ``--batches`` × ``--rollouts``.
   The CPU time of each is user + system of the whole process tree, as the kernel accounts it to
   the process this script waits for (``os.wait4``): every descendant was waited for by its parent,
   so the runner, the zygote, the children, the launchers and the agents are all in it, and so is
   the runner's own start-up. The order of the three rotates from round to round; the ratios
   (worker / bare, process / bare) are taken within each round, so a drift of the machine's speed
   hits both sides of a ratio alike. Reported: each round, then the medians.
4. A check, every round: both modes exported, for every rollout, the same span names (the agent's
   three ``openai.chat`` spans, its reward span, the runner's span), one rollout id per rollout.

Prints a table and one JSON line, with the load average (1 min) before and after (the figures in
bench/README.md, "Rollout overhead").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

BENCH = Path(__file__).resolve().parent
AGENT = BENCH / "agents" / "three_calls.py"
sys.path.insert(0, str(BENCH))

from lightspan.runs import free_ports  # noqa: E402


def serve(port: int) -> None:
    """The stub: canned chat answers, an OTLP/HTTP span sink (its own process)."""
    import capture_stub   # (capture_overhead's _response_bodies moved there in e1591f9)
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    canned = capture_stub.bodies(64, 16)
    bodies = {(stream, ids, lp): canned[("chat", stream, ids, lp, False)]
              for stream in (False, True) for ids in (False, True) for lp in (False, True)}
    spans: dict[str, list[str]] = defaultdict(list)
    lock = threading.Lock()
    ok = ExportTraceServiceResponse().SerializeToString()

    def rollout_of(attributes) -> str | None:
        return next((a.value.string_value for a in attributes if a.key == "lightspan.rollout.id"), None)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, *args):
            pass

        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            with lock:
                doc = dict(spans)
                spans.clear()
            self._send(json.dumps(doc).encode(), "application/json")

        def do_POST(self):
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path.endswith("/v1/traces"):
                request = ExportTraceServiceRequest.FromString(raw)
                with lock:
                    for rs in request.resource_spans:
                        resource = rollout_of(rs.resource.attributes)
                        for ss in rs.scope_spans:
                            for span in ss.spans:
                                spans[resource or rollout_of(span.attributes) or "?"].append(span.name)
                self._send(ok, "application/x-protobuf")
                return
            request = json.loads(raw)
            body = bodies[(False, bool(request.get("return_token_ids")), bool(request.get("logprobs")))]
            self._send(body, "application/json")

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def _start_stub() -> tuple[subprocess.Popen, str]:
    import requests

    port = free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            requests.get(f"http://127.0.0.1:{port}/spans", timeout=1)
            return proc, f"http://127.0.0.1:{port}"
        except requests.RequestException:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the stub server did not start")


def _cpu(cmd: list[str], env: dict, cwd: str) -> tuple[float, float]:
    """(CPU seconds of the process tree, wall seconds) of one command, its output discarded."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:6]} exited with {proc.returncode}")
    return usage.ru_utime + usage.ru_stime, time.monotonic() - t0


def measure(args) -> dict:
    import requests

    stub, url = _start_stub()
    work = Path(tempfile.mkdtemp(prefix="lightspan-rollout-bench-"))
    tasks = [{"id": f"t{i:03d}", "question": f"What is {i} + {i}?"} for i in range(args.rollouts)]
    (work / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    env = {**os.environ, "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "langchain", "OPENAI_API_KEY": "bench"}
    rollout = [sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(work / "tasks.jsonl"),
               "--samples", "1", "--concurrency", str(args.concurrency), "--otlp-endpoint", url,
               "--openai-base-url", f"{url}/v1", "--data-dir", str(work), "--timeout-s", "120"]
    agent = [sys.executable, str(AGENT)]

    def worker():
        return _cpu([*rollout, "--mode", "worker", "--", *agent], env, str(work))

    def process():
        return _cpu([*rollout, "--mode", "process", "--", *agent], env, str(work))

    def kept():
        cpu, wall = _cpu([sys.executable, __file__, "--kept", str(args.batches), "--kept-tasks", str(work / "tasks.jsonl"),
                          "--kept-url", url, "--concurrency", str(args.concurrency), "--", *agent], env, str(work))
        return cpu / args.batches, wall / args.batches

    def bare():
        cpu = wall = 0.0
        for t in tasks:
            c, w = _cpu(agent, {**env, "LIGHTSPAN_TASK": json.dumps(t), "OPENAI_BASE_URL": f"{url}/v1"}, str(work))
            cpu, wall = cpu + c, wall + w
        return cpu, wall

    targets = {"worker": worker, "process": process, "bare": bare, "kept": kept}
    rounds, load = [], [os.getloadavg()[0]]
    try:
        requests.get(f"{url}/spans", timeout=5)
        for r in range(args.rounds + 1):              # round 0 warms the page cache, not counted
            order = list(targets)[r % len(targets):] + list(targets)[:r % len(targets)]
            row, shapes = {}, {}
            for name in order:
                cpu, wall = targets[name]()
                row[name] = {"cpu_per_rollout": cpu / args.rollouts, "wall_s": wall}
                if name != "bare":
                    n = args.rollouts * (args.batches if name == "kept" else 1)
                    shapes[name] = _span_shapes(requests.get(f"{url}/spans", timeout=30).json(), n)
            if not shapes["worker"] == shapes["process"] == shapes["kept"]:
                raise RuntimeError(f"the runners exported different spans: {shapes}")
            row["spans_per_rollout"] = shapes["worker"]
            if r:
                rounds.append(row)
                print(f"round {r}: " + ", ".join(f"{k} {row[k]['cpu_per_rollout']:.3f} CPU-s/rollout"
                                                  for k in targets), file=sys.stderr)
    finally:
        stub.kill()
    load.append(os.getloadavg()[0])
    med = {k: statistics.median(r[k]["cpu_per_rollout"] for r in rounds) for k in targets}
    ratio = {f"{k}/bare": statistics.median(r[k]["cpu_per_rollout"] / r["bare"]["cpu_per_rollout"] for r in rounds)
             for k in ("worker", "process", "kept")}
    ratio["kept/worker"] = statistics.median(r["kept"]["cpu_per_rollout"] / r["worker"]["cpu_per_rollout"]
                                             for r in rounds)
    return {"rollouts": args.rollouts, "rounds": args.rounds, "concurrency": args.concurrency, "batches": args.batches,
            "median_cpu_per_rollout": med, "median_ratio": ratio, "spans_per_rollout": rounds[0]["spans_per_rollout"],
            "rounds_detail": rounds, "load_1m": load}


def _span_shapes(by_rollout: dict, n: int) -> dict:
    """The multiset of span names per rollout, checked to be one shape for all ``n`` rollouts."""
    shapes = Counter(tuple(sorted(names)) for rid, names in by_rollout.items() if rid != "?")
    if sum(shapes.values()) != n or len(shapes) != 1:
        raise RuntimeError(f"expected {n} rollouts of one shape, got {dict(shapes)} (unattributed: "
                           f"{by_rollout.get('?')})")
    return dict(Counter(next(iter(shapes))))


def kept_batches(batches: int, tasks_file: str, url: str, concurrency: int, agent: list[str]) -> None:
    """The kept arm's process: ``batches`` batches of the task file through one Runner."""
    from lightspan.rollout.runner import RolloutConfig, Runner, load_tasks

    cfg = RolloutConfig(tasks=tasks_file, samples=1, concurrency=concurrency, otlp_endpoint=url,
                        openai_base_url=f"{url}/v1", data_dir=str(Path(tasks_file).parent), timeout_s=120)
    with Runner(cfg, agent) as runner:
        for _ in range(batches):
            outcome = runner.run(load_tasks(tasks_file))
            if outcome["ok"] != outcome["rollouts"] or outcome["delivery"]["lost"]:
                raise SystemExit(f"a kept batch failed: {outcome}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts per mode and round (a demo step's 4 x 8)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--batches", type=int, default=8, help="batches the kept arm runs through one Runner")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--kept", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--kept-tasks", help=argparse.SUPPRESS)
    parser.add_argument("--kept-url", help=argparse.SUPPRESS)
    parser.add_argument("agent", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    if args.kept:
        kept_batches(args.kept, args.kept_tasks, args.kept_url, args.concurrency, args.agent)
        return
    result = measure(args)
    med, ratio = result["median_cpu_per_rollout"], result["median_ratio"]
    print(f"{args.rollouts} rollouts x {args.rounds} rounds (load {result['load_1m'][0]:.1f} -> "
          f"{result['load_1m'][1]:.1f}); CPU seconds per rollout, medians:")
    print(f"  bare python agent.py        {med['bare']:.3f}")
    print(f"  lightspan rollout (worker)  {med['worker']:.3f}   ({ratio['worker/bare']:.2f}x bare)")
    print(f"  lightspan rollout (process) {med['process']:.3f}   ({ratio['process/bare']:.2f}x bare)")
    print(f"  one Runner, {args.batches} batches  {med['kept']:.3f}   ({ratio['kept/bare']:.2f}x bare, "
          f"{ratio['kept/worker']:.2f}x a lightspan rollout per batch)")
    print(f"  spans per rollout (every runner alike): {result['spans_per_rollout']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
