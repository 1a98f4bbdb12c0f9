"""OTLP ``AnyValue`` → Python and JSON, and the converters of the attributes the collector promotes to
typed columns (:mod:`lightspan.collector.otlp`). Pure functions.

A converter returns the column's value, raises :class:`_Keep` when the value has a type the column
does not take (the attribute then stays in the ``attributes`` map, nothing lost), or :class:`_Reject`
when the span is malformed (dropped and counted, its siblings kept).
"""

from __future__ import annotations

import base64
import json
import math

from opentelemetry.proto.common.v1.common_pb2 import AnyValue

_INT64_MAX = (1 << 63) - 1
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


class _Keep(Exception):
    """A promoted attribute has an unexpected type: leave it in ``attributes``."""


class _Reject(Exception):
    """The span is malformed: drop it and count it."""


# --- AnyValue → Python / JSON -----------------------------------------------------------------

def _py(value: AnyValue):
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":
        return value.int_value
    if kind == "double_value":
        d = value.double_value
        return d if math.isfinite(d) else ("NaN" if math.isnan(d) else ("Infinity" if d > 0 else "-Infinity"))
    if kind == "bool_value":
        return value.bool_value
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii")
    if kind == "array_value":
        return [_py(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _py(kv.value) for kv in value.kvlist_value.values}
    return None


def _json_object(key_values) -> str:
    return _dumps({kv.key: _py(kv.value) for kv in key_values})


# --- converters for promoted attributes ---------------------------------------------------------

def _str(value: AnyValue, key: str) -> str:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":  # e.g. a numeric rollout id
        return str(value.int_value)
    raise _Keep


def _int(value: AnyValue, key: str) -> int:
    kind = value.WhichOneof("value")
    if kind == "int_value":
        return value.int_value
    if kind == "double_value" and value.double_value.is_integer() and abs(value.double_value) <= _INT64_MAX:
        return int(value.double_value)
    raise _Keep


def _float(value: AnyValue, key: str) -> float:
    kind = value.WhichOneof("value")
    if kind == "double_value":
        return value.double_value
    if kind == "int_value":
        return float(value.int_value)
    raise _Keep


def _str_list(value: AnyValue, key: str) -> list[str]:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return [value.string_value]
    if kind == "array_value" and all(v.WhichOneof("value") == "string_value" for v in value.array_value.values):
        return [v.string_value for v in value.array_value.values]
    raise _Keep


def _packed(value: AnyValue, key: str) -> bytes:
    """One int32/float32 little-endian bytes value (4 bytes per element)."""
    if value.WhichOneof("value") != "bytes_value":
        raise _Keep
    data = value.bytes_value
    if len(data) % 4:
        raise _Reject(f"{key} has {len(data)} bytes, not a multiple of 4")
    return data


def _choices(value: AnyValue, key: str) -> tuple[bytes | None, int]:
    """One bytes value, or an array of them (one per choice): (choice 0, number of choices)."""
    kind = value.WhichOneof("value")
    if kind == "bytes_value":
        return _packed(value, key), 1
    if kind == "array_value" and all(v.WhichOneof("value") == "bytes_value" for v in value.array_value.values):
        choices = [_packed(v, key) for v in value.array_value.values]
        return (choices[0] if choices else None), len(choices)
    raise _Keep
