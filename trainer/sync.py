"""Weight sync: make the vLLM server the agents call serve the trainer's newest weights.

One interface, :class:`WeightSync`, and its backends (docs/architecture.md, "Weight sync"):

- :class:`ReloadSync` — vLLM re-reads a safetensors checkpoint in place:
  ``POST /pause?mode=wait`` (drain in-flight requests, so no completion mixes two versions)
  → ``POST /collective_rpc {"method": "reload_weights", ...}`` → ``POST /reset_prefix_cache``
  (cached KV blocks were computed by the old weights) → ``POST /resume``, always, even after a
  failure. Needs ``VLLM_SERVER_DEV_MODE=1``. The model must have untied embeddings (a tied
  ``lm_head`` stays stale) and every version must be a new directory (docs/architecture.md,
  "Weight sync").
- :class:`LoraSync` — vLLM loads the trainer's LoRA adapter (``POST /v1/load_lora_adapter``),
  with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; the base is never touched.
- ``NcclSync`` (trainer/nccl.py) — vLLM's native weight transfer (GPU only): each version is
  broadcast over NCCL from the live model tensors; it uses the request helpers here.
- :class:`NoSync` — nothing to push; readers follow ``policy.json``.

The RPC answering 200 says nothing about what vLLM serves afterwards, so :func:`verify`
compares vLLM's prompt logprobs of a fixed sequence with the trainer's own.
Only vLLM's public HTTP API is used, and nothing imports vllm but ``VllmNcclTransport``
(trainer/nccl.py, the ``nccl`` backend's data plane), lazily.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import requests

log = logging.getLogger(__name__)


class SyncError(RuntimeError):
    """A weight-sync request failed: names the endpoint, the HTTP status and the response body."""

    def __init__(self, endpoint: str, status: int | None, body: str, attempts: int = 1, method: str = "POST"):
        self.endpoint, self.status, self.body, self.attempts = endpoint, status, body, attempts
        got = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"weight sync: {method} {endpoint} failed after {attempts} attempt(s): {got}: "
                         f"{body[:500]}")

    def __str__(self) -> str:      # the hints added with add_note() reach the log line too
        return "\n".join([super().__str__(), *getattr(self, "__notes__", [])])


def _retryable(status: int | None) -> bool:
    # No response (refused, reset, timed out), overload or a gateway: try again. A 500 means the
    # server ran the request and it raised (for collective_rpc: the worker's exception, e.g. a
    # path it cannot read), which the same request would raise again; 4xx likewise.
    return status is None or status in (429, 502, 503, 504)


def post(url: str, path: str, *, json: Any = None, params: dict | None = None, timeout_s: float = 300.0,
         retries: int = 3, backoff_s: float = 0.5, method: str = "POST") -> requests.Response:
    """POST (or ``method``) ``url + path``; retry connection errors, 429 and 502-504 ``retries``
    times with exponential backoff (``backoff_s``, 2x, 4x, ...); raise :class:`SyncError` on the
    last failure or at once on any other status >= 400."""
    endpoint = url.rstrip("/") + path
    for attempt in range(1, retries + 2):
        try:
            response = requests.request(method, endpoint, json=json, params=params, timeout=timeout_s)
            status, body = response.status_code, response.text
            if status < 400:
                return response
        except requests.RequestException as exc:
            status, body = None, f"{type(exc).__name__}: {exc}"
        if not _retryable(status) or attempt > retries:
            raise SyncError(endpoint + (f"?{_query(params)}" if params else ""), status, body, attempt, method)
        delay = backoff_s * 2 ** (attempt - 1)
        log.warning("%s %s: %s; retry %d/%d in %.1f s", method, endpoint, status or body, attempt, retries, delay)
        time.sleep(delay)
    raise AssertionError("unreachable")


def _query(params: dict) -> str:
    return "&".join(f"{k}={v}" for k, v in params.items())


class WeightSync(Protocol):
    """How a trained version reaches the server agents call. The trainer asks a backend what it
    does (``verifies``), never which one it is."""

    verifies: bool
    """Whether the server serves what was pushed, so that after each push the trainer compares the
    served logprobs of one fixed sequence with its own (:meth:`verify`)."""

    def push(self, checkpoint_dir: str | os.PathLike, version: int) -> dict[str, float]:
        """Make the server serve ``checkpoint_dir`` as ``version``; returns metrics in seconds
        (``sync_seconds``: the push's wall time, absent when nothing was pushed)."""
        ...

    def verify(self, model_name: str, token_ids: list[int], expected: list[float]) -> float:
        """max |served logprob - expected| of ``token_ids`` (:func:`verify`); only when ``verifies``."""
        ...


class NoSync:
    """No server to update (``sync = "none"``): nothing pushed, timed or verified."""

    verifies = False

    def push(self, checkpoint_dir: str | os.PathLike, version: int) -> dict[str, float]:
        return {}

    def verify(self, model_name: str, token_ids: list[int], expected: list[float]) -> float:
        raise RuntimeError("sync 'none' pushes nothing to a server: there is nothing to verify")


class OneServer:
    """A backend that pushes to the one vLLM server at ``self.url`` and verifies it there."""

    url: str
    verifies = True

    def verify(self, model_name: str, token_ids: list[int], expected: list[float]) -> float:
        return verify(self.url, model_name, token_ids, expected)


class LoraSync(OneServer):
    """Load each version's adapter into vLLM; agents keep calling one stable name.

    vLLM serves an adapter only under the name it was loaded with, and a name cannot be loaded
    twice unless ``load_inplace`` is set. Each push of version N, from its own new directory:

    1. load it as ``<model_name>-v<N>`` (a new, versioned name: it checks that the adapter loads
       before anything agents call changes, and lets an evaluation pin a version);
    2. load it again as ``<model_name>`` with ``load_inplace: true``: the stable name agents call
       now points at version N. Requests already running finish on the weights they started with
       or, if they outlive the swap, continue on the new ones (no drain: vLLM has no pause per
       adapter);
    3. unload ``<model_name>-v<N-1>``, unless ``keep()`` names it (a canary's serving version or
       candidate: trainer/deployed.py).

    Why in place under one name is exact here: vLLM 0.32 keys prefix-cache blocks by the
    adapter's (name, path) (``v1/core/kv_cache_utils._gen_lora_extra_hash_keys``), so blocks the
    previous version computed are never reused once the stable name points at a new path.
    Reusing a path with new weights does serve them (measured: 0.29 nats off), hence a new
    directory per version is required and a path pushed twice in a row is refused. The base
    model must be served under another name than ``model_name``
    (``lightspan vllm --lora-rank R`` serves it as ``<model_name>-base``).
    """

    def __init__(self, url: str, model_name: str, *, timeout_s: float = 120.0, retries: int = 3,
                 backoff_s: float = 0.5, keep: Callable[[], Iterable[int]] = tuple):
        self.url, self.model_name = url.rstrip("/"), model_name
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.keep = keep                        # versions whose names stay loaded (canaries' arms)
        self.loaded: str | None = None          # the versioned name this process loaded last
        self.serving: Path | None = None

    def versioned_name(self, version: int) -> str:
        return f"{self.model_name}-v{version}"

    def _post(self, path: str, body: dict) -> requests.Response:
        try:
            return post(self.url, path, json=body, timeout_s=self.timeout_s, retries=self.retries,
                        backoff_s=self.backoff_s)
        except SyncError as exc:
            if exc.status == 404 and "lora" not in exc.body.lower():
                exc.add_note("the route is missing: start vLLM with --enable-lora and "
                             "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (lightspan vllm --lora-rank R does)")
            elif "conflicts with a served base model" in exc.body:
                exc.add_note(f"vLLM serves the base model as {self.model_name!r}: serve it under another "
                             "name (lightspan vllm --lora-rank R serves it as '<name>-base')")
            elif "rank" in exc.body.lower():
                exc.add_note("start vLLM with --max-lora-rank >= the trainer's lora_r")
            raise

    def push(self, checkpoint_dir: str | os.PathLike, version: int) -> dict[str, float]:
        path = Path(checkpoint_dir).resolve()        # vLLM resolves paths in its own working directory
        if path == self.serving:
            raise ValueError(f"vLLM serves {path} already: save each version to a new directory "
                             "(vLLM's prefix cache is keyed by the adapter's path)")
        if not (path / "adapter_config.json").is_file() or not any(path.glob("adapter_model.*")):
            raise FileNotFoundError(f"{path} is not a LoRA adapter (adapter_config.json + adapter_model.*); "
                                    "vLLM was not asked to load it")
        t0 = time.monotonic()
        versioned = self.versioned_name(version)
        # load_inplace on the versioned name too: a trainer restarted after a failed sync
        # publishes the same version again, whose name vLLM may still hold
        self._post("/v1/load_lora_adapter", {"lora_name": versioned, "lora_path": str(path), "load_inplace": True})
        self._post("/v1/load_lora_adapter", {"lora_name": self.model_name, "lora_path": str(path),
                                             "load_inplace": True})
        load_seconds = time.monotonic() - t0
        if self.loaded is not None and self.loaded != versioned and not any(
                self.loaded == self.versioned_name(v) for v in self.keep()):
            try:
                self._post("/v1/unload_lora_adapter", {"lora_name": self.loaded})
            except SyncError as exc:     # the new version serves: an old name left over is no failure
                log.warning("could not unload %s: %s", self.loaded, exc)
        self.loaded, self.serving = versioned, path
        seconds = time.monotonic() - t0
        log.info("vLLM at %s serves %s (and %s) from %s, %.3f s", self.url, self.model_name, versioned, path, seconds)
        return {"sync_seconds": seconds, "sync_rpc_seconds": load_seconds}


@contextlib.contextmanager
def paused(post: Callable[..., requests.Response]):
    """vLLM paused for the block (``POST /pause?mode=wait``: in-flight requests drain first, so no
    completion mixes two versions) and resumed after it, whatever happens; when the block failed,
    its error is raised and a failed resume is only logged."""
    try:
        post("/pause", params={"mode": "wait"})
        yield
    except BaseException:
        try:
            post("/resume")
        except SyncError as again:
            log.error("resume after a failed sync also failed: %s", again)
        raise
    post("/resume")


class ReloadSync(OneServer):
    """In-place reload of a safetensors checkpoint by a vLLM server in dev mode.

    vLLM moves the model's weights to the meta device before it reads the new ones, so a reload
    that fails half-way (unreadable path, corrupt file) leaves an engine that dies on its next
    request (measured, vLLM 0.32 CPU); a reload that succeeds afterwards repairs it. Hence the
    checkpoint is checked before vLLM sees it, and a failed reload is followed by a reload of
    ``serving``, the last directory known to load. ``serving`` is that directory before the first
    push, or a function that gives it when the first push asks (the trainer knows it once it
    loaded its model: what vLLM was started with, or the version published last).
    """

    def __init__(self, url: str, *, serving: str | os.PathLike | Callable[[], str | os.PathLike | None] | None = None,
                 timeout_s: float = 300.0, retries: int = 3, backoff_s: float = 0.5):
        self.url, self.timeout_s, self.retries, self.backoff_s = url.rstrip("/"), timeout_s, retries, backoff_s
        self._serving_at_start = serving if callable(serving) else None
        self.serving: Path | None = Path(serving).resolve() if serving and not callable(serving) else None

    def _post(self, path: str, **kwargs) -> requests.Response:
        return post(self.url, path, timeout_s=self.timeout_s, retries=self.retries, backoff_s=self.backoff_s,
                    **kwargs)

    def _reload(self, path: Path) -> None:
        self._post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})

    def push(self, checkpoint_dir: str | os.PathLike, version: int) -> dict[str, float]:
        path = Path(checkpoint_dir).resolve()        # vLLM resolves paths in its own working directory
        if self._serving_at_start is not None:
            start, self._serving_at_start = self._serving_at_start(), None
            self.serving = Path(start).resolve() if start else None
        if path == self.serving:
            raise ValueError(f"vLLM serves {path} already: save each version to a new directory "
                             "(vLLM re-reading one path has served stale weights)")
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise FileNotFoundError(f"{path} is not a safetensors checkpoint (config.json + *.safetensors); "
                                    "vLLM was not asked to load it")
        t0 = time.monotonic()
        with paused(self._post):
            t_rpc = time.monotonic()
            try:
                self._reload(path)
            except SyncError as exc:
                self._recover(exc)
                raise
            rpc_seconds = time.monotonic() - t_rpc
            self._reset_prefix_cache()
        self.serving = path
        seconds = time.monotonic() - t0
        log.info("vLLM at %s reloaded version %d from %s in %.2f s", self.url, version, path, seconds)
        return {"sync_seconds": seconds, "sync_rpc_seconds": rpc_seconds}

    def _recover(self, exc: SyncError) -> None:
        if self.serving is None:
            exc.add_note("no earlier checkpoint is known: vLLM may fail every request until a reload "
                         "succeeds or it restarts")
        else:
            try:
                self._reload(self.serving)
                exc.add_note(f"vLLM reloaded {self.serving} again and serves it")
            except SyncError as again:
                exc.add_note(f"reloading {self.serving} failed too ({again}): vLLM may fail every request "
                             "until a reload succeeds or it restarts")
        log.error("%s; %s", exc, "; ".join(exc.__notes__))

    def _reset_prefix_cache(self) -> None:
        reset_prefix_cache(self.url, timeout_s=self.timeout_s, retries=self.retries, backoff_s=self.backoff_s)


