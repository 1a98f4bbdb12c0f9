"""Which vLLM replica the gateway sends a call to: one rollout stays on one replica.

A rollout's calls share their prefix (each turn resends the conversation so far), so keeping them
on one replica lets its prefix cache serve every turn after the first. :func:`rendezvous` is
highest-random-weight hashing (Thaler and Ravishankar 1998): the replica with the largest
``hash(key, replica)`` wins, so the choice is stable, and when a replica joins or leaves only the
rollouts whose winner it is (about 1/n of them) move. :class:`Upstreams` keeps the candidates:
the targets (base URLs, or ``dns+http://NAME:PORT`` for every address of a headless Service,
lightspan.store.replicas), less the replicas the trainer's last sync took out of rotation
(``replicas.json``).

Failover: a replica that refuses or resets a connection is marked down for ``down_s``
(:meth:`Upstreams.down`) and its rollouts go to their next replica in rendezvous order (their
prefix cache is lost; the others' rollouts do not move), then back once it is up again. With every
replica down a call goes to its own replica as before, and fails there (502).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time

from lightspan.store import replicas as rotation

log = logging.getLogger(__name__)

REFRESH_S = 2.0
"""How often the targets are resolved and replicas.json read again (at most: on the next call)."""

DOWN_S = 10.0
"""How long a replica that refused or reset a connection gets no call (``gateway.replica_down_s``)."""


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


def untraced_key(rollout_id: str | None, traceparent: str | None) -> str:
    """The key of a call the gateway passes through untraced (``GET /v1/models``, token counting, …):
    its rollout id, else the trace id of its W3C ``traceparent`` (the key a traced call of the same
    trace gets, its span being a child in that trace), else "" (one replica for all such calls)."""
    if rollout_id:
        return rollout_id
    m = _TRACEPARENT.fullmatch((traceparent or "").strip().lower())
    return m.group(1) if m else ""


def _weight(key: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{replica}\0{key}".encode(), digest_size=8).digest()


def rendezvous(key: str, replicas: list[str]) -> str:
    """The replica of ``key`` among ``replicas`` (non-empty): the largest blake2b(key, replica)."""
    if not replicas:
        raise ValueError("no replica to choose from")
    return max(replicas, key=lambda replica: _weight(key, replica))


def ranking(key: str, replicas: list[str]) -> list[str]:
    """``replicas`` in the order ``key`` falls back through them: its rendezvous replica first, then
    the one it would have were that one gone, and so on."""
    return sorted(replicas, key=lambda replica: _weight(key, replica), reverse=True)


class Upstreams:
    """The replicas a call may go to, refreshed every ``REFRESH_S``; :meth:`pick` one for a key."""

    def __init__(self, targets: tuple[str, ...], data_dir, *, down_s: float = DOWN_S, clock=time.monotonic,
                 resolve=rotation.resolve, read=rotation.read):
        self.targets, self.data_dir, self.down_s = tuple(targets), data_dir, down_s
        self._clock, self._resolve, self._read = clock, resolve, read
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._candidates: list[str] = []
        self._down_until: dict[str, float] = {}     # replica -> when it may be tried again

    def candidates(self) -> list[str]:
        """The targets' replicas in rotation (all of them when the rotation takes out every one:
        better a replica a sync missed than none)."""
        with self._lock:
            if self._clock() - self._at >= REFRESH_S:
                urls = self._resolve(self.targets)
                out = rotation.out_of_rotation(self._read(self.data_dir))
                chosen = [u for u in urls if u not in out]
                if urls and not chosen:
                    log.warning("every replica is out of rotation (%s): sending to all of them", ", ".join(urls))
                self._candidates, self._at = chosen or urls, self._clock()
            return self._candidates

    def pick(self, key: str) -> str | None:
        """The base URL for a call of rollout ``key``; None when no replica is known."""
        order = self.order(key)
        return order[0] if order else None

    def order(self, key: str) -> list[str]:
        """The replicas to try for a call of rollout ``key``, in turn: the live ones in rendezvous
        order (its own first); with none live, its own replica alone (the call fails there as it
        would have). [] when no replica is known."""
        ranked = ranking(key, self.candidates())
        now = self._clock()
        with self._lock:
            live = [r for r in ranked if self._down_until.get(r, -float("inf")) <= now]
        return live or ranked[:1]

    def down(self, replica: str, why: object = "") -> None:
        """``replica`` refused or reset a connection: its rollouts go elsewhere for ``down_s``."""
        with self._lock:
            was_up = self._down_until.get(replica, -float("inf")) <= self._clock()
            self._down_until[replica] = self._clock() + self.down_s
        if was_up:
            log.warning("vLLM replica %s is down (%s): its rollouts go to the other replicas for %.0f s",
                        replica, why, self.down_s)
