"""``policy.json``: which policy version vLLM serves, and from which checkpoint.

One writer (the trainer, after a weight sync was verified) and one reader, :func:`read`, for
every part that needs the served version: the rollout runner and the gateway put it on each
call's span, the web UI decodes tokens with its tokenizer, ``lightspan status`` reports it.
Standard library only: the rollout runner reads it inside an agent's environment.

The file is ``{"version": int, "path": str, "time_unix_nano": int}``, replaced atomically
(a temporary file, then a rename; in a bucket, one PUT), so a reader sees the old or the new one,
never a mix. In a bucket (``s3://…``) reading it needs pyarrow (lightspan.store.objects).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from lightspan.store.layout import data_dir as _data_dir
from lightspan.store.layout import is_remote, read_text, write_text

FILE = "policy.json"


@dataclass(frozen=True)
class Policy:
    version: int          # 0 is the initial model, before any training step
    path: str             # the checkpoint directory vLLM serves (absolute)
    time_unix_nano: int   # when it was published


def path(data_dir: str | os.PathLike | None = None) -> Path | str:
    """Where policy.json is: a path, or an ``s3://`` URL for a data location in a bucket."""
    root = _data_dir(data_dir)
    return f"{root}/{FILE}" if is_remote(root) else root / FILE


def read(data_dir: str | os.PathLike | None = None) -> Policy | None:
    """The published policy, or None when none is (no file yet, or one that does not parse:
    the trainer writes it atomically, so that is a file someone else wrote; it is logged by the
    caller that cares)."""
    try:
        doc = json.loads(read_text(path(data_dir)))
        return Policy(int(doc["version"]), str(doc.get("path") or ""), int(doc.get("time_unix_nano") or 0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def served_version(data_dir: str | os.PathLike | None = None) -> int:
    """The served policy version: the published one, else 0 (the initial model)."""
    policy = read(data_dir)
    return 0 if policy is None else policy.version


def write(data_dir: str | os.PathLike, version: int, checkpoint: str | os.PathLike) -> Policy:
    """Publish ``version`` served from ``checkpoint``, atomically (temporary file + rename)."""
    policy = Policy(int(version), str(Path(checkpoint).resolve()), time.time_ns())
    write_text(path(data_dir), json.dumps({"version": policy.version, "path": policy.path,
                                           "time_unix_nano": policy.time_unix_nano}) + "\n")
    return policy
