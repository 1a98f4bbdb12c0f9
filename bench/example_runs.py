"""bench/examples.py's running parts: the services an example's README starts by hand, a process
tree's CPU, the load sampled while a run goes, the run's store counts, and HEAD's committed files to
run from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from pathlib import Path

import psutil

from lightspan.runs import free_ports

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = Path.home() / ".cache" / "lightspan" / "models" / "smollm2-135m-instruct"


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    """Until url answers (a readiness poll of a service we started, not a timing assumption)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"service exited with {proc.returncode} before {url} answered")
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"{url} did not answer in {timeout_s:.0f} s")


def start_service(kind: str, seed: int, log: Path, tree: Path) -> tuple[subprocess.Popen, str, dict]:
    """The service the README starts by hand; returns it, the URL the run uses and the agent's env."""
    port = free_ports(1)[0]
    if kind == "retriever":
        argv = [sys.executable, "examples/search_r1/retriever.py", "--port", str(port)]
        url, ready = f"http://127.0.0.1:{port}/retrieve", f"http://127.0.0.1:{port}/healthz"
        env = {"SEARCH_R1_RETRIEVAL_URL": url}
    else:  # the sandbox README's own vLLM: one thread, 1 GiB of KV cache (memory stays bounded)
        argv = [sys.executable, "-m", "lightspan.cli", "vllm", "--model", str(MODEL_DIR), "--port", str(port),
                "--threads", "1", "--kv-cache-gib", "1", "--seed", str(seed)]
        url, ready, env = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/v1/models", {}
    proc = subprocess.Popen(argv, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(ready, proc)
    except RuntimeError:
        stop(proc)
        raise
    return proc, url, env


def tree_cpu_seconds(proc: subprocess.Popen) -> float:
    try:
        procs = [psutil.Process(proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


class LoadSampler(threading.Thread):
    """The 1-minute load average and MemAvailable every `every` seconds while a run goes."""

    def __init__(self, every: float = 30.0):
        super().__init__(daemon=True)
        self.every, self.samples, self.done = every, [], threading.Event()

    def run(self) -> None:
        while True:
            self.samples.append((round(os.getloadavg()[0], 2), psutil.virtual_memory().available // 2**20))
            if self.done.wait(self.every):
                return


STORE_QUERY = """SELECT coalesce(r.split, '?') AS split, count(DISTINCT c.rollout_key) AS rollouts,
    count(*) AS calls, sum(c.input_tokens)::BIGINT AS prompt_tokens, sum(c.output_tokens)::BIGINT AS completion_tokens
    FROM llm_calls c JOIN rollouts r USING (rollout_key) GROUP BY ALL ORDER BY ALL"""


def store_counts(data_dir: Path, tree: Path = ROOT) -> dict:
    out = subprocess.run([sys.executable, "-m", "lightspan.cli", "sql", "--data-dir", str(data_dir),
                          "--format", "json", STORE_QUERY], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-500:]}
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]  # JSON lines
    return {row.pop("split"): row for row in rows}


def committed_tree(data_root: Path) -> tuple[str, Path]:
    """HEAD's files (git archive), so a run uses committed code, not the shared tree's edits in progress."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    tree = data_root / f"tree-{commit}"
    if not tree.exists():
        tmp = data_root / f"tree-{commit}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        # lightspan.store etc. live in top-level folders (pyproject's package-dir); without these links the
        # editable install's finder would import them from the shared tree, not from this one
        package_dir = tomllib.loads((tmp / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
        for package, folder in package_dir.items():
            if package.startswith("lightspan.") and folder != package.replace(".", "/"):
                (tmp / package.replace(".", "/")).symlink_to(Path("..", *package.split(".")[2:]) / folder)
        tmp.rename(tree)
    return commit, tree
