"""Weight sync over several replicas (trainer/replicas.py): the protocol against stub servers (the
order of pauses, pushes and resumes; who is in rotation); tests/test_scale_out.py runs it against two
real vLLM replicas."""

from __future__ import annotations

import http.server
import threading

import pytest

from lightspan.store import replicas as rotation
from lightspan.trainer.replicas import MAX_LOGPROB_DIFF, ReplicaSync
from lightspan.trainer.sync import ReloadSync, SyncError
from tests.conftest import free_port
from tests.trainer.test_sync import Stub, fake_checkpoint

IDS = [60, 61, 62]


def completions(logprobs: list[float]) -> dict:
    """A /v1/completions answer with prompt_logprobs for IDS (vLLM 0.32's shape)."""
    entries = [None] + [{str(t): {"logprob": lp, "rank": 1}} for t, lp in zip(IDS[1:], logprobs)]
    return {"choices": [{"prompt_logprobs": entries}]}


@pytest.fixture
def stubs():
    servers = []
    events = []                      # (url, path) in the order any server saw them
    lock = threading.Lock()

    class Recording(Stub):
        def do_POST(self):  # noqa: N802
            with lock:
                events.append((self.server.url, self.path.split("?")[0]))
            super().do_POST()

    for _ in range(2):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recording)
        server.calls, server.bodies, server.script = [], [], {}
        server.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
    yield servers, events
    for server in servers:
        server.shutdown()
        server.server_close()


def test_all_replicas_are_paused_before_any_is_pushed_and_a_dead_one_leaves_rotation(stubs, tmp_path):
    (a, b), events = stubs
    dead = f"http://127.0.0.1:{free_port()}"
    for server in (a, b):
        server.script["/v1/completions"] = [(200, completions([-1.0, -2.0]))]
    sync = ReplicaSync((a.url, b.url, dead), lambda url: ReloadSync(url, retries=0), tmp_path)
    metrics = sync.push(fake_checkpoint(tmp_path / "v1"), 1)
    assert metrics["sync_seconds"] > 0
    order = [path for _, path in events]
    first_reload = order.index("/collective_rpc")
    assert order[:first_reload].count("/pause") >= 2, "both replicas paused before either reloads"
    for server in (a, b):
        mine = [path for url, path in events if url == server.url]
        assert mine[0] == "/pause" and "/collective_rpc" in mine and mine[-1] == "/resume"
    assert sync.verify("policy", IDS, [-1.0, -2.0]) == 0.0
    doc = rotation.read(tmp_path)
    assert doc["version"] == 1
    assert [u for u, s in doc["replicas"].items() if s["in_rotation"]] == [a.url, b.url]
    assert "pause" in doc["replicas"][dead]["error"]


def test_a_replica_that_serves_other_logprobs_is_out_and_none_left_fails_the_sync(stubs, tmp_path):
    (a, b), _ = stubs
    a.script["/v1/completions"] = [(200, completions([-1.0, -2.0]))]
    b.script["/v1/completions"] = [(200, completions([-1.0, -2.5]))]      # kept the old weights
    sync = ReplicaSync((a.url, b.url), lambda url: ReloadSync(url, retries=0), tmp_path)
    sync.push(fake_checkpoint(tmp_path / "v1"), 1)
    assert sync.verify("policy", IDS, [-1.0, -2.0]) == 0.0
    doc = rotation.read(tmp_path)
    assert doc["replicas"][a.url]["in_rotation"] and not doc["replicas"][b.url]["in_rotation"]
    assert doc["replicas"][b.url]["max_abs_logprob_diff"] == pytest.approx(0.5) and 0.5 > MAX_LOGPROB_DIFF
    # the next version reaches both: b is back in rotation once it serves what the trainer computes
    b.script["/v1/completions"] = [(200, completions([-1.0, -2.0]))]
    sync.push(fake_checkpoint(tmp_path / "v2"), 2)
    sync.verify("policy", IDS, [-1.0, -2.0])
    assert all(s["in_rotation"] for s in rotation.read(tmp_path)["replicas"].values())
    # no replica takes the version: the sync fails, as one server's failure does
    for server in (a, b):
        server.script["/collective_rpc"] = [(500, {"error": "boom"})]
    with pytest.raises(SyncError, match="no replica took version 3"):
        sync.push(fake_checkpoint(tmp_path / "v3"), 3)
    assert not any(s["in_rotation"] for s in rotation.read(tmp_path)["replicas"].values())


def test_no_replica_behind_the_name_is_a_sync_error(tmp_path):
    sync = ReplicaSync(("dns+http://no-such-name.invalid:8000",), lambda url: ReloadSync(url), tmp_path)
    with pytest.raises(SyncError, match="no vLLM replica"):
        sync.push(tmp_path, 1)
