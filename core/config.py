"""One config dataclass per component, resolved in one place.

Precedence, lowest first: the dataclass defaults < a TOML file (its ``[section]`` table) <
environment variables (``LIGHTSPAN_<SECTION>_<FIELD>``, or a field's own ``env`` alias) <
command-line options. A field's ``help`` metadata is its documentation and its ``--help``.
Bad values fail at start-up with a :class:`ConfigError` that names the field and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import ipaddress
import json
import logging
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any


# the credentials of a URL (scheme://user:password@host): never printed. A secret may hold "/" or
# "+" unencoded (AWS keys do), so everything up to the last "@" before a space goes (a path or query
# with an "@" is hidden too: better too much than a key)
_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^\s@'\"<>]+@")


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***``
    (``http://user:secret@minio:9000`` → ``http://***@minio:9000``): for every message, log line
    or error body that may show a URL (an endpoint, an upstream) that came from configuration."""
    return _USERINFO.sub(r"\1***@", text)


class Redacting(logging.Filter):
    """A log handler's filter that passes every record's message through :func:`redact` (the CLI's
    and the collector's handlers carry it), so no log line shows a URL's credentials."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def redact_logs(logger: logging.Logger | None = None) -> None:
    """Add :class:`Redacting` to every handler of ``logger`` (the root logger) that lacks it."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, Redacting) for f in handler.filters):
            handler.addFilter(Redacting())


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and how to fix it (URLs in it
    without their credentials: :func:`redact`)."""

    def __init__(self, section: str, name: str, problem: str, fix: str):
        self.field = f"{section}.{name}"
        super().__init__(redact(f"config field {self.field}: {problem}; fix: {fix}"))


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``"30m"``, ``"10s"``, ``"1h30m"``; ValueError otherwise."""
    text = text.strip().lower()
    parts = _DURATION_PART.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


