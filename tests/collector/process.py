"""The real collector service as a subprocess (``python -m lightspan.cli collector``), for the
crash, overload and log tests: its ports come from its JSON start-up log line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests


class CollectorProcess:
    """``lightspan collector`` on ephemeral ports; stderr (JSON log lines) goes to ``log_path``."""

    def __init__(self, data_dir: Path, log_path: Path, env: dict | None = None, **options):
        # a bucket's s3:// URL stays a string (a Path would fold its "//")
        self.data_dir = data_dir if str(data_dir).startswith("s3://") else Path(data_dir)
        self.log_path = Path(log_path)
        args = {"grpc_port": 0, "http_port": 0, "api_port": 0, "log_format": "json", **options}
        self.argv = [sys.executable, "-m", "lightspan.cli", "collector", "--data-dir", str(self.data_dir)]
        for name, value in args.items():
            self.argv += ["--" + name.replace("_", "-"), str(value)]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}

    def spawn(self) -> "CollectorProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=log, env=self.env)
        self.ports = {}
        return self

    def start(self, timeout: float = 60.0) -> "CollectorProcess":
        """Spawn and wait until it logs its ports (the WAL has replayed) and /healthz answers."""
        self.spawn()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"collector exited with {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}")
            started = [r for r in self.records() if r.get("event") == "started" and r.get("pid") == self.proc.pid]
            if started:
                self.ports = {k: started[-1][k] for k in ("grpc_port", "http_port", "api_port")}
                try:
                    if requests.get(self.url("api", "/healthz"), timeout=2).status_code == 200:
                        return
                except requests.RequestException:
                    pass
            time.sleep(0.02)
        raise AssertionError(f"collector not ready after {timeout}s:\n{self.log_path.read_text()[-4000:]}")

    def records(self) -> list[dict]:
        """Every log line so far, parsed (the test fails on a line that is not a JSON object)."""
        if not self.log_path.exists():
            return []
        lines = self.log_path.read_text(errors="replace").splitlines()
        complete = lines if self.log_path.read_bytes().endswith(b"\n") else lines[:-1]
        return [json.loads(line) for line in complete if line.strip()]

    def url(self, port: str, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[port + '_port']}{path}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.ports['grpc_port']}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        """VmRSS of the process, from /proc."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line")

    def kill(self) -> None:
        """kill -9: no flush, no clean-up; only what is fsynced survives."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM: stop the receivers, flush to Parquet, exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
