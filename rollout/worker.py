"""Worker mode of ``lightspan rollout``: rollouts without the interpreter's start-up cost.

A rollout in process mode is two interpreters started from nothing (``opentelemetry-instrument``'s
launcher, then ``python agent.py`` importing OpenTelemetry, the instrumentations and the agent's
libraries): most of its CPU time. In worker mode one warm parent, the zygote (``rollout/zygote.py``,
run by the agent's own interpreter), pays for that once and forks a child per rollout that runs
the agent's script unchanged as ``__main__``. Each child is a process of its own, as in process
mode: its own environment (the task, the policy version), its own tracer provider whose resource
carries the rollout's ids (configured from that environment as ``opentelemetry-instrument`` does),
its own stdout/stderr log, exit status, process group and timeout; a crash or a hang ends only
that rollout, and nothing it changes in memory reaches the next one.

What differs from a process of its own, and when to use ``--mode process`` instead:
1. the agent's top-level imports (and those of the local modules it imports) run once, in the
   zygote: a library that reads per-rollout environment variables *at import time* sees the
   zygote's (the runner's environment, no task); libraries read them when called, as openai does;
2. the children share the zygote's hash seed (``PYTHONHASHSEED``); random generators are reseeded
   (``random`` by the interpreter at fork, numpy's by the zygote);
3. only ``python script.py ARGS`` and ``python -m module ARGS`` commands can be forked; any other
   command (a shell, another language, interpreter flags) runs in process mode, said once in the log;
4. if warming up starts a thread or sets a tracer provider (a library doing so at import), forking
   would be unsafe or would give every rollout the zygote's resource: the run falls back to process
   mode, with a warning naming the cause.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from lightspan.rollout.outcomes import exit_outcome

log = logging.getLogger(__name__)

ZYGOTE = Path(__file__).resolve().with_name("zygote.py")
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?$")
_AUTO_DIR = os.path.join("opentelemetry", "instrumentation", "auto_instrumentation")


class WorkerError(RuntimeError):
    """The zygote could not start, or cannot fork rollouts safely (the message says why)."""


def python_target(command: list[str], path: str | None = None) -> dict | None:
    """``{"python", "script" | "module", "argv"}`` for ``python script.py ARGS`` or ``python -m MOD
    ARGS``; None for any other command (it runs in process mode)."""
    if len(command) < 2 or not _PYTHON.fullmatch(Path(command[0]).name):
        return None
    # a bare `python` is this environment's interpreter, as in process mode (rollout/runner.py)
    python = sys.executable if "/" not in command[0] else shutil.which(command[0], path=path)
    if python is None:
        return None
    if command[1] == "-m" and len(command) > 2:
        return {"python": python, "module": command[2], "argv": command[3:]}
    if command[1].startswith("-") or not Path(command[1]).is_file():
        return None
    return {"python": python, "script": command[1], "argv": command[2:]}


@dataclass
class _Slot:
    """One rollout in flight: its pid once forked, its return code once reaped."""
    done: threading.Event = field(default_factory=threading.Event)
    pid: int | None = None
    code: int | None = None


class _Zygote:
    """One zygote process, its request pipe and the reader of its events."""

    def __init__(self, python: str, spec: dict, env: dict, log_path: Path, start_timeout_s: float):
        req_r, req_w = os.pipe()      # runner -> zygote
        ev_r, ev_w = os.pipe()        # zygote -> runner
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen([python, str(ZYGOTE), str(req_r), str(ev_w), json.dumps(spec)],
                                         pass_fds=(req_r, ev_w), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        os.close(req_r)
        os.close(ev_w)
        self.log_path = log_path
        self.unsafe: str | None = None            # why it may fork no more (set from its events)
        self._lock = threading.Lock()             # the slots and the request pipe
        self._slots: dict[str, _Slot] = {}
        self._requests = os.fdopen(req_w, "w", buffering=1)
        events = os.fdopen(ev_r, "r")
        self.info = _read_ready(events, self.proc, start_timeout_s, log_path)
        threading.Thread(target=self._read, args=(events,), name="lightspan-worker-events", daemon=True).start()

    def usable(self) -> bool:
        return self.unsafe is None and self.proc.poll() is None

    def _read(self, events) -> None:
        for line in events:
            doc = json.loads(line)
            if doc["event"] == "unsafe":
                self.unsafe = doc["why"]
                continue
            with self._lock:
                slot = self._slots.get(doc.get("id"))
            if slot is None:
                continue
            if doc["event"] == "started":
                slot.pid = doc["pid"]
            elif doc["event"] == "exit":
                slot.code = doc["code"]
                slot.done.set()
        # EOF: the zygote is gone; its rollouts in flight are infrastructure failures (retried)
        self.proc.wait()
        with self._lock:
            orphans = [s for s in self._slots.values() if not s.done.is_set()]
        if orphans:
            log.warning("worker: the zygote exited (%s) with %d rollouts in flight; see %s", self.proc.returncode,
                        len(orphans), self.log_path)
        for slot in orphans:
            if slot.pid is not None:
                _kill_group(slot.pid)
            slot.done.set()

    def send(self, doc: dict) -> bool:
        with self._lock:
            if self.proc.poll() is not None:
                return False
            try:
                self._requests.write(json.dumps(doc) + "\n")
                return True
            except (BrokenPipeError, ValueError):
                return False

    def run(self, request: dict, timeout_s: float) -> tuple[int | None, str]:
        rid = request["id"]
        with self._lock:
            slot = self._slots[rid] = _Slot()
        try:
            if not self.send({"op": "run", **request}):
                return None, "infra"
            if slot.done.wait(timeout_s):
                code = slot.code
                if code is None:
                    return None, "infra"
                return code, exit_outcome(code)
            self.send({"op": "kill", "id": rid})
            if not slot.done.wait(30):     # the zygote reaps it and says so; should it not, kill here
                if slot.pid is not None:
                    _kill_group(slot.pid)
                return None, "timeout"
            return slot.code, "timeout"
        finally:
            with self._lock:
                self._slots.pop(rid, None)

    def idle(self) -> bool:
        with self._lock:
            return not self._slots

    def close(self) -> None:
        """EOF on its requests: it kills any rollout still running, then exits."""
        try:
            self._requests.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            _kill_group(self.proc.pid)
            self.proc.wait()


class Worker:
    """Zygotes of one agent command serving any number of concurrent rollouts: one at a time, a
    new one when it died or can no longer fork safely (the old one finishes its rollouts first)."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, start_timeout_s: float = 300.0):
        target = python_target(command, env.get("PATH"))
        if target is None:
            raise WorkerError(f"{command[:2]} is not `python script.py` or `python -m module`")
        self.target, self.log_path, self.start_timeout_s = target, Path(log_path), start_timeout_s
        self.env = {**env, "PYTHONPATH": _zygote_pythonpath(env.get("PYTHONPATH", ""))}
        self.spec = {k: target[k] for k in ("script", "module") if k in target}
        self._lock = threading.Lock()
        self._retired: list[_Zygote] = []
        self.current = self._start()
        self.info = self.current.info
        if self.info.get("failed"):
            log.info("worker: %d of the agent's imports failed to preload (its rollouts import them again): %s",
                     len(self.info["failed"]), "; ".join(self.info["failed"])[:500])

    def _start(self) -> _Zygote:
        zygote = _Zygote(self.target["python"], self.spec, self.env, self.log_path, self.start_timeout_s)
        if zygote.info.get("threads") or zygote.info.get("provider_set"):
            zygote.close()
            why = (f"its warm-up started threads {zygote.info['threads']}" if zygote.info.get("threads")
                   else "a library set a tracer provider at import")
            raise WorkerError(f"the agent's imports cannot be forked safely: {why}")
        return zygote

    def _zygote(self) -> _Zygote:
        with self._lock:
            if not self.current.usable():
                why = self.current.unsafe or f"it exited with {self.current.proc.returncode}"
                log.warning("worker: a new zygote replaces the old one (%s)", why)
                if self.current.unsafe:       # what a rollout imported made forking unsafe: learn no more
                    self.spec = {**self.spec, "learn": False}
                self._retired.append(self.current)
                self.current = self._start()
            for old in [z for z in self._retired if z.idle()]:
                old.close()
                self._retired.remove(old)
            return self.current

    def run(self, env: dict[str, str], log_path: Path, timeout_s: float) -> tuple[int | None, str]:
        """Run one rollout with ``env``, its output in ``log_path``; (return code, outcome) as the
        process mode has them: ``ok``, ``failed`` (non-zero exit), ``timeout`` (killed here) or
        ``infra`` (killed by a signal not sent here, exit status 75, or the zygote died)."""
        request = {"id": uuid.uuid4().hex, "env": env, "log": str(log_path), "argv": self.target["argv"],
                   "cwd": os.getcwd()}
        return self._zygote().run(request, timeout_s)

    def close(self) -> None:
        with self._lock:
            for zygote in [*self._retired, self.current]:
                zygote.close()
            self._retired = []


