"""Choosing a vLLM replica (rollout/replicas.py, store/replicas.py): one rollout on one replica,
rollouts spread, few moves when a replica joins or leaves, replicas out of rotation skipped, DNS
targets expanded; and the gateway wired to it, against two stand-in upstreams."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import requests
from opentelemetry.sdk.trace import TracerProvider

from lightspan.core.config import ConfigError
from lightspan.rollout.gateway import Gateway, GatewayConfig
from lightspan.rollout.replicas import Upstreams, rendezvous, untraced_key
from lightspan.store import replicas as rotation
from tests.rollout.chat_stub import ChatStub

REPLICAS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
KEYS = [f"rollout-{i}" for i in range(2000)]


def test_rendezvous_is_stable_spreads_and_moves_few_keys_when_a_replica_leaves():
    chosen = {k: rendezvous(k, REPLICAS) for k in KEYS}
    assert chosen == {k: rendezvous(k, list(reversed(REPLICAS))) for k in KEYS}   # order does not matter
    counts = Counter(chosen.values())
    assert set(counts) == set(REPLICAS) and min(counts.values()) > len(KEYS) / len(REPLICAS) * 0.8
    gone = REPLICAS[1]
    after = {k: rendezvous(k, [r for r in REPLICAS if r != gone]) for k in KEYS}
    moved = [k for k in KEYS if after[k] != chosen[k]]
    assert moved and all(chosen[k] == gone for k in moved)       # only the leaver's rollouts move
    joined = {k: rendezvous(k, REPLICAS + ["http://10.0.0.9:8000"]) for k in KEYS}
    assert all(joined[k] in (chosen[k], "http://10.0.0.9:8000") for k in KEYS)
    with pytest.raises(ValueError):
        rendezvous("x", [])


def test_dns_targets_expand_to_every_address_of_the_name():
    urls = rotation.resolve(["http://vllm-0:8000/", "dns+http://localhost:8123"])
    assert urls[0] == "http://vllm-0:8000" and "http://127.0.0.1:8123" in urls
    assert rotation.resolve(["dns+http://no-such-name.invalid:8000"]) == []


def test_upstreams_skip_replicas_out_of_rotation_and_follow_the_file(tmp_path):
    now = [0.0]
    upstreams = Upstreams(tuple(REPLICAS), str(tmp_path), clock=lambda: now[0])
    assert upstreams.candidates() == REPLICAS
    status = {u: {"version": 3, "in_rotation": u != REPLICAS[0], "error": ""} for u in REPLICAS}
    rotation.write(tmp_path, 3, status)
    assert upstreams.candidates() == REPLICAS                   # read again only after REFRESH_S
    now[0] += 10
    assert upstreams.candidates() == REPLICAS[1:]
    assert all(upstreams.pick(k) != REPLICAS[0] for k in KEYS[:200])
    rotation.write(tmp_path, 4, {u: {**s, "in_rotation": False} for u, s in status.items()})
    now[0] += 10
    assert upstreams.candidates() == REPLICAS                   # none in rotation: better all than none


def test_the_gateway_keeps_each_rollout_on_one_replica_and_skips_those_out_of_rotation(tmp_path):
    a, b, c = ChatStub(), ChatStub(), ChatStub()
    rotation.write(tmp_path, 1, {c.url: {"version": None, "in_rotation": False, "error": "sync failed"}})
    gw = Gateway(GatewayConfig(upstreams=(a.url, b.url, c.url), port=0, data_dir=str(tmp_path)), TracerProvider())
    url = gw.start()
    try:
        served = {}
        for i in range(12):
            for turn in range(3):
                before = (len(a.calls), len(b.calls))
                response = requests.post(f"{url}/v1/chat/completions", timeout=30,
                                         headers={"X-Lightspan-Rollout-Id": f"r{i}"},
                                         json={"model": "policy", "messages": [{"role": "user", "content": str(turn)}]})
                assert response.status_code == 200, response.text
                served.setdefault(f"r{i}", set()).add("a" if len(a.calls) > before[0] else "b")
        assert all(len(where) == 1 for where in served.values())       # one rollout, one replica
        assert {w for where in served.values() for w in where} == {"a", "b"}   # rollouts spread
        assert c.calls == []                                          # out of rotation: no call
    finally:
        gw.stop()
        for upstream in (a, b, c):
            upstream.server.shutdown()


def test_an_untraced_call_is_keyed_by_its_rollout_else_its_trace():
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    assert untraced_key("r1", f"00-{trace}-00f067aa0ba902b7-01") == "r1"
    assert untraced_key(None, f"00-{trace.upper()}-00f067aa0ba902b7-01") == trace
    assert untraced_key("", "00-not-a-trace-01") == "" and untraced_key(None, None) == ""


def test_responses_and_messages_calls_stay_on_their_rollouts_replica_too(tmp_path):
    a, b = ChatStub(), ChatStub()
    gw = Gateway(GatewayConfig(upstreams=(a.url, b.url), port=0, data_dir=str(tmp_path)), TracerProvider())
    url = gw.start()
    try:
        served = {}
        for i in range(12):
            # a Responses call by rollout id, an Anthropic Messages call by its caller's trace only
            calls = [("/v1/responses", {"X-Lightspan-Rollout-Id": f"r{i}"}),
                     ("/v1/messages", {"traceparent": f"00-{i + 1:032x}-00f067aa0ba902b7-01"})]
            for path, headers in calls:
                for _ in range(2):
                    before = len(a.calls)
                    response = requests.post(f"{url}{path}", json={"model": "policy", "input": "hi"},
                                             headers=headers, timeout=30)
                    assert response.status_code == 200, response.text
                    served.setdefault((path, i), set()).add("a" if len(a.calls) > before else "b")
        assert all(len(where) == 1 for where in served.values())       # one rollout (trace), one replica
        for path in ("/v1/responses", "/v1/messages"):                 # and spread over both
            assert {w for (p, _), where in served.items() if p == path for w in where} == {"a", "b"}
    finally:
        gw.stop()
        for upstream in (a, b):
            upstream.server.shutdown()


def test_gateway_config_rejects_a_non_http_replica():
    with pytest.raises(ConfigError, match="upstreams"):
        GatewayConfig(upstreams=("vllm:8000",))


def _refusing_url() -> str:
    """A loopback port with nothing listening: every connection is refused."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


