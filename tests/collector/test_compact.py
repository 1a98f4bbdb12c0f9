"""Compaction (merge small files, keep every row once, no gap for readers) and retention."""

from __future__ import annotations

import threading
from datetime import datetime, timezone

import duckdb
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from lightspan import store
from lightspan.collector import compact
from lightspan.store.files import partitions
from lightspan.tracing import semconv as sc
from tests.collector.helpers import query, raw_rows, wait_for

DAY_NS = 86_400 * 10**9
NOW_NS = int(datetime.now(timezone.utc).timestamp()) * 10**9


def spans_request(rollout: str, n: int, start_ns: int, first_id: int = 1) -> bytes:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key=sc.ROLLOUT_ID).value.string_value = rollout
    scope = rs.scope_spans.add()
    for i in range(first_id, first_id + n):
        span = scope.spans.add(trace_id=i.to_bytes(16, "big"), span_id=i.to_bytes(8, "big"), name=f"s{i}",
                               start_time_unix_nano=start_ns + (n - i) * 1000, end_time_unix_nano=start_ns + 10**6)
        span.attributes.add(key=sc.PROMPT_TOKEN_IDS).value.bytes_value = sc.encode_ids([i, i + 1])
    return request.SerializeToString()


def logs_request(rollout: str, n: int, time_ns: int) -> bytes:
    request = ExportLogsServiceRequest()
    rl = request.resource_logs.add()
    rl.resource.attributes.add(key=sc.ROLLOUT_ID).value.string_value = rollout
    scope = rl.scope_logs.add()
    for i in range(n):
        scope.log_records.add(time_unix_nano=time_ns + i).body.string_value = f"{rollout}-{i}"
    return request.SerializeToString()


def parquet_files(data_dir, table: str = "spans"):
    return sorted((data_dir / table).rglob("*.parquet"))


SNAPSHOT = """SELECT trace_id, span_id, name, rollout_id, prompt_token_ids, attributes, received_unix_nano
              FROM spans ORDER BY trace_id"""


def test_compact_merges_files_keeps_every_row_once_and_sorts(collector_factory, data_dir):
    collector = collector_factory()
    for k, rollout in enumerate(["c", "a", "b", "a"]):
        assert collector.export(spans_request(rollout, 5, NOW_NS, first_id=1 + 10 * k)).outcome.value == "ok"
        assert collector.export(logs_request(rollout, 3, NOW_NS), signal="logs").outcome.value == "ok"
        collector.flush()                                       # one file per flush
    assert collector.export(spans_request("c", 5, NOW_NS)).outcome.value == "ok"   # a re-sent batch
    collector.flush()                                           # not written again: no file
    assert len(parquet_files(data_dir)) == 4 and raw_rows(data_dir) == 20
    before = query(data_dir, SNAPSHOT)
    described = query(data_dir, "DESCRIBE spans")
    logs_before = query(data_dir, "SELECT * FROM logs ORDER BY record_id")
    assert len(before) == 20 and len(logs_before) == 12 - 3    # the re-sent "a" log records: once
    assert len(parquet_files(data_dir, "logs")) == 3            # the second "a" flush had only repeats
    assert collector.compact(grace_s=0) == 4 + 3
    [merged] = parquet_files(data_dir)
    assert raw_rows(data_dir) == 20                            # nothing lost
    assert query(data_dir, SNAPSHOT) == before and query(data_dir, "DESCRIBE spans") == described
    assert query(data_dir, "SELECT * FROM logs ORDER BY record_id") == logs_before
    assert len(parquet_files(data_dir, "logs")) == 1
    in_file = duckdb.sql(f"SELECT rollout_id, start_time_unix_nano FROM read_parquet('{merged}')").fetchall()
    assert in_file == sorted(in_file)                          # sorted by rollout, then time
    assert collector.compact(grace_s=0) == 0                   # one file: nothing to do
    snapshot = collector.metrics.snapshot()
    assert (snapshot["compactions_total"], snapshot["files_compacted_total"]) == (2, 7)


