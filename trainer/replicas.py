"""Weight sync over several vLLM replicas: any :class:`~lightspan.trainer.sync.WeightSync`
backend fanned out, every replica verified, the replicas in rotation recorded for the gateway.

The replicas are a list of base URLs, or the addresses behind a DNS name (a Kubernetes headless
Service answers with one address per ready pod): ``dns+http://vllm-headless.lightspan:8000``
stands for ``http://<each address>:8000``, resolved again at every sync. One push of version N:

1. pause every replica (``POST /pause?mode=wait``, all at once): each drains its in-flight
   requests, and none serves version N-1 once any serves N;
2. push N to each replica with its own backend object (``make_backend(url)``); a ``reload``
   backend resumes its replica as soon as that replica holds N (its own pause is a no-op on a
   paused engine); then resume them all together (``POST /resume``; ``lora`` has no pause of its
   own, so its replicas start serving N at the same moment);
3. :meth:`ReplicaSync.verify` compares each replica's prompt logprobs of the fixed sequence
   with the trainer's (lightspan.trainer.sync.verify);
4. the replicas whose push and check passed are in rotation (without a check, as with
   ``verify_sync`` off, those whose push passed); the others are out until a later push reaches
   them (every push goes to every replica, in rotation or not). The rotation is
   written to ``replicas.json`` beside policy.json (lightspan.store.replicas), where the gateway
   reads it (lightspan.rollout.replicas). When no replica passes, the sync fails (``SyncError``) as one
   replica's failure did before.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from lightspan.store import replicas as rotation
from lightspan.trainer.sync import SyncError, WeightSync, post, verify

log = logging.getLogger(__name__)

MAX_LOGPROB_DIFF = 1e-3
"""A replica whose served logprobs differ from the trainer's by more than this after a sync is out
of rotation: an exact sync is within 5e-5 (docs/architecture.md, Weight sync), a replica that kept
the previous version is off by the step's whole update."""


class ReplicaSync:
    """A :class:`WeightSync` over every replica; see the module docstring."""

    verifies = True     # each replica that took a version is checked before it goes back in rotation

    def __init__(self, targets: tuple[str, ...], make_backend: Callable[[str], WeightSync], data_dir,
                 *, pauses: bool = True, timeout_s: float = 300.0, resolve_fn: Callable = rotation.resolve):
        self.targets, self.make_backend, self.data_dir = tuple(targets), make_backend, data_dir
        self.pauses, self.timeout_s, self.resolve_fn = pauses, timeout_s, resolve_fn
        self.backends: dict[str, WeightSync] = {}     # one per replica URL, kept across pushes
        self.status: dict[str, dict] = {}             # the last push's outcome per replica
        self.version: int | None = None

    def backend(self, url: str) -> WeightSync:
        if url not in self.backends:
            self.backends[url] = self.make_backend(url)
        return self.backends[url]

    def _each(self, fn: Callable[[str], object], urls: list[str]) -> dict[str, BaseException | None]:
        """``fn(url)`` for every url at once; the exception each raised, or None."""
        def run(url):
            try:
                fn(url)
                return None
            except Exception as exc:   # noqa: BLE001 - a replica's failure takes it out, not the run
                return exc
        with ThreadPoolExecutor(max(1, len(urls)), thread_name_prefix="lightspan-replica") as pool:
            return dict(zip(urls, pool.map(run, urls)))

    def push(self, checkpoint_dir: str | os.PathLike, version: int) -> dict[str, float]:
        urls = self.resolve_fn(self.targets)
        if not urls:
            raise SyncError(", ".join(self.targets), None, "no vLLM replica to push to (the list is empty or "
                            "the name resolves to no address)")
        t0 = time.monotonic()
        self.version, self.status = version, {u: {"version": None, "in_rotation": False, "error": ""} for u in urls}
        paused = {u: None for u in urls}
        if self.pauses:
            paused = self._each(lambda u: post(u, "/pause", params={"mode": "wait"}, timeout_s=self.timeout_s), urls)
        pushable = [u for u in urls if paused[u] is None]
        timings: dict[str, dict] = {}

        def push_one(url):
            timings[url] = self.backend(url).push(checkpoint_dir, version)
        pushed = self._each(push_one, pushable)
        if self.pauses:
            self._each(lambda u: post(u, "/resume", timeout_s=self.timeout_s), urls)   # every one, always
        for url in urls:
            error = paused[url] or pushed.get(url)
            if error is None:
                self.status[url].update(version=version)
            else:
                self.status[url]["error"] = f"{type(error).__name__}: {error}"[:500]
                log.error("replica %s did not take version %d: %s", url, version, error)
        for s in self.status.values():
            s["in_rotation"] = s["version"] == version     # until verify() checks them (if it runs)
        self.write_rotation()
        if not any(s["version"] == version for s in self.status.values()):
            raise SyncError(", ".join(urls), None, "no replica took version "
                            f"{version}: " + "; ".join(f"{u}: {s['error']}" for u, s in self.status.items()))
        rpc = [t.get("sync_rpc_seconds", 0.0) for t in timings.values()]
        return {"sync_seconds": time.monotonic() - t0, "sync_rpc_seconds": max(rpc, default=0.0)}

    def verify(self, model_name: str, token_ids: list[int], expected: list[float]) -> float:
        """Check every replica that took this version; out of rotation those off by more than
        ``MAX_LOGPROB_DIFF`` or whose check failed; write the rotation. Returns the largest
        difference among those in rotation (the sync fails when none is)."""
        def check(url):
            self.status[url]["max_abs_logprob_diff"] = verify(url, model_name, token_ids, expected)
        took = [u for u, s in self.status.items() if s["version"] == self.version]
        for url in took:
            self.status[url]["in_rotation"] = False
        for url, error in self._each(check, took).items():
            diff = self.status[url].get("max_abs_logprob_diff")
            if error is not None:
                self.status[url]["error"] = f"verify: {type(error).__name__}: {error}"[:500]
            elif diff > MAX_LOGPROB_DIFF:
                self.status[url]["error"] = f"verify: max |logprob difference| {diff:.2e} > {MAX_LOGPROB_DIFF:g}"
            else:
                self.status[url]["in_rotation"] = True
        self.write_rotation()
        serving = [s["max_abs_logprob_diff"] for s in self.status.values() if s["in_rotation"]]
        if not serving:
            raise SyncError(", ".join(self.status), None, f"no replica serves version {self.version} as the "
                            "trainer computes it: " + "; ".join(f"{u}: {s['error']}" for u, s in self.status.items()))
        for url, s in self.status.items():
            if not s["in_rotation"]:
                log.error("replica %s is out of rotation until a later sync reaches it: %s", url, s["error"])
        return max(serving)

    def write_rotation(self) -> None:
        rotation.write(self.data_dir, self.version, self.status)
