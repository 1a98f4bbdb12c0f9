"""The transition builder over a store in an S3-compatible bucket (a real S3-API server on loopback,
tests/s3server.py): the same transitions as over a directory, written back into the bucket, an
incremental build's watermark kept there too."""

from __future__ import annotations

import pyarrow as pa

from lightspan import store
from lightspan.lightningrl import builder
from lightspan.lightningrl.config import TransitionsConfig
from tests.lightningrl.helpers import NOW, build, episode


def test_the_builder_reads_spans_from_a_bucket_and_writes_transitions_there(bucket, tmp_path):
    remote = f"{bucket}/lightspan"
    rows = episode("a", 1.0, calls=2) + episode("b", 0.0) + episode("c", 0.5)
    table = pa.Table.from_pylist(rows, schema=store.SPAN_SCHEMA)
    store.write_table(tmp_path, "spans", table, partition="date=2026-11-30")
    # two collectors' prefixes, one span of rollout a in both (a batch retried to the other collector)
    store.write_table(remote, "spans", table.slice(0, 4), partition="collector=a/date=2026-11-30")
    store.write_table(remote, "spans", table.slice(3), partition="collector=b/date=2026-11-30")

    local, local_metrics = build(tmp_path)
    remote_table, remote_metrics = build(remote)
    key = lambda t: sorted(t.drop(["build_id", "created_unix_nano"]).to_pylist(), key=lambda r: r["transition_id"])  # noqa: E731
    assert key(remote_table) == key(local) and local.num_rows == 4
    assert remote_metrics["transitions/duplicate_spans"] == 1 and local_metrics["transitions/duplicate_spans"] == 0

    config = TransitionsConfig(data_dir=remote)
    first = builder.run(config, now_unix_nano=NOW)
    assert first["transitions/rollouts"] == 3
    assert builder.run(config, now_unix_nano=NOW)["transitions/rollouts"] == 0      # the watermark, in the bucket
    con = store.connect(remote)
    assert con.execute("SELECT count(*), count(DISTINCT rollout_id) FROM transitions").fetchall() == [(4, 3)]
    assert store.Location.of(remote).read_text("lightningrl/state.json").startswith("{")
