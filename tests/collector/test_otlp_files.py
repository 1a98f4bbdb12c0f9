"""OTLP JSON files in and out: `lightspan import` of files the OTel SDK's own JSON file exporter
wrote (plain, gzip, zstd, the Collector's older zstd framing, the console exporter given an OTLP
formatter), idempotent, malformed lines reported by file and line; `lightspan export --format
otlp-json` round-trips into a new data directory as the same rows."""

from __future__ import annotations

import gzip
import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import requests

from lightspan.cli import main
from lightspan.tracing import semconv as sc
from tests.collector.helpers import config, query

SIDE = Path(sys.prefix) / "otel-json-file"        # the SDK's JSON file exporter (scripts/setup.sh)

WRITER = textwrap.dedent("""
    import sys
    from opentelemetry.exporter.otlp.json.file import FileSpanExporter
    from opentelemetry.exporter.otlp.json.file._log_exporter import FileLogExporter
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from lightspan.tracing import semconv as sc

    resource = Resource.create({"service.name": "agent", sc.ROLLOUT_ID: sys.argv[2], sc.TASK_ID: "t"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(sys.argv[1])))
    logs = LoggerProvider(resource=resource)
    logs.add_log_record_processor(SimpleLogRecordProcessor(FileLogExporter(sys.argv[1])))
    tracer = provider.get_tracer("agent")
    with tracer.start_as_current_span("invoke_agent solver", attributes={sc.GEN_AI_OPERATION_NAME: "invoke_agent"}):
        with tracer.start_as_current_span("chat policy") as chat:
            chat.set_attributes({sc.GEN_AI_OPERATION_NAME: "chat", sc.PROMPT_TOKEN_IDS: sc.encode_ids([1, 2]),
                                 sc.COMPLETION_TOKEN_IDS: sc.encode_ids([3]),
                                 sc.COMPLETION_LOGPROBS: sc.encode_floats([-0.5])})
            logs.get_logger("agent").emit(event_name="gen_ai.choice", body={"index": 0})
    provider.shutdown()
    logs.shutdown()
""")


def sdk_file(tmp_path, name: str = "sdk.jsonl", rollout: str = "from-file") -> Path:
    """A file written by the OTel Python SDK's own OTLP JSON file exporter, in a process of its own."""
    path, script = tmp_path / name, tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {"PYTHONPATH": f"{SIDE}:{Path.cwd()}", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, str(script), str(path), rollout], check=True, env=env, timeout=120)
    return path


def run_import(*args) -> tuple[int, dict]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["import", *map(str, args)])
    return code, json.loads(out.getvalue())


def test_import_a_file_of_the_sdks_exporter_twice(tmp_path):
    data = tmp_path / "data"
    path = sdk_file(tmp_path)
    assert len(path.read_text().splitlines()) == 3                     # one export request per line
    code, report = run_import(path, "--data-dir", data)
    assert code == 0 and report["spans"] == {"read": 2, "stored": 2, "already_stored": 0, "rejected": 0}
    assert report["log_records"]["stored"] == 1
    assert query(data, "SELECT rollout_id, count(*), count(prompt_token_ids) FROM llm_calls GROUP BY 1") == [
        ("from-file", 1, 1)]
    code, again = run_import(path, "--data-dir", data)                 # idempotent, and it says so
    assert code == 0 and again["spans"]["stored"] == 0 and again["spans"]["already_stored"] == 2
    assert again["log_records"]["already_stored"] == 1 and again["summary"].startswith("nothing new")
    assert query(data, "SELECT count(*) FROM spans") == [(2,)] and query(data, "SELECT count(*) FROM logs") == [(1,)]


