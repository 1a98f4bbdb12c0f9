"""What a data location in an S3-compatible bucket (``s3://bucket/prefix``) needs beside a directory's:
the filesystem, its endpoint and credentials, and errors that name them. The location itself, with
its listing, reads, atomic puts and deletes, is :class:`lightspan.store.location.Location`.

Everything goes through pyarrow's own S3 filesystem (``pyarrow.fs.S3FileSystem``, the AWS SDK
for C++ inside the pyarrow wheel): listing, reading, writing and deleting objects, and DuckDB's
reads of them. DuckDB's ``httpfs`` extension is not used: for DuckDB 2.0.1 ``INSTALL httpfs``
downloads it from DuckDB's extension repository (out of reach offline and from many clusters), and
the builds on PyPI stop at DuckDB 1.5.5, which 2.0.1 refuses to load (docs/architecture.md). The views scan
``pyarrow.dataset`` objects over the files (DuckDB pushes projections and filters into them;
measured in bench/README.md against reading the same objects through fsspec), and connections
that read files by name (``read_parquet('s3://…')``: the transition builder, compaction) get the
same filesystem registered through fsspec's wrapper of it (:func:`register`).

Credentials are the standard AWS ones, read by the SDK itself: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``~/.aws/credentials`` and ``~/.aws/config``
(``AWS_PROFILE``), instance and pod roles. The endpoint of a store that is not AWS (MinIO, Ceph,
a cloud's S3 API) is read as botocore and the AWS CLI read it: ``AWS_ENDPOINT_URL_S3``, else
``AWS_ENDPOINT_URL``, else the profile's ``endpoint_url`` (or its ``s3 = endpoint_url = …``).

Objects are immutable and each is written in one request (a PUT, or a multipart upload for large
ones that becomes visible whole at its completion), so a reader never sees half a file; there is
no rename, which is why compaction and retention order their writes as lightspan.collector.compact
explains. A location that is remote is never replaced by a local directory: every failure to
reach the bucket is an ``OSError`` naming it and the endpoint (without the URL's credentials).
"""

from __future__ import annotations

import configparser
import functools
import os

import pyarrow.fs as pafs

from lightspan.core.config import redact
from lightspan.store.layout import REMOTE_SCHEME, bucket_path, is_remote

__all__ = ["REMOTE_SCHEME", "is_remote", "endpoint", "filesystem", "path_of", "url_of", "named", "check", "register"]


def endpoint() -> str:
    """The S3 endpoint URL from the standard AWS settings, or "" for AWS itself."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return os.environ[name]
    path = os.path.expanduser(os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config")
    profile = os.environ.get("AWS_PROFILE") or "default"
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
    except configparser.Error:
        return ""
    section = profile if profile == "default" else f"profile {profile}"
    if not parser.has_section(section):
        return ""
    nested = parser.get(section, "s3", fallback="")     # s3 =\n    endpoint_url = ...
    for line in nested.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "endpoint_url" and value.strip():
            return value.strip()
    return parser.get(section, "endpoint_url", fallback="").strip()


@functools.lru_cache(maxsize=8)
def _filesystem(endpoint_url: str) -> pafs.S3FileSystem:
    options = {
        # the object is written in one PUT at close when it is small (below the SDK's part size),
        # instead of a multipart upload of three requests
        "allow_delayed_open": True,
        "connect_timeout": 2.0,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3),
    }
    if endpoint_url:
        scheme, _, rest = endpoint_url.partition("://")
        if not rest:
            scheme, rest = "https", endpoint_url
        options.update(endpoint_override=rest.rstrip("/"), scheme=scheme)
    return pafs.S3FileSystem(**options)


def filesystem() -> pafs.S3FileSystem:
    """The process's S3 filesystem, for the endpoint the AWS settings name now."""
    return _filesystem(endpoint())


def path_of(url: str) -> str:
    """``s3://bucket/key`` → ``bucket/key``, the path pyarrow's filesystem takes."""
    return bucket_path(url)


def url_of(path: str) -> str:
    return REMOTE_SCHEME + path.lstrip("/")


def _where() -> str:
    """The endpoint, for a message: without its credentials (lightspan.core.config.redact), and saying
    that credentials in its URL are not read."""
    url = endpoint()
    if not url:
        return "endpoint AWS; credentials from the AWS environment or ~/.aws"
    shown = redact(url)
    if shown != url:
        return (f"endpoint {shown}: credentials in the endpoint URL are not read, set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or ~/.aws/credentials) and drop them from the URL")
    return f"endpoint {shown}; credentials from the AWS environment or ~/.aws"


def named(url: str, exc: OSError) -> OSError:
    """``exc`` again, its message naming ``url`` and the endpoint (without credentials)."""
    return type(exc)(redact(f"{url}: {exc} ({_where()})"))


def check(url: str) -> None:
    """Raise ``OSError`` naming ``url`` unless its bucket answers (a listing of the prefix)."""
    bucket = path_of(url).split("/", 1)[0]
    info = None
    try:
        info = filesystem().get_file_info(bucket)
        filesystem().get_file_info(pafs.FileSelector(path_of(url), recursive=False, allow_not_found=True))
    except OSError as exc:
        raise named(url, exc) from exc
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(redact(f"{url}: bucket {bucket!r} does not exist at {endpoint() or 'AWS'}: create it"))


def register(con) -> None:
    """Let DuckDB connection ``con`` read and write ``s3://`` paths through pyarrow's filesystem."""
    from fsspec.implementations.arrow import ArrowFSWrapper

    con.register_filesystem(ArrowFSWrapper(filesystem()))
