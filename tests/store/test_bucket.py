"""The store in an S3-compatible bucket (a real S3-API server on loopback, tests/s3server.py): the
same views as over a directory, compaction's notes and retention's marker honoured, several
collectors' trees deduplicated, policy.json in the bucket, and no silent fallback to local disk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightspan import store
from lightspan.store import objects

QUERIES = [
    "SELECT count(*), count(DISTINCT rollout_id), sum(output_tokens) FROM spans",
    "SELECT rollout_key, num_spans, final_reward, status FROM rollouts ORDER BY 1",
    "SELECT task_id, avg(reward) FROM rewards GROUP BY 1 ORDER BY 1",
    "SELECT count(*) FROM spans WHERE temperature IS NULL",
    "SELECT count(*), sum(advantage) FROM transitions",
]


def spans(first: int, n: int, *, day_ns: int = 1_764_460_800 * 10**9) -> pa.Table:
    rows = [{"trace_id": f"{i // 4:032x}", "span_id": f"{i:016x}", "name": "chat" if i % 4 else "reward",
             "rollout_id": f"r{i // 4}", "task_id": f"t{i // 8}", "start_time_unix_nano": day_ns + i,
             "end_time_unix_nano": day_ns + i + 10, "operation_name": "chat" if i % 4 else None,
             "output_tokens": i, "reward": float(i % 3) if i % 4 == 0 else None, "temperature": 0.7,
             "received_unix_nano": day_ns + 10**9 + i} for i in range(first, first + n)]
    return pa.Table.from_pylist(rows, schema=store.SPAN_SCHEMA)


def fill(location, prefix: str = "") -> None:
    """The same rows into ``location``: 3 span files over 2 dates (one written before the
    temperature column existed) and a transitions file."""
    store.write_table(location, "spans", spans(0, 40), partition=f"{prefix}date=2025-11-30")
    store.write_table(location, "spans", spans(40, 40), partition=f"{prefix}date=2025-11-30")
    older = spans(80, 20, day_ns=1_764_547_200 * 10**9).drop(["temperature"])
    sink = pa.BufferOutputStream()
    pq.write_table(older, sink)                  # as written before the column existed (no cast)
    store.Location.of(location).put_bytes(f"spans/{prefix}date=2025-12-01/part-older.parquet", sink.getvalue())
    transitions = pa.Table.from_pylist([{"transition_id": f"r{i}/c", "rollout_id": f"r{i}", "advantage": i * 0.5}
                                        for i in range(5)], schema=store.TRANSITION_SCHEMA)
    store.write_table(location, "transitions", transitions)


def answers(location) -> list:
    con = store.connect(location)
    try:
        return [con.execute(q).fetchall() for q in QUERIES]
    finally:
        con.close()


def test_the_views_over_a_bucket_answer_as_over_a_directory(bucket, tmp_path):
    remote = f"{bucket}/lightspan"
    fill(tmp_path)
    fill(remote, prefix="collector=a/")
    got = answers(remote)
    assert got == answers(tmp_path)
    assert got[0][0][0] == 100 and got[3] == [(20,)]          # the older file's temperature reads as null
    assert all(f.startswith(f"{remote}/spans/collector=a/date=") for f in store.table_files(remote, "spans"))


def test_readers_follow_compaction_notes_and_retention_markers(bucket):
    remote = f"{bucket}/p"
    where = store.Location.of(remote)
    partition = "spans/collector=a/date=2025-11-30"
    first = store.write_table(remote, "spans", spans(0, 10), partition="collector=a/date=2025-11-30")
    second = store.write_table(remote, "spans", spans(10, 10), partition="collector=a/date=2025-11-30")
    count = lambda: answers(remote)[0][0][0]  # noqa: E731
    assert count() == 20
    # the note first: without its merged file readers ignore it
    note = f"{partition}/part-merged{store.SUPERSEDES_SUFFIX}"
    where.put_bytes(note, json.dumps({"files": [first.rsplit("/", 1)[1], second.rsplit("/", 1)[1]]}).encode())
    assert sorted(store.table_files(remote, "spans")) == sorted([first, second])
    # the merged object is the moment readers switch to it
    merged = store.write_table(remote, "spans", spans(0, 20), partition="collector=a/date=2025-11-30")
    where.delete([where.key(merged)])
    sink = pa.BufferOutputStream()
    pq.write_table(spans(0, 20), sink)
    where.put_bytes(f"{partition}/part-merged.parquet", sink.getvalue())
    assert store.table_files(remote, "spans") == [where.name(f"{partition}/part-merged.parquet")]
    assert count() == 20
    # an expiry marker hides the whole partition at once
    where.put_bytes(f"{partition}/{store.files.EXPIRED_MARKER}", b"")
    assert store.table_files(remote, "spans") == [] and count() == 0


def test_several_collectors_in_one_bucket_read_as_one_store_without_duplicates(bucket):
    remote = f"{bucket}/shared"
    store.write_table(remote, "spans", spans(0, 20), partition="collector=a/date=2025-11-30")
    assert answers(remote)[0][0][0] == 20
    # a batch retried to another collector: its spans are in both trees
    store.write_table(remote, "spans", spans(10, 20), partition="collector=b/date=2025-11-30")
    assert answers(remote)[0][0][:2] == (30, 8)


def test_policy_json_lives_in_the_bucket(bucket, tmp_path):
    remote = f"{bucket}/lightspan"
    assert store.policy.read(remote) is None and store.policy.served_version(remote) == 0
    store.policy.write(remote, 3, tmp_path)
    published = store.policy.read(remote)
    assert (published.version, published.path) == (3, str(tmp_path.resolve()))
    assert store.policy.path(remote) == f"{remote}/policy.json"
    assert json.loads(store.Location.of(remote).read_bytes("policy.json"))["version"] == 3
    # several policies: each named entry is published beside the others', in the one object
    store.policy.write(remote, 2, tmp_path / "w2", name="writer")
    store.policy.write(remote, 5, tmp_path / "c5", name="checker")
    assert store.policy.served_versions(remote) == {"writer": 2, "checker": 5}
    assert store.policy.read(remote, "writer").path == str((tmp_path / "w2").resolve())


def test_a_bucket_location_never_falls_back_to_local_disk(s3_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert store.data_dir("s3://somebucket/prefix/") == "s3://somebucket/prefix"
    with socket_closed() as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        with pytest.raises(OSError, match="s3://somebucket/prefix"):
            store.connect("s3://somebucket/prefix")
        with pytest.raises(OSError, match="somebucket"):
            store.write_table("s3://somebucket/prefix", "transitions", store.TRANSITION_SCHEMA.empty_table())
    assert list(Path(tmp_path).iterdir()) == []                # nothing was written here instead


def test_the_endpoint_comes_from_the_standard_aws_settings(tmp_path, monkeypatch):
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "config"
    config.write_text("[default]\nregion = us-east-1\n\n[profile minio]\ns3 =\n    endpoint_url = http://minio:9000\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    assert objects.endpoint() == ""
    monkeypatch.setenv("AWS_PROFILE", "minio")
    assert objects.endpoint() == "http://minio:9000"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://a:1")
    assert objects.endpoint() == "http://a:1"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://b:2")
    assert objects.endpoint() == "http://b:2"


class socket_closed:
    """An endpoint on loopback where nothing listens."""

    def __enter__(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        return None


if os.environ.get("LIGHTSPAN_SKIP_S3"):
    pytestmark = pytest.mark.skip("LIGHTSPAN_SKIP_S3 is set")


def test_lightspan_sql_and_status_read_the_bucket(bucket, tmp_path):
    import subprocess
    import sys

    from lightspan.dashboards.status import data_summary

    remote = f"{bucket}/lightspan"
    fill(remote, prefix="collector=a/")
    out = subprocess.run([sys.executable, "-m", "lightspan.cli", "sql", "--data-dir", remote,
                          "SELECT count(*) AS n FROM spans"], capture_output=True, text=True, timeout=120,
                         env={**os.environ}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "100" in out.stdout
    summary = data_summary(store.data_dir(remote))
    assert (summary["data_dir"], summary["spans"], summary["transitions"]) == (remote, 100, 5)
    assert summary["disk_bytes"]["spans"] > 0 and summary["disk_bytes"]["total"] >= summary["disk_bytes"]["spans"]
    assert list(Path(tmp_path).iterdir()) == []


def test_a_read_is_repeated_when_an_object_of_its_listing_vanished(bucket):
    remote = f"{bucket}/p"
    for first in (0, 10):
        store.write_table(remote, "spans", spans(first, 10), partition="collector=a/date=2025-11-30")
    calls = []

    def read():
        con = store.connect(remote)
        calls.append(1)
        if len(calls) == 1:           # compaction's sweep removes an object the listing named
            where = store.Location.of(remote)
            where.delete([where.key(store.table_files(remote, "spans")[0])])
        return con.execute("SELECT count(*) FROM spans").fetchall()[0][0]

    assert store.retry_vanished(read) == 10 and len(calls) == 2


def test_credentials_and_endpoint_come_from_the_aws_config_files(tmp_path):
    """No AWS_* variable but the files' paths and the profile: the SDK inside pyarrow signs with the
    credentials file's key (a server of its own that checks signatures; a wrong secret is refused)."""
    import subprocess
    import sys

    import boto3
    import requests

    from tests.s3server import S3Server

    server = S3Server(tmp_path / "s3.log").start()
    try:
        setup = dict(endpoint_url=server.endpoint, region_name="us-east-1", aws_access_key_id="setup",
                     aws_secret_access_key="setup")
        iam = boto3.client("iam", **setup)
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        boto3.client("s3", **setup).create_bucket(Bucket="creds")
        # from here on moto checks every request's signature against its IAM users' keys
        assert requests.post(f"{server.endpoint}/moto-api/reset-auth", data=b"0", timeout=10).status_code == 200
        code = ("from lightspan import store; from tests.store.test_bucket import spans; "
                "store.write_table('s3://creds/p', 'spans', spans(0, 8), partition='collector=a/date=2025-11-30'); "
                "print(store.connect('s3://creds/p').execute('SELECT count(*) FROM spans').fetchall()[0][0])")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "credentials"), AWS_CONFIG_FILE=str(tmp_path / "config"),
                   AWS_PROFILE="lab", AWS_EC2_METADATA_DISABLED="true")
        (tmp_path / "config").write_text(f"[profile lab]\nregion = us-east-1\nendpoint_url = {server.endpoint}\n")
        results = {}
        for secret in (key["SecretAccessKey"], "not-the-secret"):
            (tmp_path / "credentials").write_text(
                f"[lab]\naws_access_key_id = {key['AccessKeyId']}\naws_secret_access_key = {secret}\n")
            results[secret] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                             timeout=120, cwd=Path(__file__).parents[2])
        good, bad = results.values()
        assert good.returncode == 0 and good.stdout.split() == ["8"], good.stderr[-2000:]
        assert bad.returncode != 0 and "SIGNATURE_DOES_NOT_MATCH" in bad.stderr and "s3://creds/p" in bad.stderr
    finally:
        server.stop()


