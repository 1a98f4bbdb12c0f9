"""Before any rollout runs: does the OTLP endpoint speak the agents' protocol?

An OTLP/HTTP exporter pointed at a gRPC port (the collector's 4317, which most deployments
configure) logs "Failed to export spans batch" and nothing else happens: the agent exits 0 and
nothing is stored. So ``lightspan rollout`` first sends the endpoint an empty export request in the
agents' protocol; an endpoint that does not take it is refused with one line, and one that speaks
the other protocol is named as such, with the fix (:func:`check`). An empty request stores nothing.
"""

from __future__ import annotations

import http.client
import socket
from urllib.parse import urlsplit

from lightspan.core.config import ConfigError

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"   # + empty SETTINGS
_GRPC_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_ANSWERED = (429, 503)   # an OTLP/HTTP receiver that is busy still speaks the protocol


def _refuse(problem: str, fix: str) -> ConfigError:
    return ConfigError("rollout", "otlp_endpoint", problem, fix)


def _host_port(url: str, default_port: int) -> tuple[str, int, str]:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return parts.hostname or "127.0.0.1", parts.port or default_port, parts.scheme or "http"


def http_export(url: str, timeout_s: float) -> int:
    """The status an empty OTLP/HTTP protobuf export to ``url`` (``.../v1/traces``) gets; raises OSError
    or ``http.client.HTTPException`` when no HTTP/1.1 answer comes."""
    host, port, scheme = _host_port(url, 4318)
    conn = (http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection)(host, port,
                                                                                             timeout=timeout_s)
    try:
        conn.request("POST", urlsplit(url).path or "/v1/traces", body=b"",
                     headers={"Content-Type": "application/x-protobuf"})
        return conn.getresponse().status
    finally:
        conn.close()


def speaks_http2(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` answers HTTP/2's connection preface with a SETTINGS frame (a gRPC server)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(_H2_PREFACE)
            head = sock.recv(9)
    except OSError:
        return False
    return len(head) >= 4 and head[3] == 0x04


def grpc_export(endpoint: str, timeout_s: float) -> str | None:
    """None when an empty OTLP/gRPC export to ``endpoint`` is acknowledged; else the gRPC status."""
    import grpc

    host, port, _ = _host_port(endpoint, 4317)
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            channel.unary_unary(_GRPC_EXPORT)(b"", timeout=timeout_s)
            return None
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"


def check(traces_url: str, protocol: str, timeout_s: float = 5.0) -> None:
    """Raise a ConfigError (one line: what the endpoint is, and the fix) unless ``traces_url`` takes
    an empty export in ``protocol`` (``http/protobuf`` or ``grpc``)."""
    host, port, scheme = _host_port(traces_url, 4317 if protocol == "grpc" else 4318)
    if protocol == "grpc":
        error = grpc_export(traces_url, timeout_s)
        if error is None:
            return
        try:
            status = http_export(f"{scheme}://{host}:{port}/v1/traces", timeout_s)
        except (OSError, http.client.HTTPException):
            status = None
        if status is not None and (200 <= status < 300 or status in _ANSWERED):
            raise _refuse(f"{traces_url} speaks OTLP/HTTP, not OTLP/gRPC (--otlp-protocol grpc): the agents' "
                          "exports would be lost",
                          f"pass --otlp-protocol http/protobuf, or --otlp-endpoint with the collector's OTLP/gRPC "
                          f"port (http://{host}:4317 by default)")
        raise _refuse(f"no OTLP/gRPC receiver takes an export at {traces_url} ({error})",
                      "start the collector (lightspan collector) or pass its OTLP/gRPC endpoint as --otlp-endpoint")
    try:
        status = http_export(traces_url, timeout_s)
    except ConnectionRefusedError:
        raise _refuse(f"nothing listens at {traces_url}",
                      "start the collector (lightspan collector) or pass its OTLP/HTTP base URL as "
                      "--otlp-endpoint") from None
    except (OSError, http.client.HTTPException) as e:
        if scheme == "http" and speaks_http2(host, port, timeout_s):
            raise _refuse(f"{traces_url} speaks OTLP/gRPC, not OTLP/HTTP (the agents export http/protobuf): their "
                          "exports would be lost",
                          f"pass --otlp-endpoint http://{host}:4318 (the collector's OTLP/HTTP port by default) or "
                          "--otlp-protocol grpc") from None
        raise _refuse(f"no OTLP/HTTP answer from {traces_url} ({type(e).__name__}: {e})",
                      "pass the collector's OTLP/HTTP base URL as --otlp-endpoint (http://HOST:4318)") from None
    if not (200 <= status < 300 or status in _ANSWERED):
        raise _refuse(f"{traces_url} answers HTTP {status} to an empty OTLP/HTTP export: not an OTLP traces receiver",
                      "pass the collector's OTLP/HTTP base URL as --otlp-endpoint (http://HOST:4318)")
