"""Nothing an agent did is lost, and a lost export is never reported as success (issue 28, 1 and 2).

The span spool (tracing/spool.py, rollout/spool.py) read back exactly, a cut record skipped; then for
real (``lightspan rollout`` in both modes, real ``opentelemetry-instrument``, the real collector, a
stand-in for vLLM): an agent that makes two chat calls and then exits, raises, hangs past the
timeout or SIGKILLs itself has both calls stored, once, and its rollout marked with how it ended;
an endpoint of the other OTLP protocol is refused before any rollout runs; a collector that goes
away while rollouts run makes the run count its lost spans and exit non-zero.

The agents' own exporters hold their spans for 60 s here (``OTEL_BSP_SCHEDULE_DELAY``): the window
in which a death loses them (5 s by default) made longer than the test, so that what is stored after
a hang or a kill came through the spool.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import requests

from lightspan.rollout import spool as shipping
from lightspan.rollout.outcomes import Outcome
from lightspan.tracing import semconv
from lightspan.tracing import spool
from tests.attacks.conftest import Upstream
from tests.conftest import collector_process

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "tests" / "agents" / "dying_agent.py"
HOLD = {"OTEL_BSP_SCHEDULE_DELAY": "60000"}


# --- the spool file, no server ---------------------------------------------------------------------

def _spooled_provider(tmp_path, monkeypatch):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    path = tmp_path / "r.spool"
    monkeypatch.setenv(semconv.SPOOL_ENV, str(path))
    provider = TracerProvider(resource=Resource.create({"service.name": "agent", semconv.ROLLOUT_ID: "forged"}))
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    assert spool.attach(provider) is spool.attach(provider)      # once per provider
    return provider, memory, path


def test_the_spool_gives_back_every_span_as_ended_and_skips_a_cut_record(tmp_path, monkeypatch):
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.trace import Link, Status, StatusCode

    provider, memory, path = _spooled_provider(tmp_path, monkeypatch)
    tracer = provider.get_tracer("test.scope", "1.2")
    with tracer.start_as_current_span("root") as root:
        call = tracer.start_span("openai.chat", attributes={
            semconv.PROMPT_TOKEN_IDS: semconv.encode_ids([1, 2, 3]), semconv.COMPLETION_TOKEN_IDS: (b"\x07\0\0\0",),
            semconv.GEN_AI_OPERATION_NAME: "chat", "n": 3, "x": 0.5, "flag": True, "names": ("a", "b")},
            links=[Link(root.get_span_context(), {"why": "test"})])
        call.add_event("gen_ai.choice", {"index": 0})
        call.set_status(Status(StatusCode.ERROR, "boom"))
        call.end()
    ids = {semconv.ROLLOUT_ID: "t1-abc", semconv.TASK_ID: "t1", semconv.SPLIT: "train"}
    tail = shipping.Tail(str(path), ids)
    tail.read(final=True)
    assert (tail.delivery.spooled, tail.delivery.damaged) == (2, 0)
    expected = [s for s in memory.get_finished_spans()]
    got = tail.pending
    # the same OTLP request, but for the resource: the rollout's ids, whatever the agent's file says
    assert all(s.resource.attributes[semconv.ROLLOUT_ID] == "t1-abc" for s in got)
    assert got[0].resource.attributes["service.name"] == "agent"
    for span in got:
        span._resource = expected[0].resource
    assert encode_spans(got) == encode_spans(expected)
    # killed mid-write: a last record cut short is skipped and counted, never a crash
    whole = path.read_bytes()
    path.write_bytes(whole + spool.frame(spool.dumps({"k": "x", "n": "cut"}))[:-5])
    cut = shipping.Tail(str(path), ids)
    cut.read(final=False)                 # (still being written, as far as a reader can tell)
    assert (cut.delivery.spooled, cut.delivery.damaged, cut.offset) == (2, 0, len(whole))
    cut.read(final=True)
    assert (cut.delivery.spooled, cut.delivery.damaged) == (2, 1)
    # a damaged record amid good ones is skipped too; the reader finds the next one that checks
    path.write_bytes(whole[:20] + b"\xff" + whole[21:])
    torn = shipping.Tail(str(path), ids)
    torn.read(final=True)
    assert torn.delivery.damaged == 1 and torn.delivery.spooled >= 1


def test_a_spooled_span_is_what_the_agents_exporter_would_send_for_every_attribute_type(tmp_path, monkeypatch):
    """Spool -> runner -> OTLP protobuf gives the bytes the agent's exporter sends for the same span
    (the SDK's own encoder), for every attribute type the SDK keeps: the spool's copy is usually the
    one stored. JSON alone would make NaN and infinities null."""
    import math

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Link

    np = pytest.importorskip("numpy")
    path = tmp_path / "r.spool"
    monkeypatch.setenv(semconv.SPOOL_ENV, str(path))
    provider = TracerProvider(resource=Resource.create({"service.name": "agent", "r.float": float("nan")}),
                              span_limits=SpanLimits(max_span_attributes=31, max_events=2, max_links=1,
                                                     max_event_attributes=3, max_link_attributes=2))
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    spool.attach(provider)
    nan, inf = float("nan"), float("inf")
    values = {
        "nan": nan, "inf": inf, "-inf": -inf, "float": 0.1 + 0.2, "whole float": 1.0, "-0.0": -0.0,
        "tiny": 5e-324, "numpy float": np.float64(0.25), "numpy nan": np.float64("nan"),
        "int": 1, "-int": -(2 ** 63), "u64": 2 ** 63, "bool": True, "false": False,
        "str": "tök \u2028 \"$b\"", "tag-like": "{\"$f\": \"nan\"}", "empty str": "", "bytes": b"\x00\xffid",
        "empty bytes": b"", "floats": (0.5, nan, -inf, inf), "ints": (1, 2, 3), "bools": (True, False),
        "strs": ("a", ""), "bytes seq": (b"\x07\0\0\0", b""), "empty seq": (), "with None": ("a", None),
        "mapping": {"x": nan, "y": {"z": (1.5, b"b")}, "$b": "not bytes"},
        "surrogate": "a\ud800", "too big": 2 ** 64,          # the encoder skips these; so does the spool
    }
    tracer = provider.get_tracer("test.scope", "1.2", attributes={"scope.nan": nan})
    with tracer.start_as_current_span("root") as root:
        call = tracer.start_span("openai.chat", attributes={"old.0": 0, "old.1": 1, **values},
                                 links=[Link(root.get_span_context(), {"w": inf, "a": 1, "b": 2}),
                                        Link(root.get_span_context())])
        for n in range(3):
            call.add_event(f"e{n}", {"v": nan, "a": 1, "b": 2.5, "c": (inf,)})
        for n in range(2):
            call.set_attribute(f"extra.{n}", -inf)       # past the limit: the oldest dropped, and counted
        call.end()
    tail = shipping.Tail(str(path), {semconv.ROLLOUT_ID: "t1-abc"})
    tail.read(final=True)
    assert (tail.delivery.spooled, tail.delivery.damaged) == (2, 0)
    expected = memory.get_finished_spans()
    chat = expected[0]
    assert chat.name == "openai.chat" and "nan" in chat.attributes and "old.1" not in chat.attributes
    assert (chat.dropped_attributes, chat.dropped_events, chat.dropped_links) == (2, 1, 1)
    resource = tail.pending[0].resource
    assert math.isnan(resource.attributes["r.float"]) and resource.attributes[semconv.ROLLOUT_ID] == "t1-abc"
    for span in tail.pending:      # (the rollout's ids on the resource: the only difference, by design)
        span._resource = expected[0].resource
    assert encode_spans(tail.pending).SerializeToString() == encode_spans(expected).SerializeToString()
    got = tail.pending[0].attributes
    assert math.isnan(got["nan"]) and got["-inf"] == -inf and math.isnan(got["floats"][1])
    assert type(got["whole float"]) is float and type(got["int"]) is int and got["bool"] is True
    assert got["bytes"] == b"\x00\xffid" and got["tag-like"] == values["tag-like"]
    assert "surrogate" not in got and "u64" in got


def test_how_a_rollout_ended():
    def end(outcome, code):
        return Outcome("r", "t", outcome, code, 0, 1, 0).end

    def raised(code, outcome="failed"):
        o = Outcome("r", "t", outcome, code, 0, 1, 0, delivery=shipping.Delivery(exception="RuntimeError"))
        return o.end

    assert end("ok", 0) == ("exit", None) and end("failed", 1) == ("exit", None)
    assert end("infra", -9) == ("signal", 9) and end("timeout", -9) == ("timeout", 9)
    assert end("infra", None) == ("unknown", None)
    # an exception counts when it is what ended the process: an exit with status 1, not a kill after it
    assert raised(1) == ("exception", None)
    assert raised(-9, "infra") == ("signal", 9) and raised(-9, "timeout") == ("timeout", 9)
    assert {e for e, _ in (end("ok", 0), raised(1), end("infra", -9), end("timeout", -9), end("infra", None))} \
        == set(semconv.ROLLOUT_ENDS)


def test_an_uncaught_exception_is_recorded_from_the_agents_own_process_only(tmp_path):
    """The process that raises writes its exception's type to the spool at exit (as the interpreter
    ends it: sys.last_value, whatever sys.excepthook the agent installed); ``sys.exit(1)`` writes
    nothing; a subprocess's exception (a later opener of the same spool) is not the rollout's end."""
    path = tmp_path / "r.spool"
    agent = tmp_path / "agent.py"
    agent.write_text(
        "import os, sys\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from lightspan.tracing import spool\n"
        "spool.attach(TracerProvider())\n"
        "class AgentBroke(Exception): pass\n"
        "sys.excepthook = lambda *a: print('own hook', file=sys.stderr)\n"
        "how = sys.argv[1]\n"
        "if how == 'raise': raise AgentBroke('boom')\n"
        "if how == 'json': import json; json.loads('{')\n"
        "sys.exit(1)\n")

    def run(how: str) -> shipping.Tail:
        env = {**os.environ, semconv.SPOOL_ENV: str(path)}
        out = subprocess.run([sys.executable, str(agent), how], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, out.stderr
        tail = shipping.Tail(str(path), {})
        tail.read(final=True)
        return tail

    assert run("raise").delivery.exception == "AgentBroke"
    path.unlink()
    assert run("exit1").delivery.exception is None
    path.unlink()
    assert run("json").delivery.exception == "json.decoder.JSONDecodeError"
    # a second process on the same spool (a subprocess of the agent's) that raises: not the agent's end
    path.unlink()
    run("exit1")
    assert run("raise").delivery.exception is None


# --- for real: collector, stand-in for vLLM, lightspan rollout -------------------------------------

@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    data = tmp_path_factory.mktemp("spool-data")
    with collector_process(data, data / "collector.log") as running:
        yield running


@pytest.fixture(scope="module")
def llm():
    server = Upstream()
    yield server
    server.close()


def rollout(ports: dict, llm, tmp_path: Path, tasks: list[dict], *options: str, env: dict | None = None,
            background: bool = False):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    command = [sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(path), "--samples", "1",
               "--concurrency", str(len(tasks)), "--retries", "0", "--openai-base-url", f"{llm.url}/v1",
               "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}", "--data-dir", str(tmp_path / "data"),
               "--logs-dir", str(tmp_path / "logs"), *options, "--", sys.executable, str(AGENT)]
    full_env = {**os.environ, **HOLD, **(env or {})}
    if background:
        return subprocess.Popen(command, env=full_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.run(command, env=full_env, text=True, capture_output=True, timeout=300)


def summary_of(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["worker", "process"])
def test_every_answered_call_is_stored_however_the_agent_dies(collector, llm, tmp_path, mode):
    from lightspan import store

    data, ports = collector
    ways = {"exit": ("exit", 0, None, None), "exit1": ("exit", 1, None, None),
            "raise": ("exception", 1, None, "RuntimeError"), "hang": ("timeout", -9, 9, None),
            "kill": ("signal", -9, 9, None)}
    tasks = [{"id": f"{mode}:{way}", "behaviour": way, "pid_file": str(tmp_path / f"{way}.pid")} for way in ways]
    # (the hang outlives the time limit; a process per rollout needs longer to make its calls on a busy machine)
    out = rollout(ports, llm, tmp_path, tasks, "--mode", mode, "--timeout-s", "20" if mode == "worker" else "60")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = summary_of(out.stdout)
    assert summary["mode"] == mode and (summary["ok"], summary["failed"], summary["timeout"], summary["infra"]) \
        == (1, 2, 1, 1), summary
    requests.post(f"http://127.0.0.1:{ports['api']}/v1/flush", timeout=60).raise_for_status()
    con = store.connect(data)
    calls = dict(con.execute("""SELECT task_id, count(*) FROM spans WHERE name = 'openai.chat'
                                AND starts_with(task_id, ?) GROUP BY 1""", [f"{mode}:"]).fetchall())
    # both calls of every rollout, each once: the agent's exporter delivered those of the rollouts
    # that exited, the spool all four rollouts'; the collector kept the first copy of each
    assert calls == {f"{mode}:{way}": 2 for way in ways}, calls
    rows = con.execute("""SELECT task_id, ended, exit_code, end_signal, end_exception, lost_spans, outcome
                          FROM rollouts WHERE starts_with(task_id, ?)""", [f"{mode}:"]).fetchall()
    ended = {task.split(":", 1)[1]: (end, code, sig, exc) for task, end, code, sig, exc, lost, _ in rows}
    assert ended == ways, rows
    assert all(lost == 0 for *_, lost, _ in rows), rows
    assert {task.split(":", 1)[1]: outcome for task, *_, outcome in rows} == \
        {"exit": "ok", "exit1": "failed", "raise": "failed", "hang": "timeout",
         "kill": "infra"}      # killed by a signal the runner did not send: retried, and recorded as infra
    assert summary["delivery"]["lost"] == summary["delivery"]["damaged"] == 0, summary["delivery"]


def test_an_endpoint_of_the_other_protocol_is_refused_before_any_rollout(collector, llm, tmp_path):
    _, ports = collector
    tasks = [{"id": "never", "behaviour": "exit", "pid_file": str(tmp_path / "never.pid")}]
    cases = {"http at the gRPC port": ["--otlp-endpoint", f"http://127.0.0.1:{ports['grpc']}"],
             "grpc at the HTTP port": ["--otlp-endpoint", f"http://127.0.0.1:{ports['http']}",
                                       "--otlp-protocol", "grpc"]}
    for case, options in cases.items():
        out = rollout(ports, llm, tmp_path, tasks, *options)
        lines = [line for line in out.stderr.splitlines() if "rollout.otlp_endpoint" in line]
        assert out.returncode == 2 and len(lines) == 1, (case, out.returncode, out.stderr[-3000:])
        assert "OTLP/HTTP" in lines[0] and "OTLP/gRPC" in lines[0], lines
        assert "--otlp-protocol" in lines[0] and "--otlp-endpoint" in lines[0], lines
        assert not list((tmp_path / "logs").glob("never-*.log")), case     # no rollout ran
    assert "http://127.0.0.1:4318" in [line for line in rollout(
        ports, llm, tmp_path, tasks, *cases["http at the gRPC port"]).stderr.splitlines()
        if "rollout.otlp_endpoint" in line][0]


def test_a_collector_that_goes_away_makes_the_run_count_its_lost_spans_and_fail(llm, tmp_path):
    data = tmp_path / "gone-data"
    data.mkdir()
    pid_file, go_file = tmp_path / "agent.pid", tmp_path / "go"
    with ExitStack() as stack:
        _, ports = stack.enter_context(collector_process(data, data / "collector.log"))
        run = rollout(ports, llm, tmp_path, [{"id": "gone", "behaviour": "exit", "pid_file": str(pid_file),
                                              "go_file": str(go_file)}],
                      env={"OTEL_EXPORTER_OTLP_TIMEOUT": "2", "LIGHTSPAN_ROLLOUT_EXPORT_TIMEOUT_S": "2"},
                      background=True)
        deadline = time.monotonic() + 120
        while not pid_file.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pid_file.exists(), run.communicate(timeout=60)
        stack.close()                        # the collector stops while the rollout runs
    go_file.touch()
    stdout, stderr = run.communicate(timeout=180)
    assert run.returncode == 1, stderr[-3000:]
    delivery = summary_of(stdout)["delivery"]
    assert delivery["spans"] >= 2 and delivery["delivered"] == 0, delivery
    assert delivery["lost"] == delivery["spans"] + 1, delivery      # its spans and its runner span
    assert len(delivery["rollouts_with_lost_spans"]) == 1 and "did not reach the collector" in stderr
