"""Collectors writing into an S3-compatible bucket (a real S3-API server on loopback,
tests/s3server.py): two collectors into one bucket under load, each killed with SIGKILL, then every
acknowledged span present once; a batch retried to the other collector stored once; compaction,
the sweep and retention inside a collector's own prefix; an unreachable bucket answered with
retryable refusals, nothing acknowledged lost."""

from __future__ import annotations

import random
import threading
import time

import grpc
import requests

from lightspan import store
from lightspan.collector.server import EXPORT_METHOD
from tests.collector.helpers import config, query, wait_for
from tests.collector.process import CollectorProcess
from tests.collector.test_compact import DAY_NS, NOW_NS, SNAPSHOT, spans_request
from tests.collector.test_crash import Ledger, batch, sender_loop
from tests.s3server import S3Server, aws_environment

ROUNDS = 3                           # kills per collector
SENDERS = {"a": (("grpc", 0), ("http", 1)), "b": (("grpc", 2), ("http", 3))}


def test_a_collector_in_a_bucket_compacts_sweeps_and_expires_only_its_prefix(bucket, tmp_path, collector_factory):
    location = f"{bucket}/lightspan"
    other = store.write_table(location, "spans", store.SPAN_SCHEMA.empty_table(),
                              partition="collector=other/date=2020-01-01")   # another collector's file
    collector = collector_factory(data_dir=location, wal_dir=str(tmp_path / "wal"), collector_id="a",
                                  retention_days=2)
    for k, rollout in enumerate("cab"):
        assert collector.export(spans_request(rollout, 5, NOW_NS, first_id=1 + 10 * k)).outcome.value == "ok"
        collector.flush()
    assert collector.export(spans_request("old", 3, NOW_NS - 10 * DAY_NS, first_id=100)).outcome.value == "ok"
    collector.flush()
    prefix, where = "spans/collector=a", store.Location.of(location)
    files = store.table_files(location, "spans")
    assert len(files) == 5 and all(f.startswith(f"{location}/{prefix}/") for f in files if f != other)
    before = query(location, SNAPSHOT)
    assert len(before) == 18
    assert collector.compact(min_files=2, grace_s=3600) == 3      # today's three files, into one
    assert query(location, SNAPSHOT) == before                   # readers switched at once, nothing twice
    live = [f for f in store.table_files(location, "spans") if f != other]
    assert len(live) == 2
    assert len([e for e in where.list(prefix) if e.key.endswith(".parquet")]) == 5   # kept for the grace
    collector.writer._sweep(0.0)
    assert sorted(where.name(e.key) for e in where.list(prefix) if e.key.endswith(".parquet")) == sorted(live)
    assert not [e for e in where.list(prefix) if e.key.endswith(store.SUPERSEDES_SUFFIX)]
    assert collector.expire() == ["spans/date=" + time.strftime("%Y-%m-%d", time.gmtime((NOW_NS - 10 * DAY_NS) / 1e9))]
    assert len(query(location, SNAPSHOT)) == 15
    assert other in store.table_files(location, "spans")          # never touched
    rows = requests.post(f"http://127.0.0.1:{collector.api_port}/v1/sql", json={"sql": "SELECT count(*) FROM spans"},
                         timeout=30).json()["rows"]
    assert rows == [[15]]                                         # the API's SQL reads the bucket too
    assert not (tmp_path / "data").exists()                      # nothing went to a local data directory


