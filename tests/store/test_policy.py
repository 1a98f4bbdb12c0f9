"""policy.json (lightspan/store/policy.py): the unnamed policy as before, named policies side by side."""

from __future__ import annotations

import json
import multiprocessing

from lightspan import store
from lightspan.store import policy
from lightspan.tracing import semconv


def test_the_unnamed_policy_keeps_its_file_format(tmp_path):
    assert policy.read(tmp_path) is None and policy.served_version(tmp_path) == 0 and policy.read_all(tmp_path) == {}
    policy.write(tmp_path, 3, tmp_path / "v3")
    doc = json.loads((tmp_path / "policy.json").read_text())
    assert set(doc) == {"version", "path", "time_unix_nano"} and doc["version"] == 3
    assert policy.read(tmp_path).version == 3 and policy.served_versions(tmp_path) == {}
    # a file an older lightspan wrote (no time) still reads
    (tmp_path / "policy.json").write_text(json.dumps({"version": 1, "path": "/models/v1"}))
    assert policy.read(tmp_path) == policy.Policy(1, "/models/v1", 0, "")


def test_named_policies_are_entries_of_their_own(tmp_path):
    policy.write(tmp_path, 2, tmp_path / "v2")                  # an unnamed store turned into a named one
    policy.write(tmp_path, 0, tmp_path / "w0", name="writer")
    policy.write(tmp_path, 5, tmp_path / "c5", name="checker")
    policy.write(tmp_path, 1, tmp_path / "w1", name="writer")
    assert set(json.loads((tmp_path / "policy.json").read_text())) == {"policies"}
    assert policy.read(tmp_path) is None                        # no unnamed one: ask by name
    assert policy.read(tmp_path, "writer").path == str((tmp_path / "w1").resolve())
    assert policy.served_version(tmp_path, "checker") == 5 and policy.served_version(tmp_path, "judge") == 0
    assert policy.served_versions(tmp_path) == {"writer": 1, "checker": 5}
    assert sorted(policy.read_all(tmp_path)) == ["checker", "writer"]


def test_served_by_maps_a_model_name_to_its_policy_and_version(tmp_path):
    policy.write(tmp_path, 4, tmp_path / "w4", name="writer")
    published = policy.read_all(tmp_path)
    assert policy.served_by(published, "writer").version == 4
    assert policy.served_by(published, "writer-v3") == policy.Policy(3, "", published["writer"].time_unix_nano,
                                                                     "writer")
    assert policy.served_by(published, "writer-v4").path == published["writer"].path
    for model in ("policy-base", "checker", "", None, "writer-vx"):
        assert policy.served_by(published, model) is None


def test_a_damaged_file_or_entry_reads_as_unpublished(tmp_path):
    (tmp_path / "policy.json").write_text("{not json")
    assert policy.read_all(tmp_path) == {}
    (tmp_path / "policy.json").write_text(json.dumps({"policies": {"w": {"version": "x"}, "c": {"version": 2}}}))
    assert list(policy.read_all(tmp_path)) == ["c"]


def _publish(data_dir, name, n):
    for version in range(n):
        store.policy.write(data_dir, version, data_dir / f"{name}{version}", name=name)


def test_trainers_of_two_policies_publishing_at_once_lose_no_entry(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_publish, args=(tmp_path, name, 40)) for name in ("writer", "checker")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert policy.served_versions(tmp_path) == {"writer": 39, "checker": 39}


def test_policy_versions_travel_as_one_variable():
    assert semconv.format_policy_versions({"writer": 3, "checker": 0}) == "checker=0,writer=3"
    assert semconv.parse_policy_versions("checker=0,writer=3") == {"writer": 3, "checker": 0}
    assert semconv.parse_policy_versions(" a=1, b, c=x, =2 ,d=-1") == {"a": 1, "d": -1}
    assert semconv.parse_policy_versions("") == {}