class _Hangup:
    """A replica that accepts each connection and closes it before answering (a crashed vLLM)."""

    def __init__(self):
        import socket

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0

        def serve():
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.accepted += 1
                conn.close()
        threading.Thread(target=serve, daemon=True).start()


def test_upstreams_skip_a_replica_marked_down_until_its_time_is_up(tmp_path):
    now = [0.0]
    upstreams = Upstreams(tuple(REPLICAS), str(tmp_path), down_s=10, clock=lambda: now[0])
    before = {k: upstreams.order(k) for k in KEYS[:400]}
    assert all(order[0] == rendezvous(k, REPLICAS) and sorted(order) == sorted(REPLICAS)
               for k, order in before.items())
    upstreams.down(REPLICAS[1], "connection refused")
    after = {k: upstreams.order(k) for k in KEYS[:400]}
    assert all(REPLICAS[1] not in order for order in after.values())
    moved = [k for k in after if after[k][0] != before[k][0]]
    assert moved and all(before[k][0] == REPLICAS[1] and after[k][0] == before[k][1] for k in moved)
    now[0] += 11                                               # up again: its rollouts come back
    assert {k: upstreams.order(k) for k in KEYS[:400]} == before
    for replica in REPLICAS:
        upstreams.down(replica)
    assert all(upstreams.order(k) == before[k][:1] for k in KEYS[:400])   # none live: its own, and fail there


@pytest.mark.parametrize("dead", ["refused", "hangup"])
def test_a_dead_replica_s_rollouts_fail_over_to_a_live_one(tmp_path, dead):
    """A replica that refused connections kept its rollouts: 10 of 20 got 502. Now each of its calls
    goes to the live replica; when every replica is down, the call is 502 as before."""
    live = ChatStub()
    down = _refusing_url() if dead == "refused" else _Hangup()
    down_url = down if isinstance(down, str) else down.url
    gw = Gateway(GatewayConfig(upstreams=(live.url, down_url), port=0, data_dir=str(tmp_path)), TracerProvider())
    url = gw.start()
    owners = {f"r{i}": rendezvous(f"r{i}", [live.url, down_url]) for i in range(20)}
    assert set(owners.values()) == {live.url, down_url}          # some rollouts are the dead one's
    try:
        for turn in range(2):
            for rollout in owners:
                response = requests.post(f"{url}/v1/chat/completions", timeout=30,
                                         headers={"X-Lightspan-Rollout-Id": rollout},
                                         json={"model": "policy", "messages": [{"role": "user", "content": str(turn)}]})
                assert response.status_code == 200, (rollout, response.text)
        assert len(live.calls) == 40
        assert gw.status()["replica_failovers"] >= 1
        if dead == "hangup":
            assert down.accepted == 1                          # tried once, then down: no call after it
        # every replica down: 502, as with one upstream
        live.server.shutdown()
        live.server.server_close()
        failed = requests.post(f"{url}/v1/chat/completions", timeout=30, headers={"X-Lightspan-Rollout-Id": "r0"},
                               json={"model": "policy", "messages": [{"role": "user", "content": "x"}]})
        assert failed.status_code == 502 and "upstream unreachable" in failed.json()["error"]["message"]
    finally:
        gw.stop()
        if not isinstance(down, str):
            down.sock.close()
