"""Disk full: WAL write/fsync errors are refused retryably, never acknowledged, and recovered from.

The errors are injected, not provoked: the tests monkeypatch ``WAL._write_all`` (the one place a
record's bytes are written) and ``WAL._fsync`` to raise ``OSError(ENOSPC)`` / ``OSError(EIO)``,
and ``store.write_table`` for the Parquet side. A real full disk raises the same errors from the
same calls.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import types

import grpc
import pytest
import requests
from google.rpc import error_details_pb2
from opentelemetry.sdk.trace.export import SpanExportResult

from lightspan import store
from lightspan.collector import wal as wal_module
from lightspan.collector.server import Collector
from lightspan.collector.wal import WAL
from tests.collector.helpers import (api_url, config, grpc_call, grpc_exporter, make_spans, query, request_bytes,
                                     traces_url, wait_for)

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
_real_write_all = WAL._write_all


def half_then_enospc(self, fd, data):
    """What a full disk does mid-record: some bytes land, then ENOSPC."""
    _real_write_all(self, fd, data[: len(data) // 2])
    raise ENOSPC


def no_space(self, fd, data):
    raise ENOSPC


# --- the WAL itself ------------------------------------------------------------------------------

def test_a_failed_write_is_cut_back_and_later_records_replay(tmp_path, monkeypatch):
    wal = WAL(tmp_path)
    wal.append(b"acknowledged-1")
    monkeypatch.setattr(WAL, "_write_all", half_then_enospc)
    with pytest.raises(OSError) as info:
        wal.write(b"refused" * 100)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.setattr(WAL, "_write_all", _real_write_all)
    wal.append(b"acknowledged-2")                  # same segment, right after the last whole record
    assert len(wal.rotate()) == 1
    assert list(wal.replay()) == [b"acknowledged-1", b"acknowledged-2"]


def test_a_torn_record_that_cannot_be_cut_sends_later_records_to_a_new_segment(tmp_path, monkeypatch, caplog):
    wal = WAL(tmp_path)
    wal.append(b"acknowledged-1")
    pending = wal.write(b"written, not yet synced")   # another exporter's record, waiting for fsync

    def ftruncate(fd, length):
        raise OSError(errno.EIO, "cannot truncate")

    monkeypatch.setattr(wal_module, "os", types.SimpleNamespace(**{**vars(os), "ftruncate": ftruncate}))
    monkeypatch.setattr(WAL, "_write_all", half_then_enospc)
    with pytest.raises(OSError):
        wal.write(b"torn" * 100)
    monkeypatch.undo()
    wal.append(b"acknowledged-2")                  # abandons the torn segment (fsynced first), opens a new one
    wal.sync(pending)                              # the record before the tear is durable
    closed = wal.rotate()
    assert len(closed) == 2
    assert list(wal.replay(closed)) == [b"acknowledged-1", b"written, not yet synced", b"acknowledged-2"]
    assert "torn or corrupt" in caplog.text


def test_a_failed_fsync_fails_every_unsynced_record_of_its_segment(tmp_path, monkeypatch):
    wal = WAL(tmp_path)
    wal.append(b"acknowledged-1")
    first, second = wal.write(b"a"), wal.write(b"b")
    real_fsync = WAL._fsync

    def fsync_fails_once(self, fd):
        monkeypatch.setattr(WAL, "_fsync", real_fsync)
        raise OSError(errno.EIO, "fsync failed")

    monkeypatch.setattr(WAL, "_fsync", fsync_fails_once)
    with pytest.raises(OSError):
        wal.sync(first)
    for position in (first, second):               # a later fsync "succeeding" would prove nothing
        with pytest.raises(OSError, match="not durable"):
            wal.sync(position)
    wal.append(b"acknowledged-2")                  # a new segment; then the old positions stay lost
    for position in (first, second):
        with pytest.raises(OSError, match="not durable"):
            wal.sync(position)
    assert len(wal.rotate()) == 2
    assert list(wal.replay())[0] == b"acknowledged-1" and list(wal.replay())[-1] == b"acknowledged-2"


# --- the collector -------------------------------------------------------------------------------

def test_disk_full_is_refused_retryably_on_every_path_then_recovers(collector_factory, data_dir, tmp_path,
                                                                    monkeypatch):
    collector = collector_factory(retry_after_s=1)
    assert grpc_exporter(collector).export(make_spans("before")) == SpanExportResult.SUCCESS
    monkeypatch.setattr(WAL, "_write_all", no_space)
    _, error = grpc_call(collector, request_bytes(make_spans("refused-grpc")))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "No space left" in error.details()
    info = error_details_pb2.RetryInfo.FromString(dict(error.trailing_metadata())["google.rpc.retryinfo-bin"])
    assert info.retry_delay.seconds == 1
    http = requests.post(traces_url(collector), data=request_bytes(make_spans("refused-http")),
                         headers={"Content-Type": "application/x-protobuf"}, timeout=5)
    assert http.status_code == 503 and http.headers["Retry-After"] == "1"
    reward = requests.post(api_url(collector, "/v1/rewards"), json={"rollout_id": "before", "value": 1}, timeout=5)
    assert reward.status_code == 503 and reward.headers["Retry-After"] == "1"
    assert requests.get(api_url(collector, "/healthz"), timeout=5).status_code == 200   # still up
    # the real exporter retries after the delay we sent; the disk "frees up" meanwhile
    result = []
    sender = threading.Thread(target=lambda: result.append(
        grpc_exporter(collector, timeout=15).export(make_spans("retried"))))
    sender.start()
    wait_for(lambda: collector.metrics.snapshot()["requests_refused_total"]["disk"] >= 4, what="the refusal")
    monkeypatch.setattr(WAL, "_write_all", _real_write_all)
    sender.join(timeout=20)
    assert result == [SpanExportResult.SUCCESS]
    crashed = tmp_path / "crashed"
    shutil.copytree(data_dir / "wal", crashed / "wal")         # a crash now: only the WAL survives
    recovered = Collector(config(crashed)).start()
    try:
        assert query(crashed, "SELECT rollout_id, count(*) FROM spans GROUP BY 1 ORDER BY 1") == [
            ("before", 3), ("retried", 3)]                    # acknowledged: all, once; refused: none
    finally:
        recovered.stop()
    assert 'requests_refused_total{reason="disk"} 4' in collector.render_metrics()


def test_a_failed_fsync_is_refused_and_the_next_export_lands(collector_factory, data_dir, tmp_path, monkeypatch):
    collector = collector_factory()
    assert grpc_exporter(collector).export(make_spans("a")) == SpanExportResult.SUCCESS
    real_fsync = WAL._fsync

    def fsync_fails_once(self, fd):
        monkeypatch.setattr(WAL, "_fsync", real_fsync)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(WAL, "_fsync", fsync_fails_once)
    _, error = grpc_call(collector, request_bytes(make_spans("b")))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "fsync failed" in error.details()
    assert grpc_exporter(collector).export(make_spans("c")) == SpanExportResult.SUCCESS
    crashed = tmp_path / "crashed"
    shutil.copytree(data_dir / "wal", crashed / "wal")
    recovered = Collector(config(crashed)).start()
    try:
        counts = dict(query(crashed, "SELECT rollout_id, count(*) FROM spans GROUP BY 1"))
        assert counts["a"] == 3 and counts["c"] == 3         # "b" was never acknowledged: either way is fine
    finally:
        recovered.stop()
    collector.flush()
    assert collector.metrics.snapshot()["requests_refused_total"]["disk"] == 1


def test_a_failed_parquet_write_keeps_the_data_queued_and_in_the_wal(collector_factory, data_dir, monkeypatch):
    collector = collector_factory()
    assert grpc_exporter(collector).export(make_spans("kept")) == SpanExportResult.SUCCESS
    real_write_table = store.write_table

    def write_table_fails_once(*args, **kwargs):
        monkeypatch.setattr(store, "write_table", real_write_table)
        raise ENOSPC

    monkeypatch.setattr(store, "write_table", write_table_fails_once)
    with pytest.raises(OSError):
        collector.flush()
    assert list((data_dir / "wal").glob("*.wal")) and collector.queue_bytes > 0
    assert collector.flush() == 3
    assert query(data_dir, "SELECT count(*) FROM spans WHERE rollout_id = 'kept'") == [(3,)]
    assert list((data_dir / "wal").glob("*.wal")) == []
    assert collector.metrics.snapshot()["flush_errors_total"] == 1
