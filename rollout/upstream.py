"""The gateway's client of vLLM: one connection pool, no cookies kept, no redirects followed.

Nothing of one caller may reach another through it: a ``Set-Cookie`` of one answer is never sent
with the next call (:class:`_NoCookies`), and a redirect is handed back rather than followed.
:func:`lines` reads a streamed answer line by line as it arrives.
"""

from __future__ import annotations

from http.cookiejar import CookiePolicy

import requests


class _NoCookies(CookiePolicy):
    """The upstream session keeps no cookie: one caller's Set-Cookie never reaches another's call."""
    netscape, rfc2965, hide_cookie2 = True, False, False

    def set_ok(self, cookie, request) -> bool:
        return False

    def return_ok(self, cookie, request) -> bool:
        return False

    def domain_return_ok(self, domain, request) -> bool:
        return False

    def path_return_ok(self, path, request) -> bool:
        return False


class Upstream:
    """Requests to vLLM at ``base`` (without ``/v1``), at most ``pool`` connections kept open."""

    def __init__(self, base: str, pool: int, timeout_s: float):
        self.base, self.timeout_s = base, timeout_s
        self.session = requests.Session()
        self.session.cookies.set_policy(_NoCookies())
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=pool)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def send(self, method: str, path: str, headers: dict, body: bytes, stream: bool = False, base: str | None = None):
        """One request (to ``base`` instead of this upstream's: a replica); connecting may take 5 s,
        each read ``timeout_s``."""
        return self.session.request(method, (base or self.base) + path, data=body, headers=headers, stream=stream,
                                    allow_redirects=False, timeout=(5, self.timeout_s))


def lines(raw):
    """Lines of a streamed body as soon as they arrive, chunked or not (``iter_lines`` would wait
    for a full read of a body that is not chunk-encoded)."""
    pending = b""
    while data := raw.read1(65536, decode_content=True):
        *got, pending = (pending + data).split(b"\n")
        for line in got:
            yield line.rstrip(b"\r")
    if pending:
        yield pending.rstrip(b"\r")
