"""Worker mode of the rollout runner: the same stored spans, ids, rewards and outcomes as a process
per rollout, for a plain openai agent, a LangChain agent and agents that crash or hang.

Both modes run for real (``lightspan rollout --mode worker|process``, real ``opentelemetry-instrument``
instrumentations, the real collector, the session's real vLLM serving the tiny model); each mode's
task ids carry a prefix, and the stored spans of the two are compared task by task.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import requests

from lightspan.rollout.worker import python_target
from lightspan.rollout.zygote import learnable, top_level_imports
from tests.conftest import collector_process

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ROOT / "tests" / "agents"
VERSION = 3                            # the served policy version every call must record


# --- no server ------------------------------------------------------------------------------------

def test_only_python_script_and_module_commands_are_forked(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text("print(1)\n")
    assert python_target([sys.executable, str(script), "--x"]) == {
        "python": sys.executable, "script": str(script), "argv": ["--x"]}
    assert python_target(["python3", "-m", "pkg.agent", "a"])["module"] == "pkg.agent"
    assert python_target([sys.executable, "-u", str(script)]) is None      # interpreter flags: a process
    assert python_target([sys.executable, "-c", "print(1)"]) is None
    assert python_target(["node", "agent.js"]) is None
    assert python_target(["sh", "-c", f"python {script}"]) is None
    assert python_target([sys.executable, str(tmp_path / "missing.py")]) is None


def test_the_agents_imports_are_found_through_its_local_modules(tmp_path):
    (tmp_path / "helpers.py").write_text("import sqlite3\nfrom email import message\n")
    (tmp_path / "agent.py").write_text(
        "import json, helpers\ntry:\n    import tomllib\nexcept ImportError:\n    tomllib = None\n"
        "from urllib.parse import quote\nif True:\n    import csv\n"
        "def main():\n    import zipfile\n")
    names = top_level_imports(tmp_path / "agent.py", tmp_path)
    assert {"json", "sqlite3", "email", "email.message", "tomllib", "urllib.parse", "urllib.parse.quote",
            "csv"} <= set(names)
    assert "helpers" not in names and "zipfile" not in names   # local modules run per rollout; lazy ones too


def test_what_a_rollout_imported_is_learned_but_not_its_local_modules(tmp_path):
    (tmp_path / "localmod.py").write_text("X = 1\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); before = set(sys.modules); "
            "import localmod, wave; from lightspan.rollout.zygote import learnable; "
            f"print(' '.join(learnable(before, {str(tmp_path)!r})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert "wave" in out and "localmod" not in out
    assert learnable(set(sys.modules), str(tmp_path)) == []


def test_the_zygote_learns_what_rollouts_import_until_they_import_nothing_new(tmp_path):
    from lightspan.rollout.worker import Worker
    from lightspan.rollout.zygote import QUIET_CHILDREN

    # each rollout says which of two stdlib modules it started with, then imports the one its task names
    agent = tmp_path / "agent.py"
    agent.write_text("import os, sys\nprint(','.join(n for n in ('wave', 'tabnanny') if n in sys.modules))\n"
                     "__import__(os.environ['LAZY'])\n")
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
           "OTEL_LOGS_EXPORTER": "none"}
    worker = Worker([sys.executable, str(agent)], env, tmp_path / "zygote.log", start_timeout_s=120)
    try:
        def started_with(lazy: str, i: int) -> str:
            log = tmp_path / f"rollout-{i}.log"
            assert worker.run({**env, "LAZY": lazy}, log, 60) == (0, "ok"), log.read_text()
            return log.read_text().strip()

        assert started_with("wave", 0) == ""              # imported lazily by a rollout: learnt
        quiet = [started_with("json", i) for i in range(1, QUIET_CHILDREN + 1)]
        assert quiet == ["wave"] * QUIET_CHILDREN          # the next ones start with it, and import nothing new
        assert started_with("tabnanny", QUIET_CHILDREN + 1) == "wave"
        # after QUIET_CHILDREN rollouts in a row that imported nothing new, the zygote asks no more
        assert started_with("json", QUIET_CHILDREN + 2) == "wave"
    finally:
        worker.close()


# --- real collector, real vLLM --------------------------------------------------------------------

@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    from lightspan import store

    data = tmp_path_factory.mktemp("worker-data")
    store.policy.write(data, VERSION, data)
    with collector_process(data, data / "collector.log") as running:
        yield running


def rollout(collector, vllm_server, tmp_path, mode: str, agent: Path, tasks: list[dict], **options) -> dict:
    data, ports = collector
    path = tmp_path / f"tasks-{mode}.jsonl"
    path.write_text("".join(json.dumps({**t, "id": f"{mode}:{t['id']}"}) + "\n" for t in tasks))
    args = {"samples": 2, "concurrency": 2, "timeout_s": 120, **options}
    out = subprocess.run(
        [sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(path), "--mode", mode,
         "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}", "--openai-base-url", f"{vllm_server.url}/v1",
         "--data-dir", str(data), "--logs-dir", str(tmp_path / f"logs-{mode}"),
         *[a for k, v in args.items() for a in (f"--{k.replace('_', '-')}", str(v))], "--", sys.executable, str(agent)],
        check=True, text=True, stdout=subprocess.PIPE).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["mode"] == mode, result           # worker mode was not silently given up
    requests.post(f"http://127.0.0.1:{ports['api']}/v1/flush", timeout=60).raise_for_status()
    return result


def stored(collector, mode: str, task_ids: list[str]) -> dict[str, list[tuple]]:
    """Per task (its mode prefix dropped): one sorted description per rollout of what the store holds."""
    from lightspan import store

    data, _ = collector
    con = store.connect(data)
    rows = con.execute("""
        SELECT rollout_id, task_id, split, name, service_name, resource_attributes, model_version,
               prompt_token_ids, len(completion_token_ids), len(completion_logprobs), capture_status,
               reward, attributes
        FROM spans WHERE list_contains(?, task_id)""", [[f"{mode}:{t}" for t in task_ids]]).fetchall()
    by_rollout: dict[str, list] = {}
    instances: dict[str, set] = {}
    for rid, task, split, name, service, resource, version, prompt, n_ids, n_lp, status, reward, attrs in rows:
        resource, attrs = dict(resource or {}), dict(attrs or {})
        if name != "lightspan.runner":
            # the agent's spans have the rollout's ids from their resource (the collector promotes them to
            # columns), as in a process of its own: no span attribute carries them
            assert rid and "lightspan.rollout.id" not in attrs and service == "agent", (name, attrs)
            instances.setdefault(rid, set()).add(resource["service.instance.id"])
        described = (name, split, version, tuple(prompt) if prompt is not None else None,
                     n_ids is not None and n_ids > 0 and n_ids == n_lp, status, reward,
                     json.loads(attrs["lightspan.rollout.outcome"]) if "lightspan.rollout.outcome" in attrs else None)
        by_rollout.setdefault(rid, []).append(described)
    # one resource per rollout: its spans share one service instance, no two rollouts share one
    assert all(len(ids) == 1 for ids in instances.values()), instances
    assert len(set.union(set(), *instances.values())) == len(instances)
    out: dict[str, list[tuple]] = {}
    task_of = {rid: task for rid, task, *_ in rows}
    for rid, spans in by_rollout.items():
        assert rid.startswith(task_of[rid] + "-"), rid      # the runner's rollout id, not a trace id
        out.setdefault(task_of[rid].split(":", 1)[1], []).append(tuple(sorted(spans, key=repr)))
    return {task: sorted(shapes, key=repr) for task, shapes in out.items()}


def compare_modes(collector, vllm_server, tmp_path, agent: Path, tasks: list[dict], **options):
    results = {mode: rollout(collector, vllm_server, tmp_path, mode, agent, tasks, **options)
               for mode in ("worker", "process")}
    spans = {mode: stored(collector, mode, [t["id"] for t in tasks]) for mode in results}
    assert spans["worker"] == spans["process"]
    assert sorted(spans["worker"]) == sorted(t["id"] for t in tasks)
    assert {k: results["worker"][k] for k in ("rollouts", "ok", "failed", "timeout", "infra")} == \
        {k: results["process"][k] for k in ("rollouts", "ok", "failed", "timeout", "infra")}
    # each forked rollout writes its own capture report, as a process of its own does
    assert results["worker"]["capture"] == results["process"]["capture"]
    return results, spans["worker"]


@pytest.mark.e2e
def test_a_plain_openai_agent_stores_the_same_spans_in_both_modes(collector, vllm_server, tiny_model, tmp_path):
    from lightspan.trainer.sync import ReloadSync

    ReloadSync(vllm_server.url).push(str(tiny_model), 0)     # other tests may have left other weights
    tasks = [{"id": f"add-{a}", "question": f"What is {a} + 1?", "answer": a + 1, "temperature": 0.0,
              "max_tokens": 8} for a in (2, 3, 4)]
    results, spans = compare_modes(collector, vllm_server, tmp_path, ROOT / "lightspan" / "agents" / "math_agent.py",
                                   tasks)
    assert results["worker"]["ok"] == 6
    assert results["worker"]["capture"]["calls"] == results["worker"]["capture"]["captured"] == 6
    assert results["worker"]["capture"]["rollouts_without_report"] == 0
    for shapes in spans.values():
        assert len(shapes) == 2                               # two rollouts per task, each its own id
        for shape in shapes:
            names = Counter(s[0] for s in shape)
            assert names == {"openai.chat": 1, "lightspan.reward": 1, "lightspan.runner": 1}, names
            llm = next(s for s in shape if s[0] == "openai.chat")
            assert llm[2] == VERSION and llm[3] and llm[4] and llm[5] == "ok"   # version, ids, logprobs


@pytest.mark.e2e
def test_a_langchain_agent_stores_the_same_spans_in_both_modes(collector, vllm_server, tiny_model, tmp_path):
    pytest.importorskip("langchain_openai", reason="pip install 'lightspan[frameworks]'")
    tasks = [{"id": "lc-1", "prompt": "What is 2 + 3?", "answer": "5", "temperature": 0.0, "max_tokens": 6}]
    results, spans = compare_modes(collector, vllm_server, tmp_path,
                                   ROOT / "examples" / "frameworks" / "langchain_agent.py", tasks)
    assert results["worker"]["ok"] == 2
    for shape in spans["lc-1"]:
        captured = [s for s in shape if s[4]]
        assert len(captured) == 4 and all(s[2] == VERSION for s in captured)   # the agent's four calls


@pytest.mark.e2e
def test_a_crash_or_a_hang_ends_only_its_own_rollout(collector, vllm_server, tiny_model, tmp_path):
    tasks = [{"id": "hang", "behaviour": "hang"}, {"id": "crash", "behaviour": "crash"},
             {"id": "ok", "behaviour": "ok"}, {"id": "ok2", "behaviour": "ok"}]
    tasks = [{**t, "prompt": "Hi", "pid_file": str(tmp_path / f"{t['id']}.pid")} for t in tasks]
    t0 = time.monotonic()
    results, spans = compare_modes(collector, vllm_server, tmp_path, AGENTS / "moody_agent.py", tasks,
                                   samples=1, timeout_s=45)
    assert {k: results["worker"][k] for k in ("ok", "failed", "timeout", "infra")} == \
        {"ok": 2, "failed": 1, "timeout": 1, "infra": 0}
    outcome = {task: {s[7] for s in shapes[0] if s[0] == "lightspan.runner"} for task, shapes in spans.items()}
    assert outcome == {"hang": {"timeout"}, "crash": {"failed"}, "ok": {"ok"}, "ok2": {"ok"}}
    for task in ("ok", "ok2"):
        assert [s[6] for s in spans[task][0] if s[0] == "lightspan.reward"] == [1.0]
    # the hung rollout was killed with its process group; the others ran beside it meanwhile
    pid = int((tmp_path / "hang.pid").read_text())
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "zombie" in status.read_text().lower()
    assert results["worker"]["wall_seconds"] < 80 and time.monotonic() - t0 < 400
