"""The processes and bookkeeping of one training run (``lightspan experiment`` and its presets).

A run owns a fresh data directory, starts its services (collector, vLLM, trainer) as child
processes that log to ``DATA_DIR/logs/NAME.log`` and are stopped when the run ends, calls the
``lightspan`` CLI for its one-shot jobs (rollouts, transitions) and reads its figures back from
the store with SQL. Wall time is summed per stage for the report.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import requests

from lightspan import inference, store
from lightspan.core.config import ConfigError

RUN_MARKER = ".lightspan-run"
"""Written into a data directory that a demo or experiment made: only such a directory is wiped."""


def fresh_data_dir(path: str, section: str) -> Path:
    """An empty data directory for one run at ``path``: made, or wiped if an earlier demo or
    experiment made it. Any other non-empty directory (a live store, a source tree) is refused."""
    data = Path(path).resolve()
    if data.is_dir() and any(data.iterdir()):
        if not (data / RUN_MARKER).is_file():
            raise ConfigError(section, "data_dir", f"{data} is not empty and was not made by a lightspan demo "
                              "or experiment, so it is not wiped", "pass --data-dir with a new or empty directory")
        shutil.rmtree(data)
    (data / "logs").mkdir(parents=True)
    (data / RUN_MARKER).write_text("made by a lightspan demo or experiment; wiped by the next one\n")
    return data


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lightspan(*args: str) -> list[str]:
    """The command line of a ``lightspan`` job run with this interpreter."""
    return [sys.executable, "-m", "lightspan.cli", *args]


def run_json(cmd: list[str]) -> dict:
    """Run a job that prints one JSON line last (``rollout``, ``transitions build``); that line."""
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


class Stages:
    """Wall time per stage, summed over the run."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def time(self, name: str, fn, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self.add(name, time.monotonic() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    """Wait until ``url`` answers 2xx; fail early, with the log's tail, if ``proc`` exits first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{log_path.stem} exited ({proc.returncode}); "
                               f"see {log_path}:\n" + "\n".join(log_path.read_text(errors='replace').splitlines()[-20:]))
        try:
            if requests.get(url, timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not come up in {timeout_s} s; see {log_path}")


def spawner(stack: ExitStack, logs: Path, env: dict, stages: Stages, procs: dict | None = None):
    """``spawn(name, cmd, health=URL, timeout_s=…)``: start a process logging to ``logs/NAME.log``,
    stopped when ``stack`` closes; with ``health``, wait (timed as a stage) until the URL answers.
    Each process started is also put in ``procs`` under its name."""
    def spawn(name: str, cmd: list[str], health: str | None = None, timeout_s: float = 0,
              proc_env: dict | None = None) -> subprocess.Popen:
        log_path = logs / f"{name}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=proc_env or env,
                                    start_new_session=True)
        stack.callback(inference.stop, proc)
        if procs is not None:
            procs[name] = proc
        if health:
            stages.time(f"start {name}", wait_http, health, proc, timeout_s, log_path)
        return proc

    return spawn


def query_one(data_dir: Path, sql: str, params: list | None = None) -> tuple:
    """One row of ``sql`` over the store's views in ``data_dir`` (a fresh connection, closed after)."""
    def query():
        con = store.connect(data_dir)
        try:
            return con.execute(sql, params or []).fetchone()
        finally:
            con.close()

    return store.retry_vanished(query)


def policy_version(data_dir: Path) -> int:
    return store.policy.served_version(data_dir)


def _check_trainer(trainer: subprocess.Popen, data: Path, t0: float, timeout_s: float, waiting_for: str) -> None:
    if trainer.poll() is not None:
        raise RuntimeError(f"the trainer exited ({trainer.returncode}); see {data / 'logs' / 'trainer.log'}")
    if time.monotonic() - t0 > timeout_s:
        raise TimeoutError(f"the trainer did not {waiting_for} in {timeout_s:.0f} s; "
                           f"see {data / 'logs' / 'trainer.log'}")


def wait_published(data: Path, trainer: subprocess.Popen, timeout_s: float) -> None:
    """Wait until the trainer has published a policy (policy.json): with LoRA, the adapter agents call."""
    t0 = time.monotonic()
    while store.policy.read(data) is None:
        _check_trainer(trainer, data, t0, timeout_s, "publish its first policy")
        time.sleep(0.25)


