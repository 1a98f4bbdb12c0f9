"""The protocol table is complete: every protocol has every piece, and the transports hold none.

``lightspan.tracing.protocols.PROTOCOLS`` has one row per protocol (tracing/protocols/: one module
each); the instrumentor and the gateway call through the rows. A fifth protocol is a module and a
row: these tests say what the row must hold, and that no transport branches on a protocol's name.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from lightspan.tracing import protocols
from lightspan.tracing.clients import CLIENTS
from lightspan.tracing.protocols import PROTOCOLS, Protocol
from lightspan.tracing.protocols.base import COMMON_FIELDS

ROOT = Path(__file__).resolve().parents[2]

# a request of each protocol that it converts or sends with the capture fields (a row without one here fails)
EXAMPLES = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "text_completion": {"model": "m", "prompt": "hi"},
    "responses": {"model": "m", "input": "hi"},
    "messages": {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
}
CAPTURE = ("add", "add_json", "status", "attributes", "genai_attributes")             # methods
CAPTURE_STATE = ("fed", "readable", "converted", "model")                              # attributes
CONVERTED = ("message", "events", "end", "unconverted", "request")                     # of a converted capture
# the transports: no branch of theirs may name a protocol or a client library
TRANSPORTS = ("tracing/calls.py", "tracing/streams.py", "tracing/instrumentor.py", "rollout/exchanges.py",
              "rollout/gateway.py", "rollout/paths.py")


class _Exchange:
    """What a row's ``frames`` and ``end`` see of the gateway's call (rollout/exchanges.py)."""

    def __init__(self, cap):
        self.cap, self.strip, self.finished, self.read_payloads = cap, True, False, []

    def read(self, payload):
        self.read_payloads.append(payload)


@pytest.mark.parametrize("name", list(PROTOCOLS))
def test_every_row_has_every_piece(name):
    row = PROTOCOLS[name]
    assert isinstance(row, Protocol) and row.name == name
    for field in dataclasses.fields(Protocol):
        value = getattr(row, field.name)
        if field.type in ("Callable",):
            assert callable(value), f"{name}.{field.name} is not callable"
        elif field.type == "str":
            assert value, f"{name}.{field.name} is empty"
    assert row.client in CLIENTS and row.path.startswith("/") and row.operation in ("chat", "text_completion")
    assert set(COMMON_FIELDS) <= set(row.fields)
    for kind, what in row.fields.values():
        assert isinstance(what, str) and (isinstance(kind, type) or all(isinstance(k, type) for k in kind))


@pytest.mark.parametrize("name", list(PROTOCOLS))
def test_a_rows_pieces_work_together(name):
    """Capture, request, messages, stream relay and errors of a call, through the row alone."""
    row, body = PROTOCOLS[name], EXAMPLES[name]
    for empty in (False, True):    # a request it takes, and one it cannot read (sent as it is)
        cap = row.capture({} if empty else body)
        for piece in CAPTURE:
            assert callable(getattr(cap, piece)), f"{name}'s capture lacks {piece}"
        for piece in CAPTURE_STATE:
            getattr(cap, piece)
        if cap.converted:
            for piece in CONVERTED:
                assert callable(getattr(cap, piece)), f"{name}'s converted capture lacks {piece}"
            assert not cap.unconverted("a test").converted
        sent = row.request(cap, {} if empty else body)
        assert isinstance(sent, dict)
        assert isinstance(row.inputs({} if empty else body), list)
        out = row.output(cap, False)
        assert out is None or (callable(out.add) and callable(out.messages))
        assert row.outputs(cap, out) is None or isinstance(row.outputs(cap, out), list)
        assert cap.status() != "ok" and isinstance(cap.attributes(1), dict)
        ex = _Exchange(cap)
        assert all(isinstance(f, bytes) for f in row.frames(ex, b"event: x") + row.frames(ex, b"data: {}"))
        assert all(isinstance(f, bytes) for f in row.end(ex))
        kind, answer = row.upstream_error(cap, "application/json", b'{"error": {"message": "no", "type": "x"}}')
        assert isinstance(kind, str) and json.loads(answer)
    assert json.loads(row.error(400, "bad", "param"))
    assert row.capture(body).converted or PROTOCOLS[name].request(row.capture(body), body) != body


def test_one_module_per_row():
    """Each module of tracing/protocols/ that ends with a ``PROTOCOL`` row is in the table, once."""
    rows = []
    for path in sorted((ROOT / "tracing" / "protocols").glob("*.py")):
        module = importlib.import_module(f"lightspan.tracing.protocols.{path.stem}")
        if isinstance(getattr(module, "PROTOCOL", None), Protocol):
            rows.append(module.PROTOCOL)
    assert sorted(r.name for r in rows) == sorted(PROTOCOLS) and all(PROTOCOLS[r.name] is r for r in rows)
    assert set(EXAMPLES) == set(PROTOCOLS), "add an example request of the new protocol to EXAMPLES"


def test_the_table_maps_each_path_and_client_to_its_row():
    for row in PROTOCOLS.values():
        assert protocols.of("/v1" + row.path, row.client) is row
        assert protocols.of(row.path + "?x=1", row.client) is row
        others = [c for c in CLIENTS if c != row.client]
        assert all(protocols.of("/v1" + row.path, c) is not row for c in others)
    assert {row.client for row in PROTOCOLS.values()} == set(CLIENTS)   # every client speaks one
    assert len({(row.client, row.path) for row in PROTOCOLS.values()}) == len(PROTOCOLS)


def test_the_gateway_serves_every_row():
    from lightspan.rollout.paths import ENDPOINTS

    for row in PROTOCOLS.values():
        endpoint = ENDPOINTS["/v1" + row.path]
        assert endpoint.protocol is row and endpoint.methods == ("POST",)


def _names() -> set[str]:
    return {*PROTOCOLS, *CLIENTS} | {row.path for row in PROTOCOLS.values()}


@pytest.mark.parametrize("path", TRANSPORTS)
def test_no_transport_branches_on_a_protocol(path):
    """No comparison, ``in`` test or ``isinstance`` of a transport names a protocol, a client library
    or a capture class: what differs is in the rows."""
    tree = ast.parse((ROOT / path).read_text())
    names = _names()
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                if isinstance(operand, ast.Constant) and operand.value in names:
                    wrong.append(f"line {node.lineno}: compares with {operand.value!r}")
                if isinstance(operand, (ast.Tuple, ast.Set, ast.List)) and any(
                        isinstance(e, ast.Constant) and e.value in names for e in operand.elts):
                    wrong.append(f"line {node.lineno}: tests membership in protocol names")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            if "Capture" in ast.unparse(node.args[1]):
                wrong.append(f"line {node.lineno}: isinstance of a capture class")
        elif isinstance(node, ast.Attribute) and node.attr in ("CHAT", "TEXT_COMPLETION", "RESPONSES", "MESSAGES"):
            wrong.append(f"line {node.lineno}: names a protocol constant ({node.attr})")
    assert not wrong, f"{path}:\n" + "\n".join(wrong)