def test_compressed_framed_console_and_malformed(tmp_path):
    data = tmp_path / "data"
    lines = sdk_file(tmp_path, rollout="r-gz").read_bytes()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    lines = sdk_file(tmp_path, "b.jsonl", rollout="r-zst").read_bytes()
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as stream:              # the exporter's native compression
        stream.write(lines)
    (tmp_path / "b.jsonl.zst").write_bytes(sink.getvalue().to_pybytes())
    framed = b""                                                          # its older framing: a zstd record each
    for line in sdk_file(tmp_path, "c.jsonl", rollout="r-framed").read_bytes().splitlines():
        record = pa.BufferOutputStream()
        with pa.CompressedOutputStream(record, "zstd") as stream:
            stream.write(line)
        record = record.getvalue().to_pybytes()
        framed += struct.pack(">I", len(record)) + record
    (tmp_path / "c.bin").write_bytes(framed)
    # the console exporter given an OTLP formatter: pretty, several lines per request, and a broken one
    good = sdk_file(tmp_path, "d.jsonl", rollout="r-pretty").read_text().splitlines()
    span_line = next(line for line in good if "resourceSpans" in line)
    pretty = json.dumps(json.loads(span_line), indent=2)
    (tmp_path / "d.txt").write_text(pretty + '\n{"resourceSpans": [oops\n' + pretty + "\n")   # twice: stored once
    # the console exporter's default output is JSON but not OTLP
    (tmp_path / "e.json").write_text(json.dumps({"name": "chat", "context": {"trace_id": "0x1"}}, indent=4) + "\n")
    code, report = run_import(*(tmp_path / n for n in ("a.jsonl.gz", "b.jsonl.zst", "c.bin", "d.txt", "e.json")),
                              "--data-dir", data)
    assert code == 1                                                      # something was malformed: said, not fatal
    where = {(Path(m["file"]).name, m["at"]) for m in report["malformed"]}
    assert where == {("d.txt", f"line {pretty.count(chr(10)) + 2}"), ("e.json", "line 1")}
    assert any("not OTLP JSON" in m["error"] or "not an OTLP export" in m["error"] for m in report["malformed"])
    assert query(data, "SELECT rollout_id, count(*) FROM spans GROUP BY 1 ORDER BY 1") == [
        ("r-framed", 2), ("r-gz", 2), ("r-pretty", 1), ("r-zst", 2)]


def test_export_otlp_json_round_trips(collector_factory, data_dir, tmp_path):
    from tests.collector.test_evaluations import agent_run, evaluate, http_logs

    collector = collector_factory()
    ids = agent_run(collector, "r-trip")
    evaluate(http_logs(collector), [({"trace": ids["trace"], "span": ids["chat"]},
                                     {sc.GEN_AI_EVALUATION_NAME: "Relevance", sc.GEN_AI_EVALUATION_SCORE_VALUE: 0.5})])
    posted = requests.post(f"http://127.0.0.1:{collector.api_port}/v1/rewards", timeout=5,
                           json={"rollout_id": "r-trip", "value": 1.0, "source": "human", "comment": "good"})
    assert posted.status_code == 200
    collector.flush()
    out = tmp_path / "archive.jsonl.zst"
    assert main(["export", "--format", "otlp-json", "--out", str(out), "--data-dir", str(data_dir)]) == 0
    copy = tmp_path / "copy"
    code, report = run_import(out, "--data-dir", copy, "--own-rewards")
    assert code == 0 and report["spans"]["stored"] == query(data_dir, "SELECT count(*) FROM spans")[0][0]

    def rows(d):
        table = query(d, "SELECT * EXCLUDE (received_unix_nano) FROM spans ORDER BY trace_id, span_id")
        return [tuple(sorted(v) if isinstance(v, list) and v and isinstance(v[0], tuple) else v for v in r)
                for r in table]

    assert rows(copy) == rows(data_dir)
    assert query(copy, "SELECT reward_name, reward, source FROM rewards ORDER BY 1") == [
        ("Relevance", 0.5, "phoenix-evals"), ("reward", 1.0, "human")]
    # without --own-rewards, the rewards of the collector's scope are any sender's: refused, and said so
    code, report = run_import(out, "--data-dir", tmp_path / "untrusted")
    assert code == 1 and report["spans"]["rejected"] == 2
    # a time range and a SQL condition
    some = tmp_path / "some.jsonl"
    assert main(["export", "--format", "otlp-json", "--out", str(some), "--data-dir", str(data_dir),
                 "--where", "name = 'chat policy'", "--since", "2000-01-01T00:00:00Z"]) == 0
    assert [s["name"] for line in some.read_text().splitlines() for rs in json.loads(line)["resourceSpans"]
            for ss in rs["scopeSpans"] for s in ss["spans"]] == ["chat policy"]
    assert main(["export", "--format", "otlp-json", "--out", str(some), "--data-dir", str(data_dir),
                 "--until", "2000-01-01T00:00:00Z"]) == 0
    assert some.read_text() == ""