def test_two_collectors_into_one_bucket_killed_under_load_store_every_acknowledged_span_once(bucket, tmp_path):
    rng = random.Random(20261201)
    location = f"{bucket}/lightspan"
    services = {cid: CollectorProcess(location, tmp_path / f"{cid}.log", wal_dir=tmp_path / f"wal-{cid}",
                                      collector_id=cid, flush_interval_s=0.05, compact_min_files=3)
                for cid in SENDERS}
    ledger, seqs = Ledger(), {sender: 0 for senders in SENDERS.values() for _, sender in senders}
    for _ in range(ROUNDS):
        for service in services.values():
            service.start()
        stop = threading.Event()
        threads = [threading.Thread(target=sender_loop, args=(t, s, services[cid], ledger, stop, seqs,
                                                              random.Random(rng.random())))
                   for cid, senders in SENDERS.items() for t, s in senders]
        for thread in threads:
            thread.start()
        with ledger.lock:
            target = ledger.acked_requests + rng.randint(10, 40)
        wait_for(lambda target=target: ledger.acked_requests >= target, timeout=120, what=f"{target} acknowledged")
        for cid in rng.sample(sorted(services), 2):                   # both, mid-load, in a random order
            services[cid].kill()
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    # an exporter that timed out on collector a retries the same batch to collector b
    payload, ids = batch(9, 1, 5)
    for service in services.values():
        service.start()
        with grpc.insecure_channel(service.grpc_target) as channel:
            channel.unary_unary(EXPORT_METHOD)(payload, timeout=10)
    ledger.acked.update(ids)
    for service in services.values():
        assert service.stop() == 0
    assert ledger.unexpected == []
    assert len(ledger.acked) >= ROUNDS * 10
    stored = query(location, "SELECT trace_id, span_id, name FROM spans")
    by_key = {(t, s): name for t, s, name in stored}
    assert len(by_key) == len(stored)                                  # each span once in the view
    missing = set(ledger.acked) - set(by_key)
    assert not missing, f"{len(missing)} acknowledged spans lost, e.g. {sorted(missing)[:3]}"
    assert all(by_key[key] == name for key, name in ledger.acked.items())
    trees = {f.split("/spans/", 1)[1].split("/", 1)[0] for f in store.table_files(location, "spans")}
    assert trees == {"collector=a", "collector=b"}
    assert not [p for cid in services for p in (tmp_path / f"wal-{cid}").glob("*.wal")]


def test_an_unreachable_bucket_gets_retryable_refusals_and_loses_nothing_acknowledged(s3_server, tmp_path):
    # a server of its own: it is stopped (and comes back empty) in this test
    server = S3Server(tmp_path / "s3.log").start()
    env = dict(server.env)
    try:
        location = server.create_bucket("outage") + "/lightspan"
        service = CollectorProcess(location, tmp_path / "collector.log", env=env, wal_dir=tmp_path / "wal",
                                   collector_id="a", flush_interval_s=0.05, max_queue_bytes=4096)
        service.start()
        server.stop()                                                  # the bucket is gone
        acked, refused, seq = {}, [], 0
        session = requests.Session()
        while not refused and seq < 500:
            seq += 1
            payload, ids = batch(1, seq, 4)
            response = session.post(service.url("http", "/v1/traces"), data=payload, timeout=30,
                                    headers={"Content-Type": "application/x-protobuf"})
            if response.status_code == 200:
                acked.update(ids)
            else:
                refused.append(response)
        assert acked and refused, (len(acked), len(refused))
        assert refused[0].status_code == 503 and refused[0].headers.get("Retry-After")
        wait_for(lambda: "flush_errors_total 0" not in session.get(service.url("api", "/metrics"), timeout=10).text,
                 timeout=60, what="a failed flush")
        again = session.post(service.url("http", "/v1/traces"), data=batch(1, seq + 1, 4)[0], timeout=30,
                             headers={"Content-Type": "application/x-protobuf"})
        assert again.status_code == 503 and b"the last flush failed" in again.content
        service.kill()                                                 # what was acknowledged is in the WAL only
        server.start()
        server.create_bucket("outage")
        service.start()                                                # the WAL replays into the bucket
        assert service.stop() == 0
        with aws_environment(env):
            stored = query(location, "SELECT trace_id, span_id, name FROM spans")
        assert {(t, s): n for t, s, n in stored} == acked and len(stored) == len(acked)
    finally:
        server.stop()


def test_a_collector_refuses_to_start_when_its_bucket_cannot_be_reached(s3_server, tmp_path):
    import pytest

    from lightspan.collector.outcomes import CollectorError
    from lightspan.collector.server import Collector

    with pytest.raises(CollectorError, match="s3://no-such-bucket-here/x"):
        Collector(config("s3://no-such-bucket-here/x", wal_dir=str(tmp_path / "wal"), collector_id="a")).start()