def test_an_endpoint_url_s_credentials_are_never_printed(tmp_path):
    """``AWS_ENDPOINT_URL=http://user:secret@host`` was echoed whole in the collector's start-up
    error; now every message that shows a URL shows ``http://***@host`` (lightspan.core.config.redact),
    and says that credentials in the URL are not read."""
    import subprocess
    import sys

    with socket_closed() as endpoint:
        leaky = endpoint.replace("http://", "http://AKIAEXAMPLE:s3cr3t/k+ey@")
        env = {**os.environ, "AWS_ENDPOINT_URL": leaky, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
        out = subprocess.run([sys.executable, "-m", "lightspan.cli", "collector", "--data-dir", "s3://no-bucket/p",
                              "--wal-dir", str(tmp_path / "wal"), "--grpc-port", "0", "--http-port", "0",
                              "--api-port", "0"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr[-3000:]                  # one line, no traceback
    assert "s3cr3t" not in out.stderr and "AKIAEXAMPLE" not in out.stderr, lines[0]
    host = endpoint.removeprefix("http://")
    assert f"http://***@{host}" in lines[0] and "s3://no-bucket/p" in lines[0], lines[0]
    assert "AWS_SECRET_ACCESS_KEY" in lines[0]                   # and how to give them instead
    from lightspan.core.config import ConfigError
    from lightspan.rollout.gateway_config import GatewayConfig
    with pytest.raises(ConfigError) as err:                      # a config error shows none either
        GatewayConfig(upstream="ftp://admin:hunter2@vllm:8000")
    assert "hunter2" not in str(err.value) and "ftp://***@vllm:8000" in str(err.value)


def test_with_the_bucket_down_sql_and_rewards_say_so(tmp_path):
    """With the bucket gone, ``/v1/sql`` answered "the query's worker died: it needed more than
    sql_memory_limit_bytes" (the worker died of the listing's OSError) and a reward post 500: both
    are 503 + Retry-After naming the store and its endpoint."""
    import requests

    from lightspan.collector.server import Collector
    from tests.collector.helpers import config
    from tests.s3server import S3Server, aws_environment

    server = S3Server(tmp_path / "s3.log").start()
    try:
        with aws_environment(server.env):
            remote = f"{server.create_bucket('bucket-down')}/p"
            collector = Collector(config(remote, wal_dir=str(tmp_path / "wal"), collector_id="c1")).start()
            try:
                api = f"http://127.0.0.1:{collector.api_port}"
                ok = requests.post(f"{api}/v1/sql", json={"sql": "SELECT count(*) FROM spans"}, timeout=60)
                assert ok.status_code == 200 and ok.json()["rows"] == [[0]], ok.text[:300]
                server.stop()
                down = requests.post(f"{api}/v1/sql", json={"sql": "SELECT count(*) FROM spans"}, timeout=60)
                assert down.status_code == 503 and down.headers.get("Retry-After"), down.text[:500]
                message = down.json()["error"]
                assert "cannot be reached" in message and "s3://bucket-down/p" in message, message
                assert server.endpoint in message and "memory" not in message, message
                reward = requests.post(f"{api}/v1/rewards", json={"rollout_id": "r", "value": 1.0}, timeout=60)
                assert reward.status_code == 503 and "cannot be reached" in reward.json()["error"], reward.text[:500]
            finally:
                collector.stop()
    finally:
        server.stop()
