"""Benchmark: the collector's CPU per stored span for a run of rollouts (each span of a rollout now
reaches it twice: from the agent's exporter and from the runner's spool, rollout/spool.py).

    .venv/bin/python bench/rollout_collector_cpu.py [--rollouts 32] [--mode worker] [--pythonpath DIR]

A real collector (``lightspan collector``, this checkout's, its own data directory) and the capture
stub (bench/capture_stub.py) on loopback; then one ``lightspan rollout`` of ``--rollouts`` rollouts
of bench/agents/three_calls.py (three chat calls and a reward each). The collector's CPU (user +
system, from /proc/PID/stat) is read just before the run and after it and the collector's flush;
the difference, over the spans stored (its ``spans`` table after the flush), is the figure. The
collector's idle work over the run's wall time is in it too (say the wall time beside it).
``--pythonpath DIR`` runs the rollouts with another checkout's lightspan laid out as the installed
package (the "before" arm; the collector stays this checkout's). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from rollout_deaths import _port, _wait  # noqa: E402

AGENT = ROOT / "bench" / "agents" / "three_calls.py"


def cpu_s(pid: int) -> float:
    """User + system seconds of a running process (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--mode", default="worker", choices=("worker", "process"))
    p.add_argument("--pythonpath", default="", help="run the rollouts with the lightspan found here")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rollout-collector-cpu-"))
    data = work / "data"
    ports = {k: _port() for k in ("grpc", "http", "api", "stub")}
    procs = []
    try:
        collector = subprocess.Popen(
            [sys.executable, "-m", "lightspan.cli", "collector", "--data-dir", str(data), "--grpc-port",
             str(ports["grpc"]), "--http-port", str(ports["http"]), "--api-port", str(ports["api"])],
            stdout=open(work / "collector.log", "wb"), stderr=subprocess.STDOUT, cwd=ROOT)
        procs.append(collector)
        stub = subprocess.Popen([sys.executable, str(ROOT / "bench" / "capture_stub.py"), str(ports["stub"]),
                                 "--prompt-tokens", "64", "--completion-tokens", "16"])
        procs.append(stub)
        _wait(f"http://127.0.0.1:{ports['api']}/healthz", collector, "the collector")
        _wait(f"http://127.0.0.1:{ports['stub']}/v1/chat/completions", stub, "the stub", "post")
        tasks = work / "tasks.jsonl"
        tasks.write_text("".join(json.dumps({"id": f"t{i:03d}", "question": f"What is {i} + {i}?"}) + "\n"
                                 for i in range(args.rollouts)))
        env = {**os.environ, "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "langchain", "OPENAI_API_KEY": "bench"}
        if args.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.pythonpath, env.get("PYTHONPATH")]))
        before, t0 = cpu_s(collector.pid), time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(tasks), "--mode", args.mode,
             "--samples", "1", "--concurrency", str(args.concurrency), "--timeout-s", "120",
             "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}", "--data-dir", str(data),
             "--openai-base-url", f"http://127.0.0.1:{ports['stub']}/v1", "--logs-dir", str(work / "logs"),
             "--", sys.executable, str(AGENT)],
            env=env, text=True, capture_output=True, cwd=work)   # (not the checkout: --pythonpath must win)
        if out.returncode != 0:
            raise RuntimeError(f"lightspan rollout exited {out.returncode}: {out.stderr[-2000:]}")
        # (every agent exported its spans before it exited, the runner its spools before it returned)
        requests.post(f"http://127.0.0.1:{ports['api']}/v1/flush", timeout=120).raise_for_status()
        used, wall = cpu_s(collector.pid) - before, time.monotonic() - t0
        from lightspan import store

        spans = store.connect(data).execute("SELECT count(*) FROM spans").fetchone()[0]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    print(json.dumps({"rollouts": args.rollouts, "mode": args.mode, "pythonpath": args.pythonpath,
                      "collector_cpu_s": round(used, 3), "spans_stored": spans,
                      "collector_cpu_ms_per_span": round(1000 * used / max(spans, 1), 3),
                      "wall_s": round(wall, 1), "load_1m": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
