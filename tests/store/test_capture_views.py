"""The views over hand-built span trees, for capture: one LLM call is one ``llm_calls`` row whatever the capture
path, and the ``rollouts`` view shows the calls that could not be captured, with the reason."""

from __future__ import annotations

import json

from lightspan import store
from lightspan.store.views import NOT_CAPTURED_REASON
from tests.lightningrl.helpers import call, span, write

REASON = "why, and the fix"


def _capture(status, reason=None):
    attrs = [("lightspan.capture.reason", json.dumps(reason))] if reason else []
    return {"capture_status": status, "attributes": attrs}


def test_one_llm_call_is_one_row_whatever_the_capture_path(tmp_path):
    rows = []
    # through the gateway: the agent's client span (no ids; LIGHTSPAN_CAPTURE_URLS=none) and the
    # gateway's span of the same call, its child through traceparent
    client = call("gw", 0, 10, tokens=False, trace="a" * 32)
    gateway = call("gw", 1, 9, trace="a" * 32, parent_span_id=client["span_id"], **_capture("ok"))
    # two instrumentations: the enclosing span is marked by the instrumentor
    outer = call("two", 0, 10, tokens=False, trace="b" * 32, **_capture("duplicate"))
    inner = call("two", 1, 9, trace="b" * 32, parent_span_id=outer["span_id"], **_capture("ok"))
    # a span without ids inside the one that carries them (a client library's own span)
    carrier = call("sdk", 0, 10, trace="c" * 32, **_capture("ok"))
    sdk = call("sdk", 1, 9, tokens=False, trace="c" * 32, parent_span_id=carrier["span_id"])
    # two calls one after the other, and a call nobody captured: each its own row
    first, second = call("seq", 0, 10, trace="d" * 32), call("seq", 20, 30, trace="d" * 32)
    lost = call("seq", 40, 50, tokens=False, trace="d" * 32)
    rows += [client, gateway, outer, inner, carrier, sdk, first, second, lost]
    write(tmp_path, rows)
    con = store.connect(tmp_path)
    kept = {(r, s) for r, s in con.execute("SELECT rollout_id, span_id FROM llm_calls").fetchall()}
    assert kept == {("gw", gateway["span_id"]), ("two", inner["span_id"]), ("sdk", carrier["span_id"]),
                    ("seq", first["span_id"]), ("seq", second["span_id"]), ("seq", lost["span_id"])}
    columns = [c[0] for c in con.execute("DESCRIBE llm_calls").fetchall()]
    assert columns == [f.name for f in store.SPAN_SCHEMA] + ["rollout_key"]


def test_rollouts_show_the_calls_that_were_not_captured(tmp_path):
    rows = [call("r1", 0, 10, **_capture("ok")),
            call("r1", 20, 30, tokens=False, **_capture("no_logprobs", REASON)),
            call("r1", 40, 50, tokens=False, **_capture("no_logprobs", REASON)),
            call("r1", 60, 70, tokens=False, **_capture("other_url", "elsewhere")),
            call("r2", 0, 10, tokens=False),                       # an LLM span lightspan never saw
            call("r3", 0, 10, **_capture("ok")), span("r3", "tool", 20, 30)]
    write(tmp_path, rows)
    con = store.connect(tmp_path)
    got = {r[0]: r[1:] for r in con.execute(
        "SELECT rollout_key, num_llm_calls, num_uncaptured_calls, capture_problem, capture_reason FROM rollouts").fetchall()}
    assert got == {"r1": (1, 3, "no_logprobs", REASON), "r2": (0, 1, "not_captured", NOT_CAPTURED_REASON),
                   "r3": (1, 0, None, None)}
