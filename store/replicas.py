"""The vLLM replicas: where they are, and which of them serve the published policy.

Two parts share this contract: the trainer syncs every replica and writes ``replicas.json``
(lightspan.trainer.replicas); the gateway spreads rollouts over the replicas in rotation
(lightspan.rollout.replicas). Standard library only.

A replica target is a base URL (``http://vllm-0.vllm:8000``), or ``dns+http://NAME:PORT``: every
address ``NAME`` resolves to (a Kubernetes headless Service answers with one per ready pod), as
``http://ADDRESS:PORT``, resolved again by each reader.

``replicas.json`` (beside policy.json, replaced atomically; one PUT in a bucket) is
``{"version": N, "time_unix_nano": t, "replicas": {url: {"version": v, "in_rotation": bool,
"max_abs_logprob_diff": d, "error": str}}}``: the last sync's outcome per replica.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from lightspan.store.location import Location

log = logging.getLogger(__name__)

FILE = "replicas.json"
DNS_PREFIX = "dns+"


def resolve(targets, *, getaddrinfo: Callable = socket.getaddrinfo) -> list[str]:
    """The replicas' base URLs: each target as given, or one URL per address of a ``dns+`` target
    (sorted; IPv6 in brackets). A name that resolves to nothing gives none (logged)."""
    urls: list[str] = []
    for target in targets:
        target = str(target).strip().rstrip("/")
        if not target.startswith(DNS_PREFIX):
            urls.append(target)
            continue
        parts = urlsplit(target[len(DNS_PREFIX):])
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            infos = getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            log.warning("%s resolves to no address (%s): no replica there now", target, exc)
            continue
        addresses = sorted({info[4][0] for info in infos})
        urls += [f"{parts.scheme}://{f'[{a}]' if ':' in a else a}:{port}{parts.path}" for a in addresses]
    return list(dict.fromkeys(urls))


def path(data_dir: str | os.PathLike | None = None):
    return Location.of(data_dir).name(FILE)


def write(data_dir, version: int | None, status: dict[str, dict]) -> None:
    """Publish the last sync's outcome per replica (atomically)."""
    doc = {"version": version, "time_unix_nano": time.time_ns(), "replicas": status}
    Location.of(data_dir).put_text(FILE, json.dumps(doc, indent=1) + "\n")


def read(data_dir=None) -> dict | None:
    """The published rotation, or None when there is none (or it does not parse)."""
    try:
        doc = json.loads(Location.of(data_dir).read_text(FILE))
        return doc if isinstance(doc, dict) and isinstance(doc.get("replicas"), dict) else None
    except (OSError, ValueError):
        return None


def out_of_rotation(doc: dict | None) -> set[str]:
    """The replicas the last sync took out of rotation (none without a published rotation)."""
    if not doc:
        return set()
    return {url for url, s in doc["replicas"].items() if isinstance(s, dict) and not s.get("in_rotation")}
