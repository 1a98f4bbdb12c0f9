"""A real S3-API server for the tests: moto's standalone server (``moto[server]``), started as its
own process on loopback.

Why moto: it is the S3 API over HTTP (the same requests the AWS SDK inside pyarrow sends to AWS
or MinIO: PUT, multipart uploads, ListObjectsV2, DELETE), pip-installable (MinIO's server is a Go
binary that no package registry here ships), and starts in about a second. It keeps objects in
memory, so a restarted server is empty. The tests talk to it only over HTTP, through the same
code paths as production (lightspan.store.objects); no client is mocked.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from lightspan.runs import free_ports

# credentials the server accepts (any); the standard variables every AWS client reads
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "lightspan-test", "AWS_SECRET_ACCESS_KEY": "lightspan-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}


class S3Server:
    """``python -m moto.server`` on 127.0.0.1:``port``; ``env`` points AWS clients at it."""

    def __init__(self, log_path: Path, port: int | None = None):
        self.port = port or free_ports(1)[0]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> "S3Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited:\n{self.log_path.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"moto server not listening after {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (S3 CreateBucket, through pyarrow); returns ``s3://name``."""
        import pyarrow.fs as pafs

        host = self.endpoint.split("://", 1)[1]
        fs = pafs.S3FileSystem(endpoint_override=host, scheme="http", allow_bucket_creation=True,
                               access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                               secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region="us-east-1")
        fs.create_dir(name)
        return f"s3://{name}"


@contextmanager
def aws_environment(env: dict):
    """``env`` in os.environ for the block (this process's AWS clients read it), restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
