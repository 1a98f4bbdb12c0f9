"""The cost of one run of the example: wall time and CPU time of a command and every process it starts.

    python examples/production/measure.py --out examples/production/results/seed0/cost.json -- \\
      bash examples/production/run.sh hosted sft rl

Every ``--every-s`` seconds it reads, with psutil, the CPU time (user + system) of each process in the
command's tree (the command and its descendants: collector, vLLM and its engine, gateway, service,
trainer, ...), keyed by pid and start time, and keeps each one's last reading; the run's CPU time is
their sum once the command ends. A process that ends between two readings loses at most ``every_s``
of its CPU time; the kernel's count of the command's waited-for descendants (``os.wait4``) is written
beside it as a check (it misses what was never waited for). The 1-minute load average is sampled too:
the machine's other work slows a run's wall time, not its CPU time. Also by kind of process (the first
of :data:`KINDS` its command line names), to say where the CPU went.
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

import psutil

KINDS = ("vllm", "train --algo sft", "train", "transitions", "gateway", "collector", "service.py", "traffic.py",
         "hosted_standin.py", "summarize.py")


def kind(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    if text.startswith("VLLM::") or "vllm.entrypoints" in text or " vllm " in f" {text} ":
        return "vllm"          # the server, its engine and workers; not the trainer's --vllm-url
    return next((k for k in KINDS[1:] if k in text), "other")


def sample(root: psutil.Process, seen: dict) -> None:
    """Record the CPU time of ``root`` and its descendants now, in ``seen[(pid, created)]``."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            with p.oneshot():
                t = p.cpu_times()
                # vLLM's engine and workers rename themselves (VLLM::Worker) after they start: read again
                seen[(p.pid, p.create_time())] = (t.user + t.system, kind([p.name(), *p.cmdline()]))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON file the cost goes to")
    parser.add_argument("--every-s", type=float, default=2.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.every_s <= 0:
        parser.error("give a positive --every-s and the command after --")
    started, seen, loads = time.time(), {}, []
    proc = subprocess.Popen(command)
    root = psutil.Process(proc.pid)
    status = None
    while status is None:
        sample(root, seen)
        loads.append(os.getloadavg()[0])
        for _ in range(max(1, int(args.every_s / 0.2))):     # see the end soon, sample every every_s
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            status = None
            time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    by_kind: dict[str, float] = {}
    for cpu, label in seen.values():
        by_kind[label] = by_kind.get(label, 0.0) + cpu
    cost = {"command": command, "exit_code": proc.returncode, "started_unix": round(started, 3),
            "wall_min": round((time.time() - started) / 60, 2),
            "cpu_min": round(sum(by_kind.values()) / 60, 2),
            "cpu_min_waited_for": round((usage.ru_utime + usage.ru_stime) / 60, 2),
            "cpu_min_by_kind": {k: round(v / 60, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "processes": len(seen), "cores": os.cpu_count(),
            "load_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads),
                          "samples": len(loads), "every_s": args.every_s}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(cost, indent=2) + "\n")
    print(json.dumps({k: cost[k] for k in ("exit_code", "wall_min", "cpu_min", "cpu_min_waited_for")}),
          file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