def reset_prefix_cache(url: str, *, timeout_s: float = 300.0, retries: int = 3, backoff_s: float = 0.5) -> None:
    """``POST /reset_prefix_cache`` until vLLM says it succeeded: cached KV blocks were computed
    by the old weights."""
    # vLLM answers {"success": false} while KV blocks are still held; after a drain they are not
    for attempt in range(1, retries + 2):
        response = post(url, "/reset_prefix_cache", timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
        try:
            if response.json().get("success", True):
                return
        except (ValueError, AttributeError):      # not a JSON object: nothing says it failed
            return
        time.sleep(backoff_s * 2 ** (attempt - 1))
    raise SyncError(url.rstrip("/") + "/reset_prefix_cache", response.status_code, response.text, retries + 1)


def prompt_logprobs(url: str, model_name: str, token_ids: list[int], *, timeout_s: float = 60.0,
                    retries: int = 3, backoff_s: float = 0.5) -> list[float]:
    """vLLM's log pi(token_i | tokens_<i) for i = 1 .. n-1 of ``token_ids`` (n-1 floats).

    ``/v1/completions`` with ``prompt_logprobs: 0`` answers, in ``choices[0].prompt_logprobs``,
    ``null`` for the first token, then per position a dict keyed by the token id as a string:
    ``{"<id>": {"logprob": float, "rank": int, "decoded_token": str}}`` (measured, vLLM 0.32).
    These are raw log-softmax values: they do not depend on the request's temperature.
    """
    endpoint = url.rstrip("/") + "/v1/completions"
    response = post(url, "/v1/completions", json={
        "model": model_name, "prompt": list(map(int, token_ids)), "max_tokens": 1,
        "prompt_logprobs": 0, "temperature": 0}, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
    try:
        entries = response.json()["choices"][0]["prompt_logprobs"]
        return [float(entries[i][str(int(t))]["logprob"]) for i, t in enumerate(token_ids) if i > 0]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise SyncError(endpoint, response.status_code,
                        f"unexpected prompt_logprobs shape ({exc!r}): {response.text}") from None


def verify(url: str, model_name: str, token_ids: list[int], expected_logprobs: list[float], **kwargs) -> float:
    """max |vLLM's prompt logprob - expected| over positions 1 .. n-1 of ``token_ids``.

    ``expected_logprobs`` holds the trainer's log pi(token_i | tokens_<i) for i = 1 .. n-1.
    """
    served = prompt_logprobs(url, model_name, token_ids, **kwargs)
    if len(served) != len(expected_logprobs):
        raise ValueError(f"expected {len(served)} logprobs (one per token after the first), "
                         f"got {len(expected_logprobs)}")
    return max((abs(a - b) for a, b in zip(served, expected_logprobs)), default=0.0)
