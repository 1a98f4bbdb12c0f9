"""Deduplication at write time (collector/dedup.py) and the merged-file notes readers follow
(store.table_files, compact.sweep): the store holds each span once without a window in its views."""

from __future__ import annotations

import json
import shutil

import pytest

from lightspan import store
from lightspan.collector import compact, dedup
from lightspan.store.files import partitions
from lightspan.collector.config import ConfigError
from lightspan.collector.server import Collector
from tests.collector.helpers import config, query, raw_rows
from tests.collector.test_compact import NOW_NS, parquet_files, spans_request


def ids(data_dir) -> list[tuple[str, str]]:
    return query(data_dir, "SELECT trace_id, span_id FROM spans ORDER BY 1, 2")


def test_recent_keys_rotate_by_count_and_by_age():
    now = [0.0]
    keys = dedup.RecentKeys(max_keys=4, window_s=10.0, clock=lambda: now[0])
    keys.add([b"a", b"b"])
    assert keys.new_rows([b"c", b"d"]) is None                         # all new: the fast path
    assert keys.new_rows([b"c", b"a", b"c"]) == [True, False, False]    # held, and repeated in the batch
    keys.add([b"c"])                     # the current generation holds 2 = max_keys / 2: it retires
    assert all(k in keys for k in (b"a", b"b", b"c"))
    keys.add([b"d", b"e"])
    keys.add([b"f"])                     # {c, d, e} retires: {a, b} are forgotten
    assert b"a" not in keys and b"b" not in keys and all(k in keys for k in (b"c", b"e", b"f")) and len(keys) == 4
    now[0] = 10.0                        # the window has passed: {f} retires, {c, d, e} is forgotten
    keys.add([b"g"])
    assert b"c" not in keys and b"f" in keys and b"g" in keys and len(keys) == 2

def test_a_batch_resent_after_a_restart_is_not_written_again(collector_factory, data_dir):
    collector = collector_factory()
    assert collector.export(spans_request("r", 5, NOW_NS)).outcome.value == "ok"
    collector.stop()
    again = collector_factory()                                        # the keys come back from Parquet
    assert again.export(spans_request("r", 5, NOW_NS)).outcome.value == "ok"       # an exporter's retry
    assert again.export(spans_request("r", 3, NOW_NS, first_id=5)).outcome.value == "ok"  # 1 old, 2 new
    again.flush()
    assert raw_rows(data_dir) == 7 and len(ids(data_dir)) == 7
    assert again.metrics.snapshot()["spans_deduplicated_total"] == 5 + 1


def test_replay_of_segments_whose_parquet_was_committed_writes_nothing_twice(tmp_path):
    """A crash between a flush's Parquet commit and its WAL deletion, found at a start long after
    (the dedup window has passed, so only the files written since the segment count)."""
    data_dir = tmp_path / "data"
    collector = Collector(config(data_dir)).start()
    try:
        assert collector.export(spans_request("r", 6, NOW_NS)).outcome.value == "ok"
        collector._wal.rotate()                                        # what flush() does first
        saved = tmp_path / "wal-before-flush"
        shutil.copytree(data_dir / "wal", saved)                       # copy2: the segment keeps its mtime
        collector.flush()                                              # Parquet committed, segment deleted
    finally:
        collector.stop()
    assert raw_rows(data_dir) == 6
    shutil.rmtree(data_dir / "wal")
    shutil.copytree(saved, data_dir / "wal")                           # ... as if the deletion never happened
    restarted = Collector(config(data_dir, dedup_window_s=1e-6)).start()
    try:
        snapshot = restarted.metrics.snapshot()
        assert (snapshot["spans_replayed_total"], snapshot["spans_deduplicated_total"]) == (0, 6)
        assert not list((data_dir / "wal").glob("*.wal"))
    finally:
        restarted.stop()
    assert raw_rows(data_dir) == 6 and len(ids(data_dir)) == 6


