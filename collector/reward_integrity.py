"""Rewards the policy under training cannot set: the collector, not the sender, decides a reward's
source and its order (docs/architecture.md, "Rewards").

1. **Only the API writes API rewards.** ``POST /v1/rewards`` writes spans of scope
   :data:`~lightspan.store.schema.REWARD_SCOPE`. An OTLP span of that scope is rejected
   (:func:`drop_reserved`, before the request reaches the WAL): counted in ``spans_rejected_total``
   and ``reward_forgeries_total``, named in the OTLP ``partial_success``; its siblings are kept.
2. **A reward's source is the collector's to say.** The ``rewards`` view reads a source only from
   the API's spans; any other reward span is the agent's. A ``lightspan.reward.source`` that an OTLP
   span claims is moved aside when the span is stored (to ``lightspan.reward.claimed_source``,
   :mod:`lightspan.collector.otlp`), counted in ``reward_claims_total`` and warned about in the
   ``partial_success``; the span and its reward are kept, as the agent's: nothing it sent is lost.
3. **A posted reward's ids cannot be predicted.** :func:`reward_ids` is an HMAC-SHA256 of the
   reward's key (rollout, name, id), keyed with a secret the collector keeps in its data location
   (:func:`load_key`, created on the first start). Posting a reward again finds the same ids
   (idempotent, across restarts, and across collectors that share a bucket), while no sender can
   occupy them first: an OTLP span with a posted reward's ids would make the store drop the real one
   as a copy (the first copy received wins).
4. **Rewards are ordered by when the collector received them**, never by the sender's clock
   (``store.REWARD_ORDER`` in the views; the builder's ``_lrl_rewards``).

Each check costs the OTLP path one comparison per scope (1) and nothing per attribute that is not
the source (2): ingest stays as fast (bench/README.md, "Collector ingest").
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from lightspan import store
from lightspan.collector.outcomes import CollectorError
from lightspan.store.schema import REWARD_SCOPE

log = logging.getLogger(__name__)

KEY_FILE = "reward-ids.key"
"""The secret of :func:`reward_ids`, 64 hex digits, at the root of the data location (outside every
table directory, so the SQL endpoint cannot read it)."""
_KEY_BYTES = 32


def load_key(location) -> bytes:
    """The data location's reward-id secret, created on first use (the first writer's wins on disk;
    in a bucket, where two collectors may start at once on an empty prefix, the one read back).
    Raises :class:`CollectorError` naming the file when it cannot be read, written or used."""
    where = store.Location.of(location)
    path = where.name(KEY_FILE)
    try:
        key = _read(where, path)
        if key is not None:
            return key
        where.create(KEY_FILE, (secrets.token_bytes(_KEY_BYTES).hex() + "\n").encode())
        key = _read(where, path)
    except OSError as exc:
        raise CollectorError(f"cannot read or create the reward-id secret {path}: {exc}") from None
    if key is None:
        raise CollectorError(f"{path} vanished right after it was written")
    log.info("created the reward-id secret %s (keep it with the data: posted rewards are keyed by it)", path)
    return key


def _read(where, path) -> bytes | None:
    try:
        text = where.read_text(KEY_FILE).strip()
    except FileNotFoundError:
        return None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != _KEY_BYTES:
        raise CollectorError(f"{path} does not hold a reward-id secret ({2 * _KEY_BYTES} hex digits): restore it from "
                        "a backup, or delete it to make a new one (rewards posted before then are no longer "
                        "recognised when posted again)")
    return key


def reward_ids(secret: bytes, rollout_id: str, name: str, key: str | None) -> tuple[bytes, bytes]:
    """The (trace_id, span_id) of one posted reward: the same for the same key, unknown to whoever
    lacks ``secret``."""
    message = "\x00".join(["lightspan.reward", rollout_id, name, key or ""]).encode()
    digest = hmac.new(secret, message, hashlib.sha256).digest()
    trace_id, span_id = digest[:16], digest[16:24]
    # an all-zero id is invalid in OTLP; astronomically unlikely, but never emit one
    return trace_id if any(trace_id) else b"\x01" * 16, span_id if any(span_id) else b"\x01" * 8


def drop_reserved(request: ExportTraceServiceRequest) -> tuple[int, str | None]:
    """Remove from an OTLP request every span of the API's reward scope; returns how many and a
    rejection reason naming the first (None when there was none)."""
    dropped, first = 0, None
    for r, resource_spans in enumerate(request.resource_spans):
        for s, scope_spans in enumerate(resource_spans.scope_spans):
            if scope_spans.scope.name == REWARD_SCOPE and scope_spans.spans:
                if first is None:
                    first = (f"resource_spans[{r}].scope_spans[{s}]: scope {REWARD_SCOPE!r} is the collector's own "
                             "(the rewards its API writes); post rewards to POST /v1/rewards, or emit them under "
                             "another scope as the agent's")
                dropped += len(scope_spans.spans)
                del scope_spans.spans[:]
    return dropped, first
