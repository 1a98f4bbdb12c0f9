"""The builder's watermark: what an incremental build has already read (``data_dir/lightningrl/state.json``).

A build reads only the rollouts that have a span received after the watermark, plus the
rollouts the previous build left *pending* because they can become buildable with no new
span: ``incomplete`` (the grace period runs out) and ``small_group`` (a sibling completes).
Every other unbuilt rollout changes only when a span of it arrives, which puts it past the
watermark again. The anti-join on ``transitions`` stays the guarantee that nothing is emitted
twice; the watermark only saves reading.

The state is kept per *selection*: the config fields that decide which rollouts are built and
how (everything but ``data_dir``, ``incremental`` and ``watermark_lag_s``). A build with another
selection (another split, agent regex, window, ...) starts from scratch, since rollouts the
old selection dropped for good may be wanted now. The last ``MAX_SELECTIONS`` are kept.

The next watermark is ``min(newest span read, now − watermark_lag_s)``, never lower than the
last: spans received shortly before a build may still be in the collector's queue, so the next
build reads that stretch again.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from lightspan import store
from lightspan.core.config import to_dict

STATE_FILE = "lightningrl/state.json"
MAX_SELECTIONS = 16
_NOT_SELECTION = ("data_dir", "incremental", "watermark_lag_s")


@dataclass(frozen=True)
class Watermark:
    received_unix_nano: int = -1      # spans received after this are new; -1: read every span
    pending: tuple[str, ...] = ()     # rollout keys to read again even without a new span


def _fields(config) -> dict:
    fields = {k: v for k, v in to_dict(config).items() if k not in _NOT_SELECTION}
    if fields.get("policies"):      # what the policies say, not where the file is
        fields["policies"] = [to_dict(p) for p, _ in config.policy_configs]
    else:                           # the key of a build without policies stays what it was
        fields.pop("policies", None)
    return fields


def selection(config) -> str:
    """A stable key of the config fields that select and shape the transitions."""
    return hashlib.sha256(json.dumps(_fields(config), sort_keys=True).encode()).hexdigest()[:16]


def load(config) -> Watermark:
    """The watermark of ``config``'s selection, or a fresh one (read everything)."""
    entry = _read(config.data_dir).get(selection(config))
    if not entry:
        return Watermark()
    return Watermark(int(entry["received_unix_nano"]), tuple(entry["pending"]))


def save(config, watermark: Watermark) -> Path | str:
    """Store ``watermark`` for ``config``'s selection, atomically (temp file + rename; one PUT in a bucket)."""
    where = store.Location.of(config.data_dir)
    selections = _read(where)
    fields = _fields(config)
    selections[selection(config)] = {
        "received_unix_nano": watermark.received_unix_nano, "pending": sorted(watermark.pending),
        "updated_unix_nano": time.time_ns(), "config": fields}
    newest = sorted(selections.items(), key=lambda kv: kv[1].get("updated_unix_nano", 0))[-MAX_SELECTIONS:]
    where.put_text(STATE_FILE, json.dumps({"version": 1, "selections": dict(newest)}, indent=1) + "\n")
    return where.name(STATE_FILE)


def _read(data_dir) -> dict:
    try:
        state = json.loads(store.Location.of(data_dir).read_text(STATE_FILE))
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, OSError):      # a damaged state costs one full read, not a failed build
        return {}
    return dict(state.get("selections", {})) if state.get("version") == 1 else {}