def test_a_copy_older_than_the_window_is_written_and_compaction_merges_it_away(collector_factory, data_dir):
    collector = collector_factory(dedup_max_keys=2)                    # remembers at least the last key
    for first in (1, 2, 3):
        assert collector.export(spans_request("r", 1, NOW_NS, first_id=first)).outcome.value == "ok"
        collector.flush()
    assert collector.export(spans_request("r", 1, NOW_NS, first_id=1)).outcome.value == "ok"   # long forgotten
    collector.flush()
    assert raw_rows(data_dir) == 4                                     # the documented limit of the window
    collector.compact(grace_s=0)
    assert raw_rows(data_dir) == 3 and len(ids(data_dir)) == 3


def test_readers_follow_merged_file_notes_through_two_compactions_and_the_sweep(collector_factory, data_dir):
    collector = collector_factory()
    for k in range(3):
        assert collector.export(spans_request("r", 2, NOW_NS, first_id=1 + 2 * k)).outcome.value == "ok"
        collector.flush()
    expected = ids(data_dir)
    assert collector.compact(grace_s=3600) == 3                        # the replaced files stay on disk
    [partition] = [data_dir / "spans" / p for p in partitions(data_dir, "spans")]
    [first] = store.table_files(data_dir, "spans")
    assert len(parquet_files(data_dir)) == 4 and ids(data_dir) == expected   # read once, from the merged file
    for k in range(3, 5):
        assert collector.export(spans_request("r", 2, NOW_NS, first_id=1 + 2 * k)).outcome.value == "ok"
        collector.flush()
    assert collector.compact(grace_s=3600) == 3                        # the first merged file + 2 new ones
    [second] = store.table_files(data_dir, "spans")
    notes = {p.name: json.loads(p.read_text())["files"] for p in partition.glob("*" + store.SUPERSEDES_SUFFIX)}
    assert len(notes) == 2 and first.name in notes[second.stem + store.SUPERSEDES_SUFFIX]
    assert set(notes[first.stem + store.SUPERSEDES_SUFFIX]) < set(notes[second.stem + store.SUPERSEDES_SUFFIX])
    assert len(parquet_files(data_dir)) == 7 and len(ids(data_dir)) == 10
    # a note whose merged file never appeared (a crash before its rename) hides nothing
    (partition / ("part-crashed" + store.SUPERSEDES_SUFFIX)).write_text(json.dumps({"files": [second.name]}))
    assert store.table_files(data_dir, "spans") == [second]
    assert compact.sweep(data_dir, "spans", grace_s=0) == 6            # the whole chain, notes included
    assert parquet_files(data_dir) == [second] and not list(partition.glob("*" + store.SUPERSEDES_SUFFIX))
    assert len(ids(data_dir)) == 10 and raw_rows(data_dir) == 10


@pytest.mark.parametrize("field, value", [("dedup_window_s", 0), ("dedup_window_s", float("nan")),
                                          ("dedup_max_keys", 1), ("dedup_max_keys", 2.5)])
def test_bad_dedup_settings_fail_naming_the_field(tmp_path, field, value):
    with pytest.raises(ConfigError, match=field):
        config(tmp_path, **{field: value})


def test_a_flush_in_chunks_releases_queue_bytes_as_it_goes_and_resumes_after_a_failure(
        collector_factory, data_dir, monkeypatch):
    from lightspan.collector import writer

    collector = collector_factory()
    for k in range(3):
        assert collector.export(spans_request("r", 2, NOW_NS, first_id=1 + 2 * k)).outcome.value == "ok"
    per_request = collector.queue_bytes // 3
    monkeypatch.setattr(writer, "_FLUSH_CHUNK_BYTES", per_request)     # one request per chunk
    real_write, calls = store.write_table, []

    def failing_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(store, "write_table", failing_second)
    with pytest.raises(OSError):
        collector.flush()
    assert collector.queue_bytes == 2 * per_request                    # the first chunk is in Parquet
    assert raw_rows(data_dir) == 2 and list((data_dir / "wal").glob("*.wal"))   # the WAL stays
    assert collector.flush() == 4                                      # the rest, once
    assert collector.queue_bytes == 0 and raw_rows(data_dir) == 6 and len(ids(data_dir)) == 6
    assert not list((data_dir / "wal").glob("*.wal"))
