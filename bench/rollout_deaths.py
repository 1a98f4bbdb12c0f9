"""Benchmark: which LLM calls of a dying agent are stored, per rollout mode and way of dying.

    .venv/bin/python bench/rollout_deaths.py [--samples 2] [--timeout-s 10] [--pythonpath DIR]

A real collector (``lightspan collector``, its own data directory) and the capture stub
(bench/capture_stub.py, vLLM's answers, canned) on loopback; then ``lightspan rollout`` in each mode
(``worker``, ``process``) over tests/agents/dying_agent.py, whose rollouts make two chat calls each
and then exit 0, raise, hang past ``--timeout-s`` or SIGKILL themselves (``--retries 0``, so each
rollout runs once). Reported per mode and way of dying: the agent's LLM calls stored (spans of
its chat calls in the store, after the collector's flush) / the calls it made (two per rollout,
every one answered), the rollouts' ends as the runner recorded them, and the run's exit code and
lost-span count. ``--pythonpath DIR`` runs the rollouts with another checkout's lightspan (a tree
laid out as the installed package: DIR/lightspan/{rollout,tracing,...}), for the "before" column.
The agents' exporters run with the SDK's defaults (BatchSpanProcessor: 5 s schedule delay).
Prints a Markdown table and one JSON line.
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

from lightspan.runs import free_ports

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "tests" / "agents" / "dying_agent.py"
WAYS = ("exit", "raise", "hang", "kill")


def _wait(url: str, proc: subprocess.Popen, what: str, method: str = "get") -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            getattr(requests, method)(url, timeout=1, **({"json": {"model": "policy"}} if method == "post" else {}))
            return
        except requests.RequestException:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=2, help="rollouts per way of dying and mode")
    p.add_argument("--timeout-s", type=float, default=10.0, help="the runner's --timeout-s (the hang outlives it)")
    p.add_argument("--pythonpath", default="", help="run the rollouts with the lightspan found here")
    p.add_argument("--modes", default="worker,process")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rollout-deaths-"))
    data = work / "data"
    ports = dict(zip(("grpc", "http", "api", "stub"), free_ports(4)))
    procs = []
    try:
        collector = subprocess.Popen(
            [sys.executable, "-m", "lightspan.cli", "collector", "--data-dir", str(data), "--grpc-port",
             str(ports["grpc"]), "--http-port", str(ports["http"]), "--api-port", str(ports["api"])],
            stdout=open(work / "collector.log", "wb"), stderr=subprocess.STDOUT)
        procs.append(collector)
        stub = subprocess.Popen([sys.executable, str(ROOT / "bench" / "capture_stub.py"), str(ports["stub"]),
                                 "--prompt-tokens", "16", "--completion-tokens", "2"])
        procs.append(stub)
        _wait(f"http://127.0.0.1:{ports['api']}/healthz", collector, "the collector")
        _wait(f"http://127.0.0.1:{ports['stub']}/v1/chat/completions", stub, "the stub", "post")
        env = dict(os.environ)
        if args.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.pythonpath, env.get("PYTHONPATH")]))
        runs = {}
        for mode in args.modes.split(","):
            tasks = work / f"tasks-{mode}.jsonl"
            tasks.write_text("".join(json.dumps({"id": f"{mode}:{way}", "behaviour": way,
                                                 "pid_file": str(work / f"{mode}-{way}.pid")}) + "\n" for way in WAYS))
            t0 = time.monotonic()
            out = subprocess.run(
                [sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(tasks), "--mode", mode,
                 "--samples", str(args.samples), "--concurrency", str(len(WAYS) * args.samples), "--retries", "0",
                 "--timeout-s", str(args.timeout_s), "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}",
                 "--openai-base-url", f"http://127.0.0.1:{ports['stub']}/v1", "--data-dir", str(data),
                 "--logs-dir", str(work / f"logs-{mode}"), "--", sys.executable, str(AGENT)],
                env=env, text=True, capture_output=True)
            summary = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}
            runs[mode] = {"exit_code": out.returncode, "seconds": round(time.monotonic() - t0, 1),
                          "mode_run": summary.get("mode"), "lost": (summary.get("delivery") or {}).get("lost")}
        # the agents' exporters may still be retrying nothing: every process has ended by now
        requests.post(f"http://127.0.0.1:{ports['api']}/v1/flush", timeout=120).raise_for_status()
        from lightspan import store

        con = store.connect(data)
        rows = con.execute("""
            SELECT task_id, count(*) FILTER (WHERE name = 'openai.chat') AS calls,
                   count(DISTINCT rollout_id) FILTER (WHERE name = 'lightspan.runner') AS rollouts,
                   list(DISTINCT json_extract_string(attributes['lightspan.rollout.end'], '$'))
                       FILTER (WHERE name = 'lightspan.runner') AS ends
            FROM spans GROUP BY 1""").fetchall()
        table = {task: {"stored": calls, "made": 2 * args.samples, "rollouts": n, "ends": [e for e in ends if e]}
                 for task, calls, n, ends in rows if task}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    print("| mode | " + " | ".join(WAYS) + " | exit code | lost spans |")
    print("|---|" + "---|" * (len(WAYS) + 2))
    for mode, run in runs.items():
        cells = []
        for way in WAYS:
            t = table.get(f"{mode}:{way}", {"stored": 0, "made": 2 * args.samples, "ends": []})
            cells.append(f"{t['stored']} / {t['made']}" + (f" ({', '.join(sorted(t['ends']))})" if t["ends"] else ""))
        print(f"| {mode} | " + " | ".join(cells) + f" | {run['exit_code']} | {run['lost']} |")
    print(json.dumps({"runs": runs, "stored": table, "timeout_s": args.timeout_s, "samples": args.samples,
                      "load_after": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
