"""The ``nccl`` weight sync: vLLM's native weight transfer, GPU to GPU (:class:`NcclSync`).

The trainer joins one NCCL group with vLLM's workers once, then each version is broadcast from
the live model tensors (nothing is read from disk) between ``/start_weight_update`` and
``/finish_weight_update``. Needs ``VLLM_SERVER_DEV_MODE=1``, ``--weight-transfer-config
'{"backend": "nccl"}'``, and vllm importable in the trainer's environment: the data plane
(:class:`NcclTransport`, implemented by :class:`VllmNcclTransport`) is vLLM's own communicator,
imported lazily, and :func:`nccl_problem` says at start-up why this process cannot be the
trainer end. The control plane is vLLM's HTTP API, with the common request helpers of
:mod:`lightspan.trainer.sync` (``post``, ``paused``, ``reset_prefix_cache``).
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future
from concurrent.futures import wait as wait_futures
from typing import Any, Protocol
from urllib.parse import urlsplit

import requests

from lightspan.trainer.sync import OneServer, SyncError, paused, post, reset_prefix_cache

log = logging.getLogger(__name__)

# what the trainer end of vLLM's NCCL group imports (VllmNcclTransport); checked at start-up
VLLM_TRAINER_MODULES = ("vllm.distributed.weight_transfer.nccl_common",
                        "vllm.distributed.weight_transfer.packed_tensor")


def nccl_problem() -> str | None:
    """Why this process cannot be the trainer end of an NCCL weight transfer, or None if it can.

    NCCL moves weights from GPU to GPU, so CUDA must be available. vLLM's workers join the
    transfer group through vLLM's ``StatelessProcessGroup`` rendezvous and ``PyNcclCommunicator``
    and unpack vLLM's packed broadcast; the trainer meets them with the same code
    (:class:`VllmNcclTransport`), so vllm must be importable here too, at the server's version.
    """
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available here (torch.cuda.is_available() is False); NCCL moves weights GPU to GPU"
    for module in VLLM_TRAINER_MODULES:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 -- ImportError, or a vllm that fails to import with this torch
            return (f"vLLM's trainer-side NCCL helper {module} cannot be imported ({type(exc).__name__}: {exc}); "
                    "the trainer joins vLLM's NCCL group through vllm's own communicator")
    return None


class NcclTransport(Protocol):
    """The data plane of :class:`NcclSync`, the one place where NCCL runs."""

    def wire_params(self) -> dict[str, Any]:
        """How the broadcast is cut (packed, buffer size, buffers): vLLM's workers must decode alike."""
        ...

    def open(self, *, master_address: str, master_port: int, world_size: int, device: Any) -> None:
        """Host the group's rendezvous at ``master_address:master_port`` and join it as rank 0 of
        ``world_size``; returns when every vLLM worker has joined."""
        ...

    def send(self, tensors: Iterable[tuple[str, Any]]) -> None:
        """Broadcast ``(name, tensor)`` pairs from rank 0; returns when they have left the GPU."""
        ...

    def close(self) -> None:
        ...


class VllmNcclTransport:
    """The trainer end (rank 0) of vLLM's NCCL weight-transfer group, through vLLM's own helpers:
    ``nccl_common.trainer_init`` (a TCPStore rendezvous the trainer hosts, then vLLM's
    ``PyNcclCommunicator``) and ``packed_tensor.packed_nccl_broadcast_producer`` (tensors packed
    into ``buffer_bytes`` chunks, ``num_buffers`` in flight; vLLM's defaults). GPU only: the CPU
    test suite replaces this class with a recording stub.
    """

    def __init__(self, *, packed: bool = True, buffer_bytes: int = 2**30, num_buffers: int = 2):
        self.packed, self.buffer_bytes, self.num_buffers = packed, buffer_bytes, num_buffers
        self.group = self.device = None

    def wire_params(self) -> dict[str, Any]:
        return {"packed": self.packed, "packed_buffer_size_bytes": self.buffer_bytes,
                "packed_num_buffers": self.num_buffers}

    def open(self, *, master_address: str, master_port: int, world_size: int, device: Any) -> None:
        import torch
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"NCCL sends from GPU memory, but the model is on {device}")
        self.device = device
        with torch.cuda.device(device):       # the communicator binds to the current device
            self.group = trainer_init({"master_address": master_address, "master_port": master_port,
                                       "world_size": world_size}, rank=0)

    def send(self, tensors: Iterable[tuple[str, Any]]) -> None:
        import torch

        if self.group is None:
            raise RuntimeError("VllmNcclTransport.send before open")
        with torch.cuda.device(self.device):  # send runs on a helper thread, whose current device is 0
            # the packed producer copies on side streams: let the optimizer's writes land first
            torch.cuda.synchronize(self.device)
            if self.packed:
                from vllm.distributed.weight_transfer import packed_tensor

                packed_tensor.packed_nccl_broadcast_producer(iterator=iter(tensors), group=self.group, src=0,
                                                             post_iter_func=lambda item: item[1],
                                                             buffer_size_bytes=self.buffer_bytes,
                                                             num_buffers=self.num_buffers)
            else:
                stream = torch.cuda.current_stream()
                for _, tensor in tensors:   # NCCL reads numel elements from data_ptr: contiguous only
                    self.group.broadcast(tensor.contiguous(), src=0, stream=stream)
            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.destroy()


