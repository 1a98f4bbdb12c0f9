"""The collector's structured logs: the service's JSON lines (start-up summary, rate-limited
refusals, flushes, WAL replay after kill -9) and the two formatters."""

from __future__ import annotations

import json
import logging

import grpc
import pytest
import requests

from lightspan.collector import jsonlog
from lightspan.collector.config import CollectorConfig
from lightspan.collector.server import EXPORT_METHOD
from lightspan.core.config import ConfigError
from tests.collector.helpers import make_spans, query, request_bytes, wait_for
from tests.collector.process import CollectorProcess

TOKEN = "s3cret-token-for-the-log-test"


def test_service_logs_json_lines_startup_refusals_flush_and_replay(tmp_path):
    data_dir, log_path = tmp_path / "data", tmp_path / "collector.log"
    service = CollectorProcess(data_dir, log_path, env={"LIGHTSPAN_COLLECTOR_AUTH_TOKEN": TOKEN},
                               flush_interval_s=3600, log_refusals_every_s=3600).start()
    auth = {"authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-protobuf"}
    try:
        [started] = [r for r in service.records() if r.get("event") == "started"]
        assert started["level"] == "info" and started["logger"] == "lightspan.collector.server"
        assert "OTLP/gRPC 127.0.0.1:" in started["msg"]
        assert started["config"]["auth_token"] == "<set>" and started["config"]["flush_interval_s"] == 3600
        assert started["config"]["data_dir"] == str(data_dir) and started["config"]["log_format"] == "json"
        # five bad requests: counted five times, logged once (rate limit), naming the reason
        for _ in range(5):
            bad = requests.post(service.url("http", "/v1/traces"), data=b"\xff\xff", headers=auth, timeout=5)
            assert bad.status_code == 400
        ok = requests.post(service.url("http", "/v1/traces"), data=request_bytes(make_spans("logged")),
                           headers=auth, timeout=5)
        assert ok.status_code == 200
        metrics = requests.get(service.url("api", "/metrics"), headers=auth, timeout=5).text
        assert 'lightspan_collector_requests_refused_total{reason="invalid"} 5' in metrics
        flushed = requests.post(service.url("api", "/v1/flush"), headers=auth, timeout=5)
        assert flushed.json()["flushed_spans"] == 3
        flush_lines = wait_for(lambda: [r for r in service.records() if r["msg"].startswith("flushed")],
                               what="the flush log line")
        assert flush_lines[-1]["spans"] == 3 and flush_lines[-1]["seconds"] >= 0
        refusals = [r for r in service.records() if r["msg"].startswith("export refused")]
        assert len(refusals) == 1
        assert refusals[0]["level"] == "warning" and refusals[0]["reason"] == "invalid"
        assert refusals[0]["suppressed"] == 0
        # acknowledged, not flushed, then kill -9: the next start replays the WAL and says how much
        with grpc.insecure_channel(service.grpc_target) as channel:
            channel.unary_unary(EXPORT_METHOD)(request_bytes(make_spans("replayed", calls=4)), timeout=5,
                                                metadata=[("authorization", f"Bearer {TOKEN}")])
        service.kill()
        service.start()
        [replay] = [r for r in service.records() if r["msg"].startswith("replayed")]
        assert (replay["spans"], replay["log_records"], replay["skipped_records"]) == (5, 0, 0)
        assert replay["wal_segments"] >= 1
        assert service.stop() == 0
    finally:
        service.kill()
    records = service.records()    # every line of both runs parses as one JSON object
    assert all({"ts", "level", "logger", "msg"} <= r.keys() for r in records)
    assert all(r["ts"].endswith("Z") and "T" in r["ts"] for r in records)
    assert any(r["msg"] == "collector stopped" for r in records)
    assert TOKEN not in log_path.read_text()
    assert query(data_dir, "SELECT rollout_id, count(*) FROM spans GROUP BY 1 ORDER BY 1") == [
        ("logged", 3), ("replayed", 5)]


def _record(msg="hello %s", args=("world",), exc_info=None, **extra) -> logging.LogRecord:
    record = logging.LogRecord("lightspan.collector.test", logging.WARNING, __file__, 1, msg, args, exc_info)
    record.created = 1_700_000_000.25
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_json_formatter_fields_exceptions_and_non_json_values():
    try:
        raise ValueError("boom")
    except ValueError:
        import sys
        exc = sys.exc_info()
    line = jsonlog.JsonFormatter().format(_record(spans=3, ratio=float("nan"), where=object.__name__,
                                                  exc_info=exc))
    doc = json.loads(line)
    assert "\n" not in line
    assert doc["ts"] == "2023-11-14T22:13:20.250Z"
    assert (doc["level"], doc["logger"], doc["msg"]) == ("warning", "lightspan.collector.test", "hello world")
    assert (doc["spans"], doc["ratio"], doc["where"]) == (3, "nan", "object")
    assert "ValueError: boom" in doc["exc"]


def test_text_formatter_appends_fields():
    line = jsonlog.TextFormatter().format(_record(spans=3))
    assert line == "2023-11-14T22:13:20.250Z WARNING lightspan.collector.test: hello world spans=3"


def test_rate_limit_one_line_per_key_and_interval_with_the_count_left_out():
    now = [0.0]
    limit = jsonlog.RateLimit(10.0, clock=lambda: now[0])
    assert limit.check("invalid") == 0
    assert [limit.check("invalid") for _ in range(3)] == [None, None, None]
    assert limit.check("queue_full") == 0            # keys are independent
    now[0] = 10.0
    assert limit.check("invalid") == 3
    assert limit.check("invalid") is None
    every = jsonlog.RateLimit(0.0, clock=lambda: now[0])     # 0: every line
    assert [every.check("x") for _ in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("overrides, field", [({"log_format": "xml"}, "collector.log_format"),
                                              ({"log_refusals_every_s": -1}, "collector.log_refusals_every_s")])
def test_log_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        CollectorConfig(**overrides)
    assert info.value.field == field