def test_writer_compacts_past_compact_min_files_while_readers_see_every_row(collector_factory, data_dir):
    collector = collector_factory(compact_min_files=3, flush_interval_s=0.02)
    seen, errors, stop = set(), [], threading.Event()

    def reader():                                              # counts while files are merged and removed
        while not stop.is_set():
            con = store.connect(data_dir)
            try:
                seen.add(con.execute("SELECT count(*) FROM spans").fetchone()[0])
            except duckdb.Error as exc:                        # e.g. a file removed under a running scan
                errors.append(str(exc))
            finally:
                con.close()

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for k in range(12):
            assert collector.export(spans_request("w", 4, NOW_NS, first_id=1 + 4 * k)).outcome.value == "ok"
            wait_for(lambda: collector.queue_bytes == 0, what="the timed flush")
            assert collector.export(spans_request("w", 4, NOW_NS, first_id=1 + 4 * k)).outcome.value == "ok"
        wait_for(lambda: collector.queue_bytes == 0, what="the last flush")
        wait_for(lambda: collector.metrics.snapshot()["compactions_total"] >= 2, what="compactions")
    finally:
        stop.set()
        thread.join()
    # every count a reader saw is a whole number of exports: no gap, no undeduplicated duplicate;
    # the merged-away files outlive the merge, so no scan lost a file under it
    assert errors == [] and max(seen) <= 48 and all(n % 4 == 0 for n in seen), (sorted(seen), errors[:3])
    assert query(data_dir, "SELECT count(*), count(DISTINCT span_id) FROM spans") == [(48, 48)]
    collector.stop()                                           # removes the merged-away files
    assert len(parquet_files(data_dir)) <= 3 + 1 and query(data_dir, "SELECT count(*) FROM spans") == [(48,)]


def test_retention_deletes_only_partitions_older_than_the_limit(collector_factory, data_dir):
    collector = collector_factory(retention_days=5)
    for k, (rollout, age_days) in enumerate((("today", 0), ("four", 4), ("five", 5), ("old", 10))):
        assert collector.export(spans_request(rollout, 2, NOW_NS - age_days * DAY_NS, 1 + 2 * k)).outcome.value == "ok"
        assert collector.export(logs_request(rollout, 2, NOW_NS - age_days * DAY_NS), signal="logs").outcome.value == "ok"
    collector.flush()
    assert len(partitions(data_dir, "spans")) == 4
    removed = collector.expire()
    # date(now - 5 days) ends less than 5 days ago (its last hours are younger): it stays
    assert sorted(removed) == sorted(f"{t}/date={datetime.fromtimestamp((NOW_NS - 10 * DAY_NS) / 1e9, timezone.utc).date()}"
                                     for t in ("spans", "logs"))
    assert query(data_dir, "SELECT DISTINCT rollout_id FROM spans ORDER BY 1") == [("five",), ("four",), ("today",)]
    assert query(data_dir, "SELECT DISTINCT rollout_id FROM logs ORDER BY 1") == [("five",), ("four",), ("today",)]
    assert collector.expire() == [] and collector.metrics.snapshot()["partitions_expired_total"] == 2
    assert not any((data_dir / ".trash").iterdir())


def test_expire_partitions_boundary_and_zero_keeps_everything(tmp_path):
    for day in ("2024-05-01", "2024-05-02", "2024-05-03"):
        (tmp_path / "spans" / f"date={day}").mkdir(parents=True)
    now = datetime(2024, 5, 4, 12, tzinfo=timezone.utc)
    assert compact.expire_partitions(tmp_path, "spans", 0, now) == []
    # 1 day: the cutoff is 05-03 12:00; 05-02 ended at 05-03 00:00 (gone), 05-03 ends at 05-04 00:00 (kept)
    assert compact.expire_partitions(tmp_path, "spans", 1, now) == ["date=2024-05-01", "date=2024-05-02"]
    assert list(partitions(tmp_path, "spans")) == ["date=2024-05-03"]


def test_writer_applies_retention(collector_factory, data_dir):
    collector = collector_factory(retention_days=1, flush_interval_s=0.02)
    assert collector.export(spans_request("ancient", 2, NOW_NS - 30 * DAY_NS)).outcome.value == "ok"
    assert collector.export(spans_request("fresh", 2, NOW_NS, first_id=3)).outcome.value == "ok"
    wait_for(lambda: collector.metrics.snapshot()["partitions_expired_total"] == 1, what="the retention pass")
    assert query(data_dir, "SELECT DISTINCT rollout_id FROM spans") == [("fresh",)]