class TrainerQueue:
    """The steps handed to a continuous trainer (``lightspan train --mode continuous --batch-size 0``)
    that it has not trained yet.

    A step is trained once the trainer's ``train_steps`` rows account for its transitions: the
    trainer takes them oldest first, so step k is trained when the transitions trained (or skipped
    as stale) add up to those of steps 1..k. Counting transitions rather than versions stays right
    when one trainer step takes two steps' transitions at once. ``train_steps`` is read only when
    policy.json shows a new version (the row follows the publication), so waiting costs no queries.
    """

    def __init__(self, data: Path, trainer: subprocess.Popen, timeout_s: float = 900.0):
        self.data, self.trainer, self.timeout_s = data, trainer, timeout_s
        self.pending: list[int] = []        # per untrained step: the trainable transitions up to it
        self.submitted = 0
        self._rows, self._consumed, self._version = 0, 0, -1

    def submit(self, trainable: int) -> None:
        """A step's transitions are in the store: ``trainable`` of them have a nonzero advantage."""
        if trainable:
            self.submitted += trainable
            self.pending.append(self.submitted)

    def untrained(self) -> int:
        version = policy_version(self.data)
        if version != self._version or self._rows < version:
            rows, consumed = query_one(self.data, """
                SELECT count(*), coalesce(sum(num_transitions + coalesce(skipped_stale, 0)), 0) FROM train_steps""")
            self._version, self._rows, self._consumed = version, int(rows), int(consumed)
        self.pending = [n for n in self.pending if n > self._consumed]
        return len(self.pending)

    def wait(self, at_most: int) -> None:
        """Wait until at most ``at_most`` submitted steps are untrained."""
        t0 = time.monotonic()
        while self.untrained() > at_most:
            _check_trainer(self.trainer, self.data, t0, self.timeout_s, f"train down to {at_most} pending steps")
            time.sleep(0.25)


class CpuClock:
    """CPU seconds (user + system) used by this process and all its descendants since it was made,
    running or finished, less what was ``exclude``-d (validation: a CPU budget buys training).
    ``procs`` (name: process, filled as the run starts its services) splits the count by part."""

    def __init__(self, procs: dict[str, subprocess.Popen] | None = None):
        self.excluded = 0.0
        self.procs = {} if procs is None else procs
        self.start = tree_cpu_seconds()

    def seconds(self) -> float:
        return tree_cpu_seconds() - self.start - self.excluded

    def exclude(self, seconds: float) -> None:
        self.excluded += seconds

    def parts(self) -> dict[str, float]:
        """CPU seconds since the clock was made, nothing excluded, per live process in ``procs`` (with
        its descendants) and ``rest``: this process and everything else it ran (the one-shot jobs:
        rollouts and their agents, transition builds; a service that already exited)."""
        children, times = _proc_table()
        tick = os.sysconf("SC_CLK_TCK")
        out = {name: (times.get(p.pid, 0) + _descendant_ticks(children, times, p.pid)) / tick
               for name, p in self.procs.items() if p.poll() is None}
        out["rest"] = _own_tree_seconds(children, times) - self.start - sum(out.values())
        return out


def _proc_table() -> tuple[dict[int, list[int]], dict[int, int]]:
    """Every process's children, and its CPU ticks (its own and its reaped children's), from ``/proc``."""
    parents, times = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = sum(int(f) for f in fields[11:15])      # utime stime cutime cstime
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    return children, times


def _descendant_ticks(children: dict[int, list[int]], times: dict[int, int], root: int) -> int:
    ticks, todo = 0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        ticks += times.get(pid, 0)
        todo += children.get(pid, [])
    return ticks


def _own_tree_seconds(children: dict[int, list[int]], times: dict[int, int]) -> float:
    """This process's CPU seconds, its reaped children's (``getrusage``) and its live descendants'."""
    import resource

    total = _descendant_ticks(children, times, os.getpid()) / os.sysconf("SC_CLK_TCK")
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def tree_cpu_seconds(root: int | None = None) -> float:
    """CPU seconds of ``root`` (default: this process) and its descendants: its own and its reaped
    children's (``getrusage``, for this process), plus each live descendant's own and reaped
    children's from ``/proc`` (each process counted once: by itself while alive, by its parent once reaped)."""
    children, times = _proc_table()
    if root is None or root == os.getpid():
        return _own_tree_seconds(children, times)
    return (times.get(root, 0) + _descendant_ticks(children, times, root)) / os.sysconf("SC_CLK_TCK")


def trainer_stats(data: Path) -> dict:
    row = query_one(data, """
        SELECT count(*), sum(step_seconds), sum(sync_seconds), max(sync_max_abs_logprob_diff),
               arg_min(entropy, policy_version), arg_max(entropy, policy_version)
        FROM train_steps""")
    return {"steps": row[0], "step_seconds": row[1] or 0.0, "sync_seconds": row[2] or 0.0,
            "max_logprob_diff": row[3], "entropy_first": row[4], "entropy_last": row[5]}


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports. Each socket stays bound until all are picked: a socket
    bound to port 0 and closed can hand the next one the same port."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
