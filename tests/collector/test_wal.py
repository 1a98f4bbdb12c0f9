"""collector/wal.py: records survive, torn tails end a segment cleanly, group commit."""

from __future__ import annotations

import struct
import threading
import zlib

import pytest

from lightspan.collector.wal import WAL, read_segment


def segment_files(wal: WAL):
    return sorted(wal.directory.glob("*.wal"))


def test_append_rotate_replay_delete(tmp_path):
    wal = WAL(tmp_path / "wal")
    assert wal.rotate() == []                      # nothing written: no segment
    wal.append(b"one")
    wal.append(b"")
    [first] = wal.rotate()
    wal.append(b"three")
    assert wal.closed_segment_ids() == [first]     # the active segment is not replayed
    assert list(wal.replay()) == [b"one", b""]
    [second] = wal.rotate()
    assert second > first
    assert list(wal.replay()) == [b"one", b"", b"three"]
    assert wal.size_bytes == sum(p.stat().st_size for p in segment_files(wal)) == 3 * 8 + 3 + 5
    wal.delete([first])
    assert list(wal.replay()) == [b"three"] and wal.size_bytes == 8 + 5
    wal.delete([second, 12345])                    # unknown ids are ignored
    assert segment_files(wal) == [] and wal.size_bytes == 0


def test_reopen_starts_a_new_segment_after_existing_ones(tmp_path):
    wal = WAL(tmp_path)
    wal.append(b"a")
    wal.close()
    again = WAL(tmp_path)
    assert again.size_bytes == 9
    again.append(b"b")
    assert list(again.replay()) == [b"a"]          # the new active segment is not closed yet
    again.close()
    assert list(WAL(tmp_path).replay()) == [b"a", b"b"]


def test_torn_tail_ends_its_segment_and_replay_continues(tmp_path, caplog):
    wal = WAL(tmp_path)
    for payload in (b"first", b"second", b"third"):
        wal.append(payload)
    wal.close()
    [path] = segment_files(wal)
    path.write_bytes(path.read_bytes()[:-2])       # a crash in the middle of the last write
    after = WAL(tmp_path)
    after.append(b"after the crash")
    after.close()
    assert list(after.replay()) == [b"first", b"second", b"after the crash"]
    assert "torn or corrupt" in caplog.text


@pytest.mark.parametrize("damage", ["crc", "huge_length", "half_header"])
def test_corrupt_record_stops_the_segment(tmp_path, damage):
    path = tmp_path / "seg.wal"
    good = struct.pack("<II", 2, zlib.crc32(b"ok")) + b"ok"
    if damage == "crc":
        bad = struct.pack("<II", 3, zlib.crc32(b"bad") ^ 1) + b"bad" + good
    elif damage == "huge_length":
        bad = struct.pack("<II", 1 << 31, 0) + b"xx"
    else:
        bad = b"\x05\x00\x00"
    path.write_bytes(good + bad)
    assert list(read_segment(path)) == [b"ok"]


def test_concurrent_appends_all_replay_and_share_fsyncs(tmp_path):
    wal = WAL(tmp_path)
    payloads = [f"{t}-{i}".encode() * 50 for t in range(4) for i in range(25)]

    def worker(t):
        for i in range(25):
            wal.append(f"{t}-{i}".encode() * 50)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    wal.close()
    assert sorted(wal.replay()) == sorted(payloads)
    assert 1 <= wal.fsync_count <= len(payloads) + 1 and wal.fsync_seconds > 0


def test_sync_after_rotate_needs_no_fd_and_closed_wal_refuses(tmp_path):
    wal = WAL(tmp_path)
    position = wal.write(b"x")
    [segment] = wal.rotate()                       # rotate fsyncs what was written
    wal.sync(position)
    count = wal.fsync_count
    wal.sync(position)
    assert wal.fsync_count == count
    wal.write(b"y")
    with pytest.raises(ValueError, match="active"):
        wal.delete([segment + 1])
    wal.close()
    with pytest.raises(RuntimeError, match="closed"):
        wal.append(b"z")