_NUMBER = re.compile(r"\d+(\.\d+)?")
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def parse_time(text: str, *, unit_ns: int = 10**9, now_ns: int | None = None) -> int | None:
    """Unix nanoseconds of ``text``, the one time format of lightspan's filters:

    - ``''``: None (no bound);
    - a number: that many ``unit_ns`` since the epoch (unix seconds by default, ``1767225600.5``);
    - an ISO 8601 time (``2026-01-31T12:00:00Z``; UTC unless it names a zone);
    - given ``now_ns``, a duration before then (``15m``, ``2h``, ``7d``).

    ValueError otherwise, and for a time outside 1970 .. 2262 (unix nanoseconds in 64 bits)."""
    text = str(text).strip()
    if not text:
        return None
    if _NUMBER.fullmatch(text):
        whole, _, fraction = text.partition(".")
        ns = int(whole) * unit_ns + (int(fraction) * unit_ns // 10 ** len(fraction) if fraction else 0)
    else:
        try:
            moment = datetime.datetime.fromisoformat(text)
        except ValueError:
            if now_ns is None:
                raise ValueError(f"not a number or an ISO 8601 time: {text!r}") from None
            ns = now_ns - int(parse_duration(text) * 10**9)
        else:
            moment = moment if moment.tzinfo is not None else moment.replace(tzinfo=datetime.timezone.utc)
            delta = moment - _EPOCH
            ns = (delta.days * 86_400 + delta.seconds) * 10**9 + delta.microseconds * 1000
    if not 0 <= ns < 2**63:
        raise ValueError(f"outside 1970 .. 2262 (unix nanoseconds in 64 bits): {text!r}")
    return ns


def option(default: Any, help: str, *, env: str | None = None, choices: tuple | None = None):
    """A documented config field. ``env`` adds an environment alias besides the default name."""
    return dataclasses.field(default=default, metadata={"help": help, "env": env, "choices": choices})


LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
"""Host names of the loopback interface (and any ``*.localhost``, RFC 6761)."""


def is_loopback(host: str) -> bool:
    """Whether a bind address or host name is the loopback interface, so only this machine reaches
    it (the token rules of the servers): a loopback name, 127.0.0.0/8 or ::1 (IPv4-mapped too).
    The unspecified address (0.0.0.0, ::) is not: a server bound there listens on every interface.
    (The instrumentor's ``tracing.urls.names_this_machine`` asks the other question, whether a URL's
    host is this machine as a destination, where 0.0.0.0 counts; tests/tracing/test_urls.py pins the two.)"""
    host = host.strip().strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(section: str, name: str, typ: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(typ)
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return _coerce(section, name, args[0], value)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if typ in (int, float, str):
            if typ is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return typ(value)
        if origin is tuple:
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            return tuple(_coerce(section, name, args[0], v) for v in value)
        if origin is dict:
            return dict(json.loads(value) if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise ConfigError(section, name, f"{value!r} is not a valid {getattr(typ, '__name__', typ)}",
                          f"give a {getattr(typ, '__name__', typ)} value") from None
    return value


def env_name(section: str, name: str) -> str:
    return f"LIGHTSPAN_{section.upper()}_{name.upper()}"


def resolve(cls, *, section: str, file: str | os.PathLike | None = None,
            environ: Mapping[str, str] | None = None, cli: Mapping[str, Any] | None = None):
    """Build ``cls`` from defaults < TOML ``file`` < ``environ`` < ``cli`` (None values ignored)."""
    environ = os.environ if environ is None else environ
    types = _types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if file:
        path = Path(file)
        if not path.is_file():
            raise ConfigError(section, "config", f"file {path} does not exist", "pass an existing TOML file")
        with path.open("rb") as fh:
            table = tomllib.load(fh).get(section, {})
        for key, value in table.items():
            key = key.replace("-", "_")
            if key not in fields:
                raise ConfigError(section, key, f"unknown field in {path}",
                                  f"use one of: {', '.join(sorted(fields))}")
            values[key] = value
    for name, f in fields.items():
        for var in (f.metadata.get("env"), env_name(section, name)):
            if var and environ.get(var) not in (None, ""):
                values[name] = environ[var]
    for name, value in (cli or {}).items():
        if name in fields and value is not None:
            values[name] = value
    coerced = {}
    for name, value in values.items():
        coerced[name] = _coerce(section, name, types[name], value)
        choices = fields[name].metadata.get("choices")
        if choices and coerced[name] not in choices:
            raise ConfigError(section, name, f"{coerced[name]!r} is not allowed",
                              f"use one of: {', '.join(map(str, choices))}")
    return cls(**coerced)


def from_table(cls, *, section: str, table: Mapping[str, Any], where: str = ""):
    """Build ``cls`` from one TOML table (a ``[[...]]`` array entry): every key must be a field
    (``-`` and ``_`` alike), each value is coerced to the field's type; errors name ``section.key``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    types = _types(cls)
    values = {}
    for key, value in table.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ConfigError(section, name, f"unknown field{' in ' + where if where else ''}",
                              f"use one of: {', '.join(sorted(fields))}")
        values[name] = _coerce(section, name, types[name], value)
        choices = fields[name].metadata.get("choices")
        if choices and values[name] not in choices:
            raise ConfigError(section, name, f"{values[name]!r} is not allowed",
                              f"use one of: {', '.join(map(str, choices))}")
    return cls(**values)


def add_arguments(parser: argparse.ArgumentParser, cls, section: str) -> None:
    """One ``--field-name`` option per field, documented by the field's help."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        env = f.metadata.get("env")
        where = f"env {env_name(section, f.name)}" + (f" or {env}" if env else "")
        text = f"{f.metadata.get('help', '')} (default: {default!r}; {where})"
        parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(),
                            help=text.replace("%", "%%"))      # argparse formats help with %


def cli_values(args: argparse.Namespace, cls) -> dict[str, Any]:
    return {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}


def to_dict(config) -> dict[str, Any]:
    """The resolved config as plain JSON-able values (written next to every run)."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))
