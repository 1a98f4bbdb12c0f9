"""Bearer token on both transports and the API; TLS round trips with a certificate made here."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest
import requests
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from lightspan.collector.config import CollectorConfig
from lightspan.collector.server import EXPORT_METHOD, LOGS_EXPORT_METHOD
from lightspan.core.config import ConfigError, resolve
from tests.collector.helpers import api_url, grpc_call, grpc_exporter, http_exporter, make_spans, query, request_bytes

TOKEN = "0123456789abcdef-token"
BEARER = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for localhost and 127.0.0.1: (cert path, key path)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the TLS tests need the `openssl` command to make a self-signed certificate; "
                    "install it (apt-get install openssl)")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_token_guards_grpc_traces_and_logs(collector_factory, data_dir):
    collector = collector_factory(auth_token=TOKEN)
    payload = request_bytes(make_spans("no-token"))
    _, error = grpc_call(collector, payload)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in error.details()
    with grpc.insecure_channel(f"127.0.0.1:{collector.grpc_port}") as channel:
        for method in (EXPORT_METHOD, LOGS_EXPORT_METHOD):
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(method)(payload, timeout=5, metadata=[("authorization", "Bearer wrong")])
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.unary_unary(EXPORT_METHOD)(request_bytes(make_spans("raw-token")), timeout=5,
                                           metadata=list(BEARER.items()))
    assert grpc_exporter(collector).export(make_spans("exporter-no-token")) == SpanExportResult.FAILURE
    exporter = GrpcExporter(endpoint=f"127.0.0.1:{collector.grpc_port}", insecure=True, timeout=5, headers=BEARER)
    assert exporter.export(make_spans("exporter-token")) == SpanExportResult.SUCCESS
    collector.flush()
    assert query(data_dir, "SELECT DISTINCT rollout_id FROM spans ORDER BY 1") == [("exporter-token",), ("raw-token",)]
    assert collector.metrics.snapshot()["requests_refused_total"]["unauthenticated"] == 4


def test_token_guards_http_ingest_and_the_api_but_not_healthz(collector_factory, data_dir):
    collector = collector_factory(auth_token=TOKEN)
    refused = requests.post(f"http://127.0.0.1:{collector.http_port}/v1/traces", data=request_bytes(make_spans()),
                            headers={"Content-Type": "application/x-protobuf"}, timeout=5)
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"].startswith("Bearer")
    assert http_exporter(collector).export(make_spans("http-no-token")) == SpanExportResult.FAILURE
    assert http_exporter(collector, headers=BEARER).export(make_spans("http-token")) == SpanExportResult.SUCCESS
    wrong = {"Authorization": "Bearer not-it"}
    assert requests.get(api_url(collector, "/healthz"), timeout=5).status_code == 200
    for method, path, body in (("GET", "/metrics", None), ("POST", "/v1/flush", None),
                               ("POST", "/v1/rewards", {"rollout_id": "r", "value": 1}),
                               ("POST", "/v1/sql", {"sql": "SELECT 1"}), ("GET", "/v1/sql?q=SELECT+1", None)):
        for headers in ({}, wrong):
            answer = requests.request(method, api_url(collector, path), json=body, headers=headers, timeout=5)
            assert answer.status_code == 401 and "bearer token" in answer.json()["error"], (method, path)
        answer = requests.request(method, api_url(collector, path), json=body, headers=BEARER, timeout=5)
        assert answer.status_code == 200, (method, path, answer.text)
    collector.flush()
    assert query(data_dir, "SELECT rollout_id, count(*) FROM spans GROUP BY 1 ORDER BY 1") == [
        ("http-token", 3), ("r", 1)]


def test_token_from_the_environment_and_bad_tls_config():
    resolved = resolve(CollectorConfig, section="collector", environ={"LIGHTSPAN_COLLECTOR_AUTH_TOKEN": TOKEN})
    assert resolved.auth_token == TOKEN
    for overrides, field in (({"auth_token": "has space"}, "auth_token"),
                             ({"tls_cert_file": __file__}, "tls_key_file"),
                             ({"tls_cert_file": "/nonexistent.pem", "tls_key_file": __file__}, "tls_cert_file")):
        with pytest.raises(ConfigError) as info:
            CollectorConfig(**overrides)
        assert info.value.field == f"collector.{field}"


def test_tls_round_trip_on_grpc_http_and_api(collector_factory, data_dir, certificate, monkeypatch):
    cert, key = certificate
    # requests lets these override a Session's `verify`, i.e. the exporter's certificate_file
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    collector = collector_factory(tls_cert_file=str(cert), tls_key_file=str(key), auth_token=TOKEN)
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    grpc_tls = GrpcExporter(endpoint=f"localhost:{collector.grpc_port}", credentials=credentials, timeout=5,
                            headers=BEARER)
    assert grpc_tls.export(make_spans("grpc-tls")) == SpanExportResult.SUCCESS
    http_tls = HttpExporter(endpoint=f"https://127.0.0.1:{collector.http_port}/v1/traces", certificate_file=str(cert),
                            timeout=5, headers=BEARER)
    assert http_tls.export(make_spans("http-tls")) == SpanExportResult.SUCCESS
    # plain text to a TLS port fails on both transports, and the server keeps serving
    assert grpc_exporter(collector, timeout=2).export(make_spans("plain")) == SpanExportResult.FAILURE
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{collector.api_port}/healthz", timeout=5)
    with pytest.raises(requests.exceptions.SSLError):       # a client that does not trust the certificate
        requests.get(f"https://127.0.0.1:{collector.api_port}/healthz", timeout=5)
    api = f"https://127.0.0.1:{collector.api_port}"
    assert requests.get(f"{api}/healthz", verify=str(cert), timeout=5).json() == {"status": "ok"}
    answer = requests.post(f"{api}/v1/sql", json={"sql": "SELECT 1 AS one"}, headers=BEARER, verify=str(cert),
                           timeout=5)
    assert answer.json()["rows"] == [[1]]
    assert requests.post(f"{api}/v1/flush", headers=BEARER, verify=str(cert), timeout=5).json()["flushed_spans"] == 6
    assert query(data_dir, "SELECT DISTINCT rollout_id FROM spans ORDER BY 1") == [("grpc-tls",), ("http-tls",)]
