"""``lightspan rollout``: run an unchanged agent command once per task sample, traced.

Each rollout is one process started under ``opentelemetry-instrument`` with the resource
attributes ``lightspan.rollout.id``, ``lightspan.task.id`` and ``lightspan.split`` set through
``OTEL_RESOURCE_ATTRIBUTES``, so every span it exports is grouped with no code change. The task
itself reaches the agent as JSON in ``LIGHTSPAN_TASK`` (and as the variables ``env_map`` names).
After the process ends, the runner exports one ``lightspan.runner`` span per rollout with its
outcome (``ok``, ``failed``, ``timeout``, ``infra``) and how the process ended (``exit`` with its code,
``timeout``, ``signal`` N: :data:`semconv.ROLLOUT_END`): the rollout's explicit end for the
transition builder.

Nothing an agent did is lost however its process ends: each rollout gets its own span spool
(``LIGHTSPAN_SPOOL``), to which lightspan's instrumentor appends every span as it ends
(tracing/spool.py), and the runner ships it to the collector with its own exporter, as it runs and
once the process is gone (rollout/spool.py). The collector's acknowledgement is the receipt: spans
not acknowledged are counted as lost per rollout (summary, runner span, the ``rollouts`` view) and
``lightspan rollout`` exits non-zero. Before any rollout runs, the OTLP endpoint is sent an empty
export in the agents' protocol, and one that speaks the other protocol is refused with the fix
(rollout/endpoint.py).

By default (``mode`` worker) the rollouts are forked from one warm interpreter (this
environment's, as below) instead of started from nothing, with the same environment, spans, logs
and outcomes (rollout/worker.py).

Each agent process counts its LLM calls by capture outcome (the instrumentor writes them to
``LIGHTSPAN_CAPTURE_REPORT``, one file per rollout beside its log); the summary adds them up, and a
call that could not be captured is flagged there with the reason and the fix (:func:`capture_summary`).

Timeouts kill the agent's whole process group. Retries are for infrastructure failures only
(the command could not start, died by a signal the runner did not send, or exited 75, sysexits'
EX_TEMPFAIL, saying a service it needs is down: :data:`outcomes.INFRA_EXIT_CODE`); any other
non-zero exit is a failed rollout, never retried: retrying would bias the sampled group. An
infrastructure failure is recorded as ``infra`` and is never trained on, nor counted against the
policy (the ``rollouts`` view's status ``infra``; the transition builder drops it as ``infra``).

The agent runs with this environment's interpreter: a command that starts with a bare ``python``
(``python3``, ``python3.11``) runs ``sys.executable``, and for every command but an interpreter
given by its path, this virtual environment's ``bin`` comes first on the agent's ``PATH`` (as if it
were activated): an agent started through a shell, ``env`` or a wrapper script (``sh -c "exec
python -m lightspan.rollout.agent_class M.C"``) and the processes an agent starts by the name
``python`` (an MCP server, a tool) get lightspan's interpreter and packages, instrumented. An
interpreter given by its path (``/other/venv/bin/python agent.py``) runs as given, with its own
virtual environment's ``bin`` first on ``PATH``.

Agent Lightning's agents run unchanged: each gets ``AGL_OPENAI_BASE_URL`` (= ``OPENAI_BASE_URL``),
``AGL_KEY`` (= ``OPENAI_API_KEY``) and ``AGL_EVENT_URL``, the collector API's
``/v1/rollouts/ID/events``, which stores their reward events as the rollout's rewards; their
``env_map`` (``QUESTION=input.question``) is ``env_map`` here. Agent classes without a
``__main__`` run through ``python -m lightspan.rollout.agent_class MODULE.CLASS``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import quote

from lightspan import store
from lightspan.core.config import ConfigError, option
from lightspan.store.layout import DATA_DIR_ENV, DEFAULT_DATA_DIR, ROLLOUT_LOGS_DIR
from lightspan.core.progress import progress
from lightspan.rollout import endpoint
from lightspan.rollout.outcomes import (Outcome, capture_summary, delivery_summary, exit_outcome, read_report,
                                       record_outcome)
from lightspan.rollout.spool import Shipper
from lightspan.rollout.worker import Worker, start_worker, worker_failure
from lightspan.tracing import semconv

log = logging.getLogger(__name__)
CAPTURE_REPORT_ENV = "LIGHTSPAN_CAPTURE_REPORT"   # tracing/report.py


@dataclass(frozen=True)
class RolloutConfig:
    tasks: str = option("", "JSONL file, one task per line; each task needs an \"id\" (or \"task_id\").")
    samples: int = option(4, "Rollouts per task (the GRPO group size).")
    concurrency: int = option(4, "Agent processes running at once.")
    split: str = option("train", "Value of lightspan.split on every rollout: train or val.", choices=("train", "val"))
    timeout_s: float = option(120.0, "Wall-clock limit per rollout; the whole process group is killed.")
    retries: int = option(1, "Extra attempts after an infrastructure failure (never after an agent error).")
    export_timeout_s: float = option(
        10.0, "How long the runner's own exporter tries to deliver a rollout's spans (its spool) to the collector "
              "once the rollout ended; spans still unacknowledged then are counted as lost.")
    otlp_endpoint: str = option(
        "http://127.0.0.1:4318", "Collector endpoint the agents (and the runner) export spans to: the OTLP/HTTP base "
                                 "URL (traces go to its /v1/traces), or with otlp_protocol grpc the OTLP/gRPC endpoint.")
    otlp_protocol: str = option(
        "http/protobuf", "OTLP protocol of the agents' exporter. http/protobuf needs nothing beyond lightspan's agent "
                         "side; grpc needs opentelemetry-exporter-otlp-proto-grpc (and grpcio) in the agent's "
                         "environment.", choices=("http/protobuf", "grpc"))
    openai_base_url: str = option("http://127.0.0.1:8000/v1", "OPENAI_BASE_URL given to the agents; token ids are captured there.")
    gateway_url: str = option(
        "", "A lightspan gateway (http://HOST:PORT) in front of openai_base_url's server: agents then get "
            "OPENAI_BASE_URL=GATEWAY/rollouts/ID/tasks/TASK/splits/SPLIT/v1, so a non-Python agent's calls are "
            "captured and grouped by the gateway, and the in-process instrumentor stands aside (no double capture).")
    data_dir: str = option(DEFAULT_DATA_DIR, "Data directory (its policy.json gives the served policy version).",
                           env=DATA_DIR_ENV)
    service_name: str = option("agent", "OTEL_SERVICE_NAME of the agents unless the environment sets one.")
    logs_dir: str = option("", "Where each rollout's stdout/stderr goes (default: DATA_DIR/rollout-logs).")
    mode: str = option(
        "worker", "'worker': a warm interpreter (the agent's own Python, with the instrumentation and the "
                  "agent's imports loaded once) forks each rollout, which runs the unchanged script as __main__ "
                  "with its own environment, resource attributes, log, exit code and timeout "
                  "(rollout/worker.py); commands other than `python script.py` / `python -m mod` run in process "
                  "mode. 'process': each rollout is a fresh `opentelemetry-instrument` process, for agents "
                  "whose libraries read per-rollout settings at import time. A bare `python` is lightspan's "
                  "interpreter, and lightspan's environment comes first on every agent's PATH (a shell, env or a "
                  "wrapper script that starts `python` gets it too); an interpreter given by its path runs with "
                  "its own environment first.", choices=("worker", "process"))
    collector_api_url: str = option(
        "http://127.0.0.1:8321", "The collector's API (its api_port): agents post reward events to "
                                 "AGL_EVENT_URL = COLLECTOR_API_URL/v1/rollouts/ID/events (Agent Lightning's agents).")
    env_map: tuple[str, ...] = option(
        (), "Task fields given to the agent as variables, as Agent Lightning's env_map: NAME=input.FIELD "
            "(nested: input.a.b; the whole task: input; any other value is given as it is), comma-separated, "
            "e.g. QUESTION=input.question,RESULT=input.result.")

    def __post_init__(self):
        if not self.tasks or not Path(self.tasks).is_file():
            raise ConfigError("rollout", "tasks", f"task file {self.tasks!r} not found", "pass --tasks FILE.jsonl")
        for name in ("samples", "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError("rollout", name, "must be at least 1", f"pass --{name} 1 or more")
        for name in ("timeout_s", "export_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError("rollout", name, "must be positive", f"pass --{name.replace('_', '-')} SECONDS")
        if not self.logs_dir and store.Location(self.data_dir).local(ROLLOUT_LOGS_DIR) is None:
            raise ConfigError("rollout", "logs_dir", f"data_dir {self.data_dir!r} is a bucket; each rollout's "
                              "output is written to a local directory", "pass --logs-dir DIR")
        for item in self.env_map:
            name, sep, _ = item.partition("=")
            if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name.strip()):
                raise ConfigError("rollout", "env_map", f"{item!r} is not NAME=VALUE with a variable name",
                                  "pass NAME=input.FIELD pairs, comma-separated")

    @property
    def variables(self) -> dict[str, str]:
        """``env_map`` as {variable: task path or literal}."""
        return {name.strip(): path.strip() for name, _, path in (item.partition("=") for item in self.env_map)}


def task_variables(task: dict, env_map: dict[str, str]) -> dict[str, str]:
    """The variables ``env_map`` makes of one task, as Agent Lightning's local runner does:
    ``input`` is the task, ``input.a.b`` a field in it (list items by index), any other value
    is itself; a value that is not a string is given as JSON. Raises KeyError for a missing field."""
    out = {}
    for name, path in env_map.items():
        value = path
        if path == "input" or path.startswith("input."):
            value = task
            for part in path.split(".")[1:]:
                if isinstance(value, dict) and part in value:
                    value = value[part]
                elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                    value = value[int(part)]
                else:
                    raise KeyError(f"{name}={path}: the task has no {part!r}")
        out[name] = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return out


def load_tasks(path: str | os.PathLike, env_map: dict[str, str] | None = None) -> list[dict]:
    """The tasks of a JSONL file; with ``env_map``, each is checked to have the fields it names."""
    tasks = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError("rollout", "tasks", f"{path}:{n} is not JSON ({e.msg})", "one JSON object per line") from None
        task_id = task.get("id", task.get("task_id")) if isinstance(task, dict) else None
        if task_id is None:
            raise ConfigError("rollout", "tasks", f"{path}:{n} has no \"id\"", "give every task an \"id\" field")
        tasks.append({**task, "id": str(task_id)})
        try:
            task_variables(task, env_map or {})
        except KeyError as e:
            raise ConfigError("rollout", "env_map", f"{path}:{n}: {e.args[0]}",
                              "give every task that field, or fix --env-map") from None
    return tasks


def resource_attributes(existing: str, rollout_id: str, task_id: str, split: str) -> str:
    """``OTEL_RESOURCE_ATTRIBUTES`` with our keys (percent-encoded, W3C baggage style) appended."""
    ours = {semconv.ROLLOUT_ID: rollout_id, semconv.TASK_ID: task_id, semconv.SPLIT: split}
    kept = [kv for kv in existing.split(",") if kv.strip() and kv.split("=", 1)[0].strip() not in ours]
    return ",".join(kept + [f"{k}={quote(v, safe='')}" for k, v in ours.items()])


def rollout_env(cfg: RolloutConfig, task: dict, rollout_id: str, version: int | None,
                resource: str = "") -> dict[str, str]:
    """The variables one rollout's agent process gets (on top of its environment, or in a Job)."""
    base_url, capture = cfg.openai_base_url, cfg.openai_base_url
    if cfg.gateway_url:
        ids = "/".join(f"{k}/{quote(v, safe='')}" for k, v in
                       (("rollouts", rollout_id), ("tasks", task["id"]), ("splits", cfg.split)))
        base_url, capture = f"{cfg.gateway_url.rstrip('/')}/{ids}/v1", "none"
    env = {
        "OTEL_RESOURCE_ATTRIBUTES": resource_attributes(resource, rollout_id, task["id"], cfg.split),
        "OTEL_SERVICE_NAME": cfg.service_name,
        "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": traces_endpoint(cfg),
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": cfg.otlp_protocol,
        "OPENAI_BASE_URL": base_url,
        # the anthropic client adds /v1/messages to its base URL itself
        "ANTHROPIC_BASE_URL": base_url[:-3] if base_url.rstrip("/").endswith("/v1") else base_url,
        "LIGHTSPAN_CAPTURE_URLS": capture,
        "LIGHTSPAN_TASK": json.dumps(task), "LIGHTSPAN_ROLLOUT_ID": rollout_id,
        "OPENAI_API_KEY": "lightspan", "ANTHROPIC_API_KEY": "lightspan",
        # Agent Lightning's agents: its base URL, key and event URL (reward events -> rewards)
        "AGL_OPENAI_BASE_URL": base_url, "AGL_KEY": "lightspan",
        "AGL_EVENT_URL": f"{cfg.collector_api_url.rstrip('/')}/v1/rollouts/{quote(rollout_id, safe='')}/events",
        **task_variables(task, cfg.variables),
    }
    # several policies (policy.json names them): each call's version follows from the model name
    # it used, read here at the rollout's start; else the one version of the run
    versions = store.policy.served_versions(cfg.data_dir)
    if versions:
        env[semconv.POLICY_VERSIONS_ENV] = semconv.format_policy_versions(versions)
    elif version is not None:
        env["LIGHTSPAN_MODEL_VERSION"] = str(version)
    return env


