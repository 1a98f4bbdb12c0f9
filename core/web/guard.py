"""Tokens and cross-site checks of the shared server (see :mod:`lightspan.core.web`)."""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from lightspan.core.config import is_loopback
from lightspan.core.web.request import STATE_CHANGING, HTTPError, Request


def same_token(given: str | None, token: str) -> bool:
    """Constant-time comparison of a presented secret with the configured one."""
    return hmac.compare_digest((given or "").encode("utf-8", "surrogateescape"), token.encode())


def bearer(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` value carries ``token`` (always true when no token is set)."""
    if not token:
        return True
    scheme, _, value = (header or "").partition(" ")
    return scheme.lower() == "bearer" and same_token(value.strip(), token)


def _host_name(value: str) -> str:
    """The name of a ``Host`` header or an Origin's netloc, without port and brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class Guard:
    """The cross-site checks of one server. ``allowed_hosts``: names besides IP literals and
    ``localhost`` that the ``Host`` header may carry (``*`` allows any); ``field`` names the
    config field that sets them, for the error message."""
    allowed_hosts: tuple[str, ...] = ()
    field: str = "allowed_hosts"

    def _named(self, name: str) -> bool:
        return "*" in self.allowed_hosts or name in {h.lower() for h in self.allowed_hosts}

    def check(self, request: Request) -> None:
        """Raise 403 for a request from another site (see the module docstring)."""
        host = request.headers.get("host")
        if host is not None:
            name = _host_name(host)
            # an IP literal cannot be a rebinding attack: the attacker's page would have its own name
            if not (_is_ip(name) or is_loopback(name) or self._named(name)):
                raise HTTPError(403, f"Host {host[:80]!r} is not served here (DNS-rebinding guard): "
                                     f"add it to {self.field}")
        if request.method in STATE_CHANGING:
            self._origin(request)

    def same_origin(self, request: Request) -> None:
        """Raise 403 for a request that a page of another site made, whatever its method: for a GET
        that costs the server (a query), which an ``<img>`` on any page can send without an
        ``Origin``. Browsers say who asked in ``Sec-Fetch-Site``: ``same-origin`` and ``none`` (the
        user's own navigation) pass, as does a client that sends no such header (curl, scripts)."""
        site = (request.headers.get("sec-fetch-site") or "").strip().lower()
        if site in ("cross-site", "same-site"):   # same-site: another port of this host is another origin
            raise HTTPError(403, f"request from another site (Sec-Fetch-Site: {site}) refused; a browser page "
                                 "may call this route from this server's own origin only")
        self._origin(request)

    def _origin(self, request: Request) -> None:
        origin = request.headers.get("origin")
        if origin is None:
            return
        host = request.headers.get("host")
        netloc = urlsplit(origin).netloc.lower() if origin != "null" else ""
        name = _host_name(netloc) if netloc else ""
        if not name or not (netloc == (host or "").strip().lower() or is_loopback(name) or self._named(name)):
            raise HTTPError(403, f"cross-site request from Origin {origin[:80]!r} refused; a browser page may "
                                 f"call this server from its own origin or one in {self.field}")


