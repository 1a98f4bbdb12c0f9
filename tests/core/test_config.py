"""core/config.py's shared parsers: the one time format of lightspan's filters, and loopback hosts."""

from __future__ import annotations

import pytest

from lightspan.core.config import is_loopback, parse_time

S = 10**9
T = 1767225600 * S      # 2026-01-01T00:00:00Z


@pytest.mark.parametrize("text, want", [
    ("", None), ("  ", None),
    ("1767225600", T), ("1767225600.5", T + S // 2), ("1767225600.000000001", T + 1),
    ("2026-01-01T00:00:00Z", T), ("2026-01-01T01:00:00+01:00", T), ("2026-01-01", T),
    ("2026-01-01T00:00:00", T),                                 # no zone: UTC
    ("2026-01-01T00:00:00.000001Z", T + 1000),                  # exact to the microsecond
    ("0", 0),
])
def test_parse_time(text, want):
    assert parse_time(text) == want


def test_parse_time_in_another_unit_and_before_now():
    assert parse_time("1800000000000000000", unit_ns=1) == 1_800_000_000 * S
    assert parse_time("2026-01-01T00:00:00Z", unit_ns=1) == T     # ISO is ISO whatever the unit
    assert parse_time("15m", now_ns=T) == T - 15 * 60 * S
    assert parse_time("1h30m", now_ns=T) == T - 5400 * S


@pytest.mark.parametrize("text, now_ns", [
    ("15m", None),                    # a duration needs a now
    ("soon", T), ("-5", None), ("1e9", None),
    ("99999999999999999999", None),   # past 2262
    ("1969-12-31T23:59:59Z", None),   # before 1970
    ("100000000d", T),                # before 1970
])
def test_parse_time_refuses(text, now_ns):
    with pytest.raises(ValueError):
        parse_time(text, now_ns=now_ns)


@pytest.mark.parametrize("host, want", [
    ("localhost", True), ("LocalHost ", True), ("app.localhost", True), ("localhost.localdomain", True),
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("::ffff:127.0.0.1", True),
    ("0.0.0.0", False), ("::", False),          # every interface: not loopback
    ("10.0.0.1", False), ("vllm", False), ("127.example.com", False), ("", False),
])
def test_is_loopback(host, want):
    assert is_loopback(host) is want


def test_a_help_text_with_a_percent_sign_prints(capsys):
    """A field's help is text, not a format string: '80% of' must not break --help (argparse formats it)."""
    import argparse
    import dataclasses

    from lightspan.core.config import add_arguments, option

    @dataclasses.dataclass(frozen=True)
    class Conf:
        share: float = option(0.8, "Use 80% of the memory available.")

    parser = argparse.ArgumentParser(prog="x")
    add_arguments(parser, Conf, "x")
    parser.print_help()
    assert "Use 80% of the memory available." in " ".join(capsys.readouterr().out.split())
