"""``store.sql.jsonable``: DuckDB values as strict JSON, the one conversion of /v1/sql, the web UI,
``lightspan export`` and ``lightspan sql --format json``."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import uuid

import duckdb
import pytest

from lightspan.store import export
from lightspan.store.sql import jsonable


@pytest.mark.parametrize("value, want", [
    (float("nan"), None), (float("inf"), None), (float("-inf"), None), (1.5, 1.5), (None, None),
    (True, True), (3, 3), ("x", "x"),
    (b"\xaa", "qg=="), (bytearray(b"ab"), "YWI="), (memoryview(b"ab"), "YWI="),
    ([1.0, float("nan")], [1.0, None]), ((1, b"\x00"), [1, "AA=="]),
    ({1: float("inf"), "k": [b"\xff"]}, {"1": None, "k": ["/w=="]}),
    (dt.datetime(2026, 1, 2, 3, 4, 5), "2026-01-02T03:04:05"), (dt.date(2026, 1, 2), "2026-01-02"),
    (dt.time(3, 4), "03:04:00"), (dt.timedelta(minutes=1, microseconds=500000), 60.5),
    (decimal.Decimal("1.10"), "1.10"), (uuid.UUID(int=1), "00000000-0000-0000-0000-000000000001"),
])
def test_jsonable(value, want):
    got = jsonable(value)
    assert got == want
    json.dumps(got, allow_nan=False)   # strict JSON, whatever came in


def test_duckdb_values_are_strict_json():
    con = duckdb.connect()
    row = con.execute("SELECT 'nan'::double, '-inf'::float, '\\xAA'::blob, MAP {'k': [1.5, 'inf'::double]}, "
                      "{'a': 1, 'b': 'nan'::double}, DATE '2026-01-02', 12.5::DECIMAL(4,1), INTERVAL 90 SECOND").fetchone()
    assert [jsonable(v) for v in row] == [None, None, "qg==", {"k": [1.5, None]}, {"a": 1, "b": None},
                                          "2026-01-02", "12.5", 90.0]


def test_an_export_row_is_strict_json_with_its_messages_parsed():
    row = export._jsonl_row({"completion_logprobs": [-0.5, float("nan")], "input_messages": '[{"role": "user"}]',
                             "output_messages": "not json", "final_reward": float("inf")})
    assert row == {"completion_logprobs": [-0.5, None], "input_messages": [{"role": "user"}],
                   "output_messages": "not json", "final_reward": None}
    json.dumps(row, allow_nan=False)


def test_lightspan_sql_json_is_strict_json(tmp_path, capsys):
    from lightspan import cli

    query = "SELECT 'nan'::double AS x, '\\xAA'::blob AS b, [1, 2] AS l"
    assert cli.main(["sql", "--data-dir", str(tmp_path), "--format", "json", query]) == 0
    line = capsys.readouterr().out.strip()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}")) == \
        {"x": None, "b": "qg==", "l": [1, 2]}
