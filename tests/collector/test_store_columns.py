"""The views keep every schema column even over files written before a column existed."""

import pyarrow as pa

from lightspan import store


def test_files_that_predate_a_column_read_it_as_null(tmp_path):
    old = store.TRANSITION_SCHEMA.remove(store.TRANSITION_SCHEMA.get_field_index("advantage"))
    row = {name: None for name in old.names}
    row.update(transition_id="r1/s1", rollout_id="r1", created_unix_nano=1)
    (tmp_path / "transitions").mkdir()
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([row], schema=old), tmp_path / "transitions" / "part-old.parquet")
    con = store.connect(tmp_path)
    cols = [r[0] for r in con.execute("DESCRIBE transitions").fetchall()]
    assert set(store.TRANSITION_SCHEMA.names) <= set(cols)
    assert con.execute("SELECT transition_id, advantage FROM transitions").fetchall() == [("r1/s1", None)]


def test_a_read_is_repeated_when_a_globbed_file_vanished(tmp_path):
    """Compaction removes files a reader's glob may have just listed: the read runs again."""
    import duckdb
    import pytest

    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise duckdb.IOException('IO Error: Cannot open file "x.parquet": No such file or directory')
        return "read"

    assert store.retry_vanished(flaky) == "read" and len(calls) == 3

    def broken():
        raise duckdb.IOException("IO Error: permission denied")

    with pytest.raises(duckdb.IOException):
        store.retry_vanished(broken)


def test_a_read_is_repeated_when_a_file_of_its_listing_vanished(tmp_path):
    """A connection's views read the files listed when it opened: one removed since (expired, or
    swept after compaction) fails the read with DuckDB's "No files found", and the read runs again."""
    import pyarrow as pa

    rows = [{"trace_id": f"{i:032x}", "span_id": f"{i:016x}", "name": "s", "start_time_unix_nano": 0,
             "received_unix_nano": 0} for i in range(1, 3)]
    paths = [store.write_table(tmp_path, "spans", pa.Table.from_pylist([row], schema=store.SPAN_SCHEMA),
                               partition="date=1970-01-01") for row in rows]
    attempts = []

    def count():
        con = store.connect(tmp_path)
        try:
            attempts.append(1)
            if len(attempts) == 1:
                paths[0].unlink()                       # gone after the listing, before the read
            return con.execute("SELECT count(*) FROM spans").fetchone()[0]
        finally:
            con.close()

    assert store.retry_vanished(count) == 1 and len(attempts) == 2
