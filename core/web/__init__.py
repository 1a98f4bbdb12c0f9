"""The one HTTP server of every lightspan service: the standard library's, hardened, in one place.

The collector's OTLP/HTTP receiver and API, the gateway and the trainer's metrics page are
handlers served by :class:`Server` (``http.server`` underneath: a thread per connection, keep-alive,
chunked streaming; ``start()`` binds and returns the port, failing fast with ``OSError``; ``stop()``
may be followed by ``start()`` again). uvicorn was measured against it on the collector's ingest
benchmark and was slower on small requests (bench/README.md), so the bounds are built here.
What a server holds is bounded (:class:`Limits`):

- **connections** (and so threads): past ``max_connections`` open connections a new one is
  answered 503 with ``Retry-After`` and closed; past twice that it is closed at once, so file
  descriptors stay free for the WAL, Parquet and compaction;
- **read time**: a request's head and body must arrive within ``read_timeout_s`` of its first
  byte (every read waits only for the time left, so a client dripping bytes gains nothing); past
  it the request is answered 408 and its connection closed; an idle keep-alive connection is
  closed after ``idle_timeout_s``;
- **request bytes**: the bodies being read or handled share one :class:`ByteBudget` (one per
  server, or one shared by several servers and gRPC); a body that does not fit is refused with
  503 + ``Retry-After``; each body is also capped by its route (413);
- **head size** (64 KiB a line, 100 header lines: the standard library's limits) and the **listen
  backlog** (``backlog``).

The package: :mod:`.request` (limits, budget, requests and answers), :mod:`.guard` (tokens and
cross-site checks), :mod:`.server` (the server). A handler is
``handler(request: Request) -> Response | None`` (None once it has streamed its own
answer with :meth:`Request.start` and :meth:`Request.write`); raising :class:`HTTPError` answers
``{"error": message}`` with that status.

Cross-site use (:class:`Guard`): a ``Host`` header must name the machine (an IP literal, or
``localhost``) or one of the configured names, so a DNS-rebinding page cannot read or write;
state-changing requests carrying an ``Origin`` must come from the server's own origin or an
allowed one; JSON routes refuse other content types (:meth:`Request.json`), so a cross-site
``text/plain`` form cannot post there without a CORS preflight; a GET that costs the server (a
query) can refuse other sites' pages too (:meth:`Guard.same_origin`). :class:`Turns` bounds how many
handlers of one kind of work run and wait at once, :class:`Allowance` how many bytes of it.
"""

from lightspan.core.config import is_loopback
from lightspan.core.web.guard import Guard, bearer, same_token
from lightspan.core.web.request import (DRAIN_LIMIT, ByteBudget, ClientGone, Handler, HTTPError, Limits, Request, Response,
                                    decode_json, json_response, retry_later)
from lightspan.core.web.server import Server
from lightspan.core.web.turns import Allowance, Turns

__all__ = ["DRAIN_LIMIT", "Allowance", "ByteBudget", "ClientGone", "Guard", "HTTPError", "Handler", "Limits", "Request",
           "Response", "Server", "Turns", "bearer", "decode_json", "is_loopback", "json_response", "retry_later", "same_token"]
