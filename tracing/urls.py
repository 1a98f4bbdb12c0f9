"""Which calls lightspan captures: the capture URLs (the protocol a request path names is the
protocol table's: :func:`lightspan.tracing.protocols.of`).

``LIGHTSPAN_CAPTURE_URLS`` lists base URLs (comma-separated); a call is captured when its URL (the
client's base URL joined with the request's path) lies under one of them. Unset, every loopback
server is a capture URL; ``none`` matches nothing (a lightspan gateway captures these calls).

URLs are compared as an experienced user reads them, not as strings:

- every loopback spelling is one host: ``localhost``, ``127.0.0.1`` (all of 127.0.0.0/8),
  ``::1`` / ``[::1]``, and the wildcard addresses ``0.0.0.0`` / ``[::]``, which a client can only
  reach on its own machine (a server started with ``--host 0.0.0.0`` is called that way);
- the scheme's default port is the port when none is written (``http://h`` is ``http://h:80``);
- scheme and host are case-insensitive; trailing slashes and empty path segments do not count;
- a capture URL covers the paths below it, segment by segment (``/v1`` covers ``/v1/chat/...``,
  not ``/v10``).
"""

from __future__ import annotations

import functools
import logging
import re
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

_THIS_MACHINE = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback",
                           "::1", "0:0:0:0:0:0:0:1", "0.0.0.0", "::", "0:0:0:0:0:0:0:0"})
_LOOPBACK_V4 = re.compile(r"(::ffff:)?127\.\d{1,3}\.\d{1,3}\.\d{1,3}")
_DEFAULT_PORTS = {"http": 80, "https": 443}
LOOPBACK = "loopback"


def names_this_machine(host: str) -> bool:
    """Whether ``host``, as a URL's destination, is this machine: a loopback name or address
    (``*.localhost``, 127.0.0.0/8, ::1, IPv4-mapped too) or the unspecified address (0.0.0.0, ::),
    which a client connecting to it reaches this machine by. So ``localhost:8000`` and
    ``0.0.0.0:8000`` are one server. (``lightspan.core.config.is_loopback`` asks whether a server
    bound at a host is reachable from this machine only, where 0.0.0.0 is not; the two are pinned
    together in tests/tracing/test_urls.py, as tracing imports no other part.)"""
    host = host.lower().strip("[]")
    return host in _THIS_MACHINE or host.endswith(".localhost") or _LOOPBACK_V4.fullmatch(host) is not None


@functools.lru_cache(maxsize=512)
def canonical(url: str) -> tuple[str, str, int, tuple[str, ...]] | None:
    """(scheme, host, port, path segments) of ``url``; loopback hosts become ``loopback``. None when
    ``url`` names no host. A URL written without a scheme is read as ``http://``."""
    text = str(url).strip()
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:  # a port that is not a number
        return None
    host = (parts.hostname or "").lower()
    if not host:
        return None
    scheme = parts.scheme.lower()
    if port is None:
        port = _DEFAULT_PORTS.get(scheme, 0)
    segments = tuple(s for s in parts.path.split("/") if s)
    return scheme, LOOPBACK if names_this_machine(host) else host, port, segments


def covers(base: tuple, url: tuple) -> bool:
    """Whether canonical URL ``url`` lies under canonical base URL ``base``."""
    return base[:3] == url[:3] and url[3][:len(base[3])] == base[3]


@functools.lru_cache(maxsize=16)
def parse_capture_urls(raw: str) -> tuple | None:
    """The canonical capture URLs of a ``LIGHTSPAN_CAPTURE_URLS`` value; None when unset (loopback)."""
    entries = [u.strip() for u in raw.split(",") if u.strip()]
    if not entries:
        return None
    urls = []
    for entry in entries:
        if entry.lower() == "none":
            continue
        url = canonical(entry)
        if url is None:
            log.warning("lightspan: LIGHTSPAN_CAPTURE_URLS entry %r names no host; it is ignored "
                        "(write base URLs such as http://127.0.0.1:8000/v1, comma-separated)", entry)
            continue
        urls.append(url)
    return tuple(urls)


def join(base_url: str, path: str) -> str:
    """The URL a client calls: its base URL and the request's path (a path that is a URL is kept)."""
    if "://" in path:
        return path
    return str(base_url).rstrip("/") + "/" + str(path).lstrip("/")


@functools.lru_cache(maxsize=256)
def is_capture_url(url: str, urls_raw: str) -> bool:
    """Whether a call to ``url`` is captured under ``LIGHTSPAN_CAPTURE_URLS=urls_raw`` (cached: a
    client calls a few URLs many times; the variable's value is part of the key)."""
    target = canonical(url)
    if target is None:
        return False
    urls = parse_capture_urls(urls_raw)
    if urls is None:
        return target[1] == LOOPBACK
    return any(covers(base, target) for base in urls)


def gateway_mode(urls_raw: str) -> bool:
    """``LIGHTSPAN_CAPTURE_URLS=none``: a lightspan gateway captures the calls, this process does not."""
    return urls_raw.strip().lower() == "none"