def _in_thread(fn: Callable[[], Any], name: str) -> Future:
    """Run ``fn`` on a daemon thread. A daemon, unlike an executor's thread: a collective whose
    peer died never returns, and must not keep the trainer from exiting."""
    future: Future = Future()

    def run():
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 -- handed to the waiting thread
                future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host``: where vLLM's workers can reach the trainer's
    rendezvous. A UDP connect picks the route and sends nothing."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class NcclSync(OneServer):
    """vLLM's native weight transfer: the trainer's live tensors, broadcast over NCCL (GPU only).

    vLLM must run with ``VLLM_SERVER_DEV_MODE=1`` (the weight-transfer routes are dev routes) and
    ``--weight-transfer-config '{"backend": "nccl"}'``, on other GPUs than the trainer's (NCCL
    refuses two ranks on one device). Once per process, the trainer joins an NCCL group as rank 0
    with vLLM's ``GET /get_world_size`` workers as ranks 1.. (``POST /init_weight_transfer_engine``
    while :meth:`NcclTransport.open` hosts the rendezvous, concurrently: each waits for the other).
    Then each push of version N:

    1. ``POST /pause?mode=wait``: drain in-flight requests, so no completion mixes two versions;
    2. ``POST /start_weight_update``: vLLM prepares a layerwise reload;
    3. ``POST /update_weights`` with every parameter's name, dtype and shape, concurrently with the
       broadcast of the same parameters, in the same order, from ``model()`` (the tensors the
       optimizer just updated: ``checkpoint_dir`` is not read) — vLLM's workers receive inside that
       request, so it returns only once the broadcast has landed;
    4. ``POST /finish_weight_update {"weight_version": "N"}``: vLLM finalises the reload and records
       N as its weight version (``GET /weight_info``);
    5. ``POST /reset_prefix_cache`` (cached KV blocks were computed by the old weights), then
       ``POST /resume`` — always, even after a failure.

    Pause, reset and resume are idempotent and retried like the other backends' requests; the
    stateful and collective requests (init, start, update, finish) are sent once, since a repeat
    after a lost response would open a second session or wait for a broadcast that is not coming.
    A failed transfer leaves the group unusable (the peer may still sit in a collective): the next
    push joins a new one. vLLM loads the weights half-way through a failed transfer, so it may serve
    garbage until a transfer succeeds, as after a failed ``reload``.

    Joining first releases whatever group vLLM still holds (``POST
    /shutdown_weight_transfer_engine``): that of an earlier trainer process. :meth:`close` leaves
    the group on both ends.

    Rank 0 only: under FSDP every rank would have to gather each parameter with rank 0
    (``DTensor.full_tensor``), which this backend does not do; such parameters are refused.
    """

    def __init__(self, url: str, model: Callable[[], Any], *, transport: NcclTransport | None = None,
                 master_address: str | None = None, master_port: int = 0, timeout_s: float = 300.0,
                 retries: int = 3, backoff_s: float = 0.5):
        self.url, self.model = url.rstrip("/"), model
        self.transport = transport if transport is not None else VllmNcclTransport()
        self.master_address, self.master_port = master_address, master_port
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.world_size: int | None = None      # set once the group is joined; None: join on the next push
        self.served_version: int | None = None

    def _post(self, path: str, *, once: bool = False, **kwargs) -> requests.Response:
        try:
            return post(self.url, path, timeout_s=self.timeout_s, retries=0 if once else self.retries,
                        backoff_s=self.backoff_s, **kwargs)
        except SyncError as exc:
            body = exc.body.lower()
            if exc.status == 404:
                exc.add_note("the route is missing: start vLLM with VLLM_SERVER_DEV_MODE=1 (the weight-transfer "
                             "routes, /pause and /resume are dev-mode routes) and vLLM >= 0.32")
            elif "weight transfer not configured" in body or "weight_transfer_config" in body:
                exc.add_note("start vLLM with --weight-transfer-config '{\"backend\": \"nccl\"}'")
            elif path == "/init_weight_transfer_engine" and exc.status is not None:
                exc.add_note("see vLLM's log: 'Weight transfer not configured' means start it with "
                             "--weight-transfer-config '{\"backend\": \"nccl\"}'")
            elif "already active" in body:
                exc.add_note("vLLM still holds the session of an earlier, interrupted transfer: restart vLLM")
            raise

    def _join(self) -> float:
        """Join vLLM's workers in a new NCCL group; returns the seconds it took."""
        t0 = time.monotonic()
        response = self._post("/get_world_size", method="GET")
        try:
            workers = int(response.json()["world_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(self.url + "/get_world_size", response.status_code,
                            f"unexpected answer ({exc!r}): {response.text}", method="GET") from None
        try:
            # vLLM keeps the group of a trainer that exited (a --once run, a crash) until told: release
            # it, or every run would leave a communicator and its GPU buffers behind on vLLM's workers
            self._post("/shutdown_weight_transfer_engine", once=True)
        except SyncError as exc:       # the init below reports what matters
            log.info("releasing vLLM's previous weight-transfer group: %s", exc)
        host = urlsplit(self.url).hostname or "127.0.0.1"
        address = self.master_address or _local_address_towards(host)
        port = self.master_port or _free_port(address)
        world_size = 1 + workers
        init_info = {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": world_size,
                     **self.transport.wire_params()}
        device = _first_device(self.model())
        try:
            self._together(lambda: self._post("/init_weight_transfer_engine", once=True, json={"init_info": init_info}),
                           lambda: self.transport.open(master_address=address, master_port=port,
                                                       world_size=world_size, device=device),
                           "/init_weight_transfer_engine", "NCCL rendezvous as rank 0")
        except BaseException as exc:
            if isinstance(exc, SyncError) and exc.status is None:     # no answer, or the rendezvous failed
                exc.add_note(f"vLLM's workers must reach the trainer at {address}:{port} (TCP, then NCCL)")
            self._abandon_group(exc)
            raise
        self.world_size = world_size
        log.info("joined vLLM's %d worker(s) at %s in an NCCL group (rendezvous %s:%d)", workers, self.url,
                 address, port)
        return time.monotonic() - t0

    def _together(self, request: Callable[[], Any], collective: Callable[[], Any], path: str, what: str) -> None:
        """Run an HTTP request and the trainer's side of the collective it waits for, at once.

        Returns when both have; raises the first failure at once, without waiting for the other
        side, which may wait forever for a peer that is not coming.
        """
        futures = [_in_thread(request, f"nccl-sync {path}"), _in_thread(collective, f"nccl-sync {what}")]
        done, pending = wait_futures(futures, timeout=self.timeout_s, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future in done and future.exception() is not None:
                exc = future.exception()
                if isinstance(exc, SyncError):
                    raise exc
                raise SyncError(self.url + path, None, f"{what} on the trainer failed: "
                                f"{type(exc).__name__}: {exc}") from exc
        if pending:
            waiting = "the vLLM request" if futures[0] in pending else f"the trainer's {what}"
            raise SyncError(self.url + path, None, f"{waiting} did not finish within {self.timeout_s:.0f} s")

    def _abandon_group(self, exc: BaseException) -> None:
        self.world_size = None
        try:
            self.transport.close()
        except Exception as again:  # noqa: BLE001 -- the first error is the one to report
            log.warning("closing the NCCL group after a failed transfer: %s", again)
        if isinstance(exc, SyncError):
            exc.add_note("the NCCL group is abandoned: the next push joins a new one (and sends every weight)")

    def close(self) -> None:
        """Leave the NCCL group, on both ends; the next push joins a new one."""
        if self.world_size is None:
            return
        self.world_size = None
        try:
            self._post("/shutdown_weight_transfer_engine", once=True)
        except SyncError as exc:
            log.warning("vLLM did not release the weight-transfer group: %s", exc)
        self.transport.close()

    def push(self, checkpoint_dir: str | os.PathLike, version: int) -> dict[str, float]:
        """Broadcast ``model()``'s parameters as ``version``; ``checkpoint_dir`` is not read."""
        named = [(name, _sendable(name, p)) for name, p in self.model().named_parameters()]
        update_info = {"names": [n for n, _ in named], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in named],
                       "shapes": [list(t.shape) for _, t in named]}
        t0 = time.monotonic()
        metrics: dict[str, float] = {}
        if self.world_size is None:
            metrics["sync_init_seconds"] = self._join()
        t_pause = time.monotonic()
        with paused(self._post):
            t_rpc = time.monotonic()
            self._post("/start_weight_update", once=True)
            try:
                self._together(lambda: self._post("/update_weights", once=True, json={"update_info": update_info}),
                               lambda: self.transport.send(named), "/update_weights", "NCCL broadcast")
            except BaseException as exc:
                self._abandon_group(exc)
                raise
            self._post("/finish_weight_update", once=True, json={"weight_version": str(version)})
            metrics["sync_rpc_seconds"] = time.monotonic() - t_rpc
            reset_prefix_cache(self.url, timeout_s=self.timeout_s, retries=self.retries, backoff_s=self.backoff_s)
        self.served_version = version
        metrics["sync_seconds"] = time.monotonic() - t0
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        log.info("vLLM at %s serves version %d: %d tensors, %.1f MB over NCCL, %.3f s (paused %.3f s)", self.url,
                 version, len(named), nbytes / 1e6, metrics["sync_seconds"], time.monotonic() - t_pause)
        return metrics


def _first_device(model) -> Any:
    for p in model.parameters():
        return p.device
    raise ValueError("the model has no parameters to send")


def _sendable(name: str, param) -> Any:
    if hasattr(param, "full_tensor"):       # an FSDP DTensor: gathering it is a collective of every rank
        raise ValueError(f"parameter {name} is sharded (FSDP DTensor): the nccl sync sends from rank 0 alone "
                         "and cannot gather it; train without FSDP, or use sync 'reload'")
    return param.detach()
