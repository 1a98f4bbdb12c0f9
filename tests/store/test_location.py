"""One location type (store/location.py): a directory and a prefix in a bucket (a real S3-API server on
loopback, tests/s3server.py) answer every operation the same way, by the same keys."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from lightspan import store
from lightspan.store.location import Location


@pytest.fixture(params=["disk", "bucket"])
def where(request, tmp_path) -> Location:
    if request.param == "disk":
        return Location.of(tmp_path / "data")
    return Location.of(f"{request.getfixturevalue('bucket')}/lightspan")


def keys(where: Location, key: str = "") -> list[str]:
    return [e.key for e in where.list(key)]


def test_put_read_list_and_delete_by_key(where):
    assert where.list() == [] and where.list("spans") == []
    where.put_bytes("spans/date=2025-11-30/part-a.parquet", b"x" * 10)
    where.put_text("policy.json", '{"version": 1}\n')
    where.put_bytes("spans/date=2025-11-30/part-a.parquet", b"y" * 12)      # replaced whole
    assert keys(where) == ["policy.json", "spans/date=2025-11-30/part-a.parquet"]   # no temporary file left
    [entry] = where.list("spans")
    assert (entry.key, entry.size) == ("spans/date=2025-11-30/part-a.parquet", 12) and entry.mtime > 0
    assert where.read_bytes(entry.key) == b"y" * 12 and json.loads(where.read_text("policy.json")) == {"version": 1}
    assert where.key(where.name(entry.key)) == entry.key
    with pytest.raises(FileNotFoundError):
        where.read_bytes("spans/nothing.parquet")
    where.delete(["policy.json", "policy.json", "never-there"])             # gone already: no error
    assert keys(where) == ["spans/date=2025-11-30/part-a.parquet"]


def test_a_put_file_is_in_place_whole_or_not_at_all(where, tmp_path):
    with where.put_file("t/part-1.parquet", tmp_path / "scratch") as tmp:
        assert keys(where, "t") == []                                      # nothing visible while written
        with open(tmp, "wb") as fh:
            fh.write(b"z" * 100)
    assert where.read_bytes("t/part-1.parquet") == b"z" * 100
    with pytest.raises(RuntimeError), where.put_file("t/part-2.parquet", tmp_path / "scratch") as tmp:
        with open(tmp, "wb") as fh:
            fh.write(b"half")
        raise RuntimeError("the writer failed")
    assert keys(where, "t") == ["t/part-1.parquet"]
    assert not [p for p in (tmp_path / "scratch").glob("*") if p.is_file()]  # no temporary file left


def test_remove_tree_takes_a_whole_directory_and_create_keeps_the_first(where):
    for name in ("a", "b"):
        where.put_bytes(f"spans/date=2020-01-01/part-{name}.parquet", b"1")
    where.put_bytes("spans/date=2020-01-02/part-c.parquet", b"2")
    where.remove_tree("spans/date=2020-01-01", marker=".expired")
    assert keys(where, "spans") == ["spans/date=2020-01-02/part-c.parquet"]
    where.create("secret.key", b"first\n")
    assert where.read_bytes("secret.key") == b"first\n"
    with where.lock("policy.json.lock"):
        where.put_text("policy.json", "{}")


def test_on_disk_the_first_writer_wins_links_are_not_followed_and_renames_are_atomic(tmp_path):
    where = Location.of(tmp_path)
    where.create("secret.key", b"first\n")
    where.create("secret.key", b"second\n")
    assert where.read_bytes("secret.key") == b"first\n"
    assert stat.S_IMODE(os.stat(tmp_path / "secret.key").st_mode) == 0o600
    (tmp_path / "spans").mkdir()
    os.symlink("/", tmp_path / "spans" / "root")                 # a listing never walks into /
    os.symlink("/etc/hostname", tmp_path / "spans" / "file-link")
    assert keys(where, "spans") == ["spans/file-link"]
    assert [e.key for e in where.list("spans", dirs=True)] == ["spans/file-link"]
    (tmp_path / "spans" / "date=x").mkdir()
    assert [e.key for e in where.list("spans", dirs=True) if e.is_dir] == ["spans/date=x"]   # an empty one too
    where.remove_tree("spans/date=x", marker=".expired")
    assert not (tmp_path / "spans" / "date=x").exists() and (tmp_path / ".trash").is_dir()
    assert where.local("wal") == tmp_path / "wal" and where.exists() and where.mtime_slack_s == 0


def test_a_bucket_names_objects_by_url_and_has_no_local_directory(bucket):
    where = Location.of(f"{bucket}/p/")
    assert str(where) == f"{bucket}/p" and where.name("spans", "x") == f"{bucket}/p/spans/x"
    assert where.local() is None and where.local("wal") is None and where.exists()
    assert where.mtime_slack_s > 0 and store.Location.of(where) is where
    assert store.data_dir(where) == f"{bucket}/p"


# whether a data location is a directory or a bucket is asked only in store/; everywhere else a
# location is listed, read, put and deleted the same way, or asked for a local directory (Location.local)
_ASKS_REMOTE = re.compile(r"\bis_remote\(|startswith\(\s*[(]?\s*[\"']s3:|[\"']s3://[\"']|lightspan\.store\.objects"
                          r"|from lightspan\.store import [^\n]*\bobjects\b")
_PARTS = ("core", "collector", "tracing", "rollout", "lightningrl", "trainer", "dashboards", "lightspan")


def test_nothing_outside_the_store_asks_whether_a_location_is_a_bucket():
    root = Path(__file__).resolve().parents[2]
    asking = [f"{path.relative_to(root)}:{n}: {line.strip()}" for part in _PARTS for path in sorted((root / part).rglob("*.py"))
              for n, line in enumerate(path.read_text().splitlines(), 1) if _ASKS_REMOTE.search(line)]
    assert not asking, "\n".join(asking)
    assert {p.name for p in root.iterdir() if (p / "__init__.py").is_file()} - {"tests", "examples"} == {*_PARTS, "store"}
    assert _ASKS_REMOTE.search("if store.is_remote(self.data_dir):") and _ASKS_REMOTE.search('x.startswith("s3://")')
    assert _ASKS_REMOTE.search("from lightspan.store import layout, objects")
    assert not _ASKS_REMOTE.search("record['pr'] = parent.is_remote")     # an OpenTelemetry span context's
