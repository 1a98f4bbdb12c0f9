"""The processes and bookkeeping of one training run (``lightspan experiment`` and its presets).

A run owns a fresh data directory, starts its services (collector, vLLM, trainer) as child
processes that log to ``DATA_DIR/logs/NAME.log`` and are stopped when the run ends, calls the
``lightspan`` CLI for its one-shot jobs (rollouts, transitions) and reads its figures back from
the store with SQL. Wall time is summed per stage for the report.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import requests

from lightspan import inference, store
from lightspan.config import ConfigError

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


def spawner(stack: ExitStack, logs: Path, env: dict, stages: Stages):
    """``spawn(name, cmd, health=URL, timeout_s=…)``: start a process logging to ``logs/NAME.log``,
    stopped when ``stack`` closes; with ``health``, wait (timed as a stage) until the URL answers."""
    def spawn(name: str, cmd: list[str], health: str | None = None, timeout_s: float = 0,
              proc_env: dict | None = None) -> subprocess.Popen:
        log_path = logs / f"{name}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=proc_env or env,
                                    start_new_session=True)
        stack.callback(inference.stop, proc)
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


def wait_version(data: Path, version: int, timeout_s: float, trainer: subprocess.Popen) -> None:
    """Wait until the trainer has published policy ``version``; fail if it exits or takes too long."""
    t0 = time.monotonic()
    while policy_version(data) < version:
        if trainer.poll() is not None:
            raise RuntimeError(f"the trainer exited ({trainer.returncode}); see {data / 'logs' / 'trainer.log'}")
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"the trainer did not publish policy version {version} in {timeout_s} s; "
                               f"see {data / 'logs' / 'trainer.log'}")
        time.sleep(0.25)


def trainer_stats(data: Path) -> dict:
    row = query_one(data, """
        SELECT count(*), sum(step_seconds), sum(sync_seconds), max(sync_max_abs_logprob_diff)
        FROM train_steps""")
    return {"steps": row[0], "step_seconds": row[1] or 0.0, "sync_seconds": row[2] or 0.0,
            "max_logprob_diff": row[3]}