def _read_ready(events, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> dict:
    """The zygote's first line, ``ready``; a WorkerError with its log's tail if it dies or stalls."""
    box: list = []
    reader = threading.Thread(target=lambda: box.append(events.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    line = box[0] if box else ""
    if not line:
        if proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
        tail = " | ".join(log_path.read_text(errors="replace").splitlines()[-5:]) if log_path.exists() else ""
        raise WorkerError(f"the zygote did not start (exit code {proc.returncode}; {log_path}): {tail}")
    return json.loads(line)


def _zygote_pythonpath(pythonpath: str) -> str:
    """PYTHONPATH for the zygote: the working directory first, as ``opentelemetry-instrument`` adds
    it, and never its sitecustomize folder (which would configure the SDK at start-up)."""
    parts = [p for p in pythonpath.split(os.pathsep) if p and not p.rstrip("/").endswith(_AUTO_DIR)]
    cwd = os.getcwd()
    return os.pathsep.join([cwd, *[p for p in parts if p != cwd]])


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, 9)
        except (ProcessLookupError, PermissionError):
            pass


def start_worker(command: list[str], env: dict[str, str], log_path: Path) -> Worker | None:
    """A worker for ``command``, or None (process mode) when it cannot be forked, with the reason logged."""
    if python_target(command, env.get("PATH")) is None:
        log.info("worker mode: %s is not `python script.py` or `python -m module`: one process per rollout",
                 " ".join(command[:2]))
        return None
    try:
        return Worker(command, env, log_path)
    except WorkerError as e:
        log.warning("worker mode unavailable, one process per rollout instead: %s", e)
        return None


def worker_failure(rollout_id: str, task_id: str, outcome: str, code: int | None, log_path: Path) -> None:
    """Log a rollout that did not succeed with its log's last lines, as the process mode does."""
    tail = log_path.read_text(errors="replace").splitlines()[-5:] if log_path.exists() else []
    log.warning("rollout %s (task %s) %s, exit code %s: %s", rollout_id, task_id, outcome, code, " | ".join(tail))