def traces_endpoint(cfg: RolloutConfig) -> str:
    """Where spans go: OTLP/HTTP's signal URL (``.../v1/traces``; the ``_TRACES_ENDPOINT`` variable
    is used as it is, with no path added) or the gRPC endpoint."""
    base = cfg.otlp_endpoint.rstrip("/")
    if cfg.otlp_protocol == "grpc" or base.endswith("/v1/traces"):
        return base
    return base + "/v1/traces"


def agent_environment(cfg: RolloutConfig, task: dict, rollout_id: str, version: int | None) -> dict[str, str]:
    env = dict(os.environ)
    ours = rollout_env(cfg, task, rollout_id, version, env.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    if env.get("OPENAI_API_KEY"):   # the caller's key is the agent's key, Agent Lightning's too
        ours["AGL_KEY"] = env["OPENAI_API_KEY"]
    # the caller's own choice wins for these
    for key in ("OTEL_SERVICE_NAME", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AGL_KEY"):
        if env.get(key):
            ours.pop(key)
    env.update(ours)
    return env


_PYTHON = re.compile(r"python(3(\.\d+)?)?")


def activated_path(command: list[str], path: str) -> str:
    """``PATH`` for the agent: a virtual environment's ``bin`` first, as if it were activated: that of
    an interpreter given by its path, else this one's (a bare ``python``, a shell, ``env``, a wrapper
    script: whatever they start as ``python`` is lightspan's); unchanged outside a virtual environment."""
    if command and "/" in command[0] and _PYTHON.fullmatch(Path(command[0]).name):
        bin_dir = Path(command[0]).absolute().parent
        in_venv = (bin_dir.parent / "pyvenv.cfg").is_file()
    else:
        bin_dir, in_venv = Path(sys.executable).parent, sys.prefix != sys.base_prefix
    if not in_venv or path.split(os.pathsep)[0] == str(bin_dir):
        return path
    return os.pathsep.join([str(bin_dir), *filter(None, [path])])


def instrumented(command: list[str]) -> list[str]:
    """The agent command under the ``opentelemetry-instrument`` of this environment; a bare
    ``python`` is this environment's interpreter, not whichever is first on ``PATH``."""
    launcher = Path(sys.executable).parent / "opentelemetry-instrument"
    if command and _PYTHON.fullmatch(command[0]):
        command = [sys.executable, *command[1:]]
    return [str(launcher if launcher.exists() else "opentelemetry-instrument"), *command]


def run_one(cfg: RolloutConfig, command: list[str], task: dict, attempt: int, version, logs: Path,
            worker: Worker | None = None, shipper: Shipper | None = None) -> Outcome:
    rollout_id = f"{task['id']}-{uuid.uuid4().hex[:12]}"
    env = agent_environment(cfg, task, rollout_id, version)
    env["PATH"] = activated_path(command, env.get("PATH", ""))
    report = logs / f"{rollout_id}.capture.json"
    env[CAPTURE_REPORT_ENV] = str(report)
    if shipper is not None:   # every span the agent ends goes to its spool too; shipped as it runs and after
        env[semconv.SPOOL_ENV] = str((logs / f"{rollout_id}.spool").absolute())
        shipper.start(rollout_id, env[semconv.SPOOL_ENV],
                      {semconv.ROLLOUT_ID: rollout_id, semconv.TASK_ID: task["id"], semconv.SPLIT: cfg.split})
    o = _run_agent(cfg, command, env, task, rollout_id, attempt, logs, worker)
    o.capture = read_report(report)
    if shipper is not None:
        o.delivery = shipper.finish(rollout_id)
    return o


def _run_agent(cfg: RolloutConfig, command: list[str], env: dict, task: dict, rollout_id: str, attempt: int,
               logs: Path, worker: Worker | None) -> Outcome:
    start = time.time_ns()
    if worker is not None:  # forked from the warm zygote: the same environment, log and outcomes
        code, outcome = worker.run(env, logs / f"{rollout_id}.log", cfg.timeout_s)
        if outcome != "ok":
            worker_failure(rollout_id, task["id"], outcome, code, logs / f"{rollout_id}.log")
        return Outcome(rollout_id, task["id"], outcome, code, start, time.time_ns(), attempt)
    log_file = open(logs / f"{rollout_id}.log", "wb")
    try:
        proc = subprocess.Popen(instrumented(command), env=env,
                                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as e:
        log.warning("rollout %s could not start: %s", rollout_id, e)
        return Outcome(rollout_id, task["id"], "infra", None, start, time.time_ns(), attempt)
    finally:
        log_file.close()
    try:
        code = proc.wait(timeout=cfg.timeout_s)
        outcome = exit_outcome(code)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        outcome = "timeout"
    if outcome != "ok":
        tail = (logs / f"{rollout_id}.log").read_text(errors="replace").splitlines()[-5:]
        log.warning("rollout %s (task %s) %s, exit code %s: %s", rollout_id, task["id"], outcome, code,
                    " | ".join(tail))
    return Outcome(rollout_id, task["id"], outcome, code, start, time.time_ns(), attempt)


def run(cfg: RolloutConfig, command: list[str]) -> dict:
    """Run every task ``cfg.samples`` times; returns counts by outcome and the wall time."""
    _require(command)
    tasks = load_tasks(cfg.tasks, cfg.variables)      # a bad task is refused before anything starts
    with Runner(cfg, command) as runner:
        return runner.run(tasks)


def _require(command: list[str]) -> None:
    if not command:
        raise ConfigError("rollout", "command", "no agent command given", "append: -- python my_agent.py")


class Runner:
    """Batches of rollouts through one warm worker and one span shipper. ``lightspan rollout`` runs one
    batch; a loop that runs a batch per step (lightspan/experiment.py) keeps one Runner, so the zygote's
    warm-up and the runner's start are paid once rather than every step. The worker starts with the
    first batch, warmed up in the environment of a rollout of its first task; every rollout still gets
    its own environment, and a batch's policy version is read when the batch starts."""

    def __init__(self, cfg: RolloutConfig, command: list[str]):
        _require(command)
        self.cfg, self.command = cfg, command
        self.logs = Path(cfg.logs_dir) if cfg.logs_dir else store.Location(cfg.data_dir).local(ROLLOUT_LOGS_DIR)
        self.logs.mkdir(parents=True, exist_ok=True)
        endpoint.check(traces_endpoint(cfg), cfg.otlp_protocol)  # the wrong protocol is refused before any rollout
        self.shipper = Shipper(traces_endpoint(cfg), cfg.otlp_protocol, cfg.export_timeout_s)
        self.worker: Worker | None = None
        self._worker_tried = False

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            if self.worker is not None:
                self.worker.close()
        finally:
            self.shipper.close()

    def run(self, tasks: list[dict], *, split: str | None = None, samples: int | None = None) -> dict:
        """Each of ``tasks`` ``samples`` times (default: the config's), as ``split``; the summary."""
        cfg = replace(self.cfg, split=split or self.cfg.split, samples=samples or self.cfg.samples)
        version = store.policy.served_version(cfg.data_dir)
        t0 = time.monotonic()
        if cfg.mode == "worker" and tasks and not self._worker_tried:
            self._worker_tried = True
            warm = agent_environment(cfg, tasks[0], "warm-up", version)
            warm["PATH"] = activated_path(self.command, warm.get("PATH", ""))
            self.worker = start_worker(self.command, warm, self.logs / "worker.log")
        worker, shipper = self.worker, self.shipper

        def attempt_all(task):
            for attempt in range(cfg.retries + 1):
                o = run_one(cfg, self.command, task, attempt, version, self.logs, worker, shipper)
                record_outcome(shipper, cfg.split, o)
                if o.outcome != "infra":
                    return o
            return o

        jobs = [task for task in tasks for _ in range(cfg.samples)]
        done: dict[str, int] = {}
        lock = threading.Lock()

        def tracked(task, bar):
            o = attempt_all(task)
            with lock:
                done[o.outcome] = done.get(o.outcome, 0) + 1
                bar.update(" ".join(f"{k} {v}" for k, v in sorted(done.items())))
                bar.advance()
            return o

        with progress(f"rollouts ({cfg.split})", total=len(jobs)) as bar, ThreadPoolExecutor(cfg.concurrency) as pool:
            outcomes = list(pool.map(lambda task: tracked(task, bar), jobs))
        counts = {k: sum(o.outcome == k for o in outcomes) for k in ("ok", "failed", "timeout", "infra")}
        return {"rollouts": len(outcomes), **counts, "policy_version": version,
                "wall_seconds": round(time.monotonic() - t0, 2), "mode": "process" if worker is None else "worker",
                "capture": capture_summary(outcomes, bool(cfg.gateway_url)),
                "delivery": delivery_summary(outcomes, bool(cfg.gateway_url))}
