"""``policy.json``: which version of each policy vLLM serves, and from which checkpoint.

One writer (the trainer, after a weight sync was verified) and one reader module, this one, for
every part that needs a served version: the rollout runner and the gateway put it on each call's
span, the web UI decodes tokens with its tokenizer, ``lightspan status`` lists the policies.
Standard library only: the rollout runner reads it inside an agent's environment.

A data directory trains one unnamed policy (no ``--policies``) or several named ones
(:mod:`lightspan.store.policies`); the file is, respectively::

    {"version": 3, "path": "/…/checkpoints/v000003", "time_unix_nano": …}
    {"policies": {"writer":  {"version": 3, "path": "/…/checkpoints/writer/v000003", "time_unix_nano": …},
                  "checker": {"version": 1, "path": "/…/checkpoints/checker/v000001", "time_unix_nano": …}}}

A named policy is served under its name (the model name its agents call), so the version that
served a call follows from the model name the call used (:func:`served_by`). The file is replaced
atomically (a temporary file, then a rename), so a reader sees the old or the new one, never a
mix (in a bucket, ``s3://…``, one PUT; reading it there needs pyarrow, lightspan.store.objects).
Writers of named policies update their own entry under a lock (``policy.json.lock``), so trainers
of different policies may publish at once; a bucket has no lock, so there the policies of one data
location publish from one process (one ``lightspan train``, as trainer/policies.py runs them).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lightspan.store.location import Location

FILE = "policy.json"
_VERSIONED = re.compile(r"(.+)-v(\d+)")


@dataclass(frozen=True)
class Policy:
    version: int          # 0 is the initial model, before any training step
    path: str             # the checkpoint directory vLLM serves (absolute)
    time_unix_nano: int   # when it was published
    name: str = ""        # the policy's name (its served model name); "" for the unnamed policy


def path(data_dir: str | os.PathLike | None = None) -> Path | str:
    """Where policy.json is: a path, or an ``s3://`` URL for a data location in a bucket."""
    return Location.of(data_dir).name(FILE)


def _entry(doc, name: str = "") -> Policy:
    return Policy(int(doc["version"]), str(doc.get("path") or ""), int(doc.get("time_unix_nano") or 0), name)


def _load(data_dir) -> dict:
    try:
        doc = json.loads(Location.of(data_dir).read_text(FILE))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def read_all(data_dir: str | os.PathLike | None = None) -> dict[str, Policy]:
    """Every published policy by name (``""``: the unnamed one); empty when none is published (no
    file yet, or one that does not parse: the trainer writes it atomically, so that is a file someone
    else wrote). An entry that does not parse is left out."""
    doc = _load(data_dir)
    out = {}
    if "version" in doc:
        try:
            out[""] = _entry(doc)
        except (KeyError, TypeError, ValueError):
            pass
    named = doc.get("policies")
    for name, entry in (named.items() if isinstance(named, dict) else ()):
        try:
            out[str(name)] = _entry(entry, str(name))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return out


def read(data_dir: str | os.PathLike | None = None, name: str | None = None) -> Policy | None:
    """The published policy ``name``; without a name the unnamed policy — None when a data directory
    trains named policies only, whose versions differ: ask by name (:func:`served_by`)."""
    return read_all(data_dir).get(name or "")


def served_version(data_dir: str | os.PathLike | None = None, name: str | None = None) -> int:
    """The served version of policy ``name`` (default: the unnamed one): the published one, else 0
    (the initial model)."""
    policy = read(data_dir, name)
    return 0 if policy is None else policy.version


def served_versions(data_dir: str | os.PathLike | None = None) -> dict[str, int]:
    """The served version of every named policy, by name (= served model name); empty without any."""
    return {name: p.version for name, p in read_all(data_dir).items() if name}


def served_by(published: Mapping[str, Policy], model: str | None) -> Policy | None:
    """The named policy that served a call to model ``model``: the policy of that name (its stable
    name), or ``<name>-v<N>`` (the versioned name weight sync loads each version under: version N);
    None for any other model (the base model, the unnamed policy)."""
    if not model:
        return None
    if model in published:
        return published[model]
    m = _VERSIONED.fullmatch(model)
    if m and m.group(1) in published:
        p = published[m.group(1)]
        return Policy(int(m.group(2)), p.path if p.version == int(m.group(2)) else "", p.time_unix_nano, p.name)
    return None


def write(data_dir: str | os.PathLike, version: int, checkpoint: str | os.PathLike, *,
          name: str | None = None) -> Policy:
    """Publish ``version`` of policy ``name`` (default: the unnamed one) served from ``checkpoint``,
    atomically (temporary file + rename; one PUT in a bucket). A named entry replaces only its own
    entry (other policies' stay); the unnamed policy replaces the whole file."""
    where = Location.of(data_dir)
    policy = Policy(int(version), str(Path(checkpoint).resolve()), time.time_ns(), name or "")
    entry = {"version": policy.version, "path": policy.path, "time_unix_nano": policy.time_unix_nano}
    with where.lock(f"{FILE}.lock"):           # read-modify-write of the named entries
        named = _load(where).get("policies") if name else None
        doc = {"policies": {**(named if isinstance(named, dict) else {}), name: entry}} if name else entry
        where.put_text(FILE, json.dumps(doc) + "\n")
    return policy
