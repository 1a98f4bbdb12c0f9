"""The ``nccl`` weight sync (trainer/nccl.py NcclSync): its HTTP protocol, errors and retries, and
the trainer's start-up refusal where it cannot run.

NCCL needs GPUs and a GPU build of vLLM, neither of which exists on the machines this suite runs
on. So two stand-ins, each at one seam:

- ``FakeVllm``, a small HTTP server of our own, stands in for a GPU vLLM started with
  ``VLLM_SERVER_DEV_MODE=1 --weight-transfer-config '{"backend": "nccl"}'``: it answers the routes
  NcclSync calls with vLLM 0.32's state rules (one weight-update session at a time, update only
  inside a session, the weight version set by finish) and serves prompt logprobs computed from the
  weights it received;
- ``RecordingTransport`` replaces ``VllmNcclTransport``, the one place where NCCL would run: it
  records the tensors a broadcast would send and, like NCCL, completes the rendezvous and the
  broadcast only when the vLLM side is inside the matching request (a ``threading.Barrier`` of the
  fake server's handler and the stub). A sync that sent the HTTP request and the broadcast one
  after the other would deadlock here, as it would on a GPU.
"""

from __future__ import annotations

import http.server
import json
import threading
import time

import pyarrow as pa
import pytest
import torch
from lightspan import store
from lightspan.trainer import nccl as nccl_module
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.loop import Trainer
from lightspan.trainer.nccl import NcclSync, nccl_problem
from lightspan.trainer.sync import SyncError

from lightspan.core.config import ConfigError

torch.set_num_threads(1)
RENDEZVOUS_S = 30.0        # a deadline for a peer that never comes; every passing test meets it at once


class FakeVllm(http.server.BaseHTTPRequestHandler):
    """Stands in for a GPU vLLM (which cannot run here); see the module docstring."""

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def _handle(self, method):
        srv = self.server
        path = self.path.split("?")[0]
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        body = json.loads(raw) if raw else None
        with srv.lock:
            srv.calls.append(self.path)
            srv.bodies.append(body)
            fault = srv.faults.get(path, [])
            status, answer = fault.pop(0) if fault else (None, None)
        route = getattr(self, "route_" + path.strip("/").replace("/", "_"), None)
        if status is None and route is None:
            status, answer = 404, {"detail": "Not Found"}
        elif status is None:
            try:
                status, answer = 200, route(body)
            except RuntimeError as exc:            # what vLLM's workers raise, as its error handler returns it
                status, answer = 500, {"error": {"message": str(exc), "type": "InternalServerError"}}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

    # ---- vLLM 0.32's routes, as far as NcclSync uses them
    def route_get_world_size(self, body):
        return {"world_size": self.server.workers}

    def route_pause(self, body):
        self.server.paused = True
        return {"status": "paused"}

    def route_resume(self, body):
        self.server.paused = False
        return {"status": "resumed"}

    def route_reset_prefix_cache(self, body):
        return {"success": True}

    def route_init_weight_transfer_engine(self, body):
        info = body["init_info"]
        assert info["rank_offset"] == 1 and info["world_size"] == 1 + self.server.workers
        self.server.rendezvous(self.server.init_barrier, "init")     # the workers join the trainer's group
        self.server.init_info = info
        return {"message": "Weight transfer initialized"}

    def route_shutdown_weight_transfer_engine(self, body):
        if self.server.session:
            raise RuntimeError("Cannot release a trainer connection during a weight update")
        self.server.init_info = None
        return {"message": "Weight transfer shut down"}

    def route_start_weight_update(self, body):
        if self.server.session:
            raise RuntimeError("start_weight_update called while a weight update is already active. "
                               "Call finish_weight_update first.")
        self.server.session = True
        return {"message": "Weight update started"}

    def route_update_weights(self, body):
        srv = self.server
        if srv.init_info is None:
            raise RuntimeError("NCCL weight transfer not initialized. Call init_transfer_engine() first.")
        if not srv.session:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        if srv.reject_update:                    # a worker refuses before any NCCL call; the session ends
            srv.session = False
            raise RuntimeError(srv.reject_update)
        srv.rendezvous(srv.update_barrier, "broadcast")               # the workers receive the broadcast
        info, sent = body["update_info"], srv.transport.sent[-1]
        got = {"names": [n for n, _ in sent], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in sent],
               "shapes": [list(t.shape) for _, t in sent]}
        if info != got:
            srv.session = False
            raise RuntimeError(f"update_info does not describe the broadcast: {info} != {got}")
        srv.staged = dict(sent)
        return {"message": "Weights updated"}

    def route_finish_weight_update(self, body):
        srv = self.server
        if not srv.session:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        srv.session, srv.served = False, srv.staged
        srv.weight_version = (body or {}).get("weight_version")
        return {"message": "Weight update finished"}

    def route_weight_info(self, body):
        return {"weight_version": self.server.weight_version}

    def route_v1_completions(self, body):
        # prompt logprobs of the weights received, as vLLM computes them: log-softmax of the logits
        srv = self.server
        srv.model.load_state_dict(srv.served, strict=True)
        ids = torch.tensor([body["prompt"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(srv.model(ids).logits[0].float(), dim=-1)
        entries = [None] + [{str(t): {"logprob": float(logprobs[i - 1, t]), "rank": 1}}
                            for i, t in enumerate(body["prompt"]) if i > 0]
        return {"choices": [{"text": "", "prompt_logprobs": entries}]}


class FakeServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, model_dir):
        super().__init__(("127.0.0.1", 0), FakeVllm)
        from transformers import AutoModelForCausalLM

        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.lock = threading.Lock()
        self.calls, self.bodies, self.faults = [], [], {}
        self.workers = 2                        # e.g. tensor parallel 2: the group has 3 ranks
        self.paused = self.session = False
        self.init_info = self.weight_version = self.transport = self.reject_update = None
        self.init_barrier = threading.Barrier(2, timeout=RENDEZVOUS_S)
        self.update_barrier = threading.Barrier(2, timeout=RENDEZVOUS_S)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.served = self.staged = {k: v.clone() for k, v in self.model.state_dict().items()}

    def rendezvous(self, barrier, what):
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            raise RuntimeError(f"NCCL {what}: the trainer never joined") from None


class RecordingTransport:
    """Stands in for VllmNcclTransport, the one seam where NCCL runs (no GPU here): records what
    the trainer would broadcast and meets the fake server in the same rendezvous as NCCL."""

    def __init__(self, server: FakeServer):
        self.server, server.transport = server, self
        self.opened, self.sent, self.closed = [], [], 0
        self.send_returned = threading.Event()

    def wire_params(self):
        return {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}

    def open(self, *, master_address, master_port, world_size, device):
        self.opened.append({"master_address": master_address, "master_port": master_port,
                            "world_size": world_size, "device": str(device)})
        self.server.init_barrier.wait()       # NCCL's rendezvous returns once every worker has joined

    def send(self, tensors):
        self.send_returned.clear()
        # what the GPU would copy out: the values now, not later ones
        self.sent.append([(name, t.detach().clone()) for name, t in tensors])
        self.server.update_barrier.wait()     # a broadcast completes only with its receivers in it
        self.send_returned.set()

    def close(self):
        self.closed += 1


def wait_for(condition, deadline_s=RENDEZVOUS_S):
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.01)


@pytest.fixture
def fake(tiny_model):
    server = FakeServer(tiny_model)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.init_barrier.abort()          # release a stub still waiting for a peer
    server.update_barrier.abort()
    server.shutdown()
    server.server_close()


@pytest.fixture
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


JOIN = ["/shutdown_weight_transfer_engine", "/init_weight_transfer_engine"]  # an old group released first
ROUND = ["/pause?mode=wait", "/start_weight_update", "/update_weights", "/finish_weight_update",
         "/reset_prefix_cache", "/resume"]


def test_push_joins_once_then_sends_the_live_weights_each_version(fake, model, tmp_path):
    transport = RecordingTransport(fake)
    sync = NcclSync(fake.url, lambda: model, transport=transport, backoff_s=0)

    first = sync.push(tmp_path / "never-written", 1)          # nothing is read from disk
    with torch.no_grad():
        model.lm_head.weight.add_(0.5)                          # a training step, in place
    second = sync.push(tmp_path / "never-written-either", 2)

    assert fake.calls == ["/get_world_size", *JOIN, *ROUND, *ROUND]
    init = fake.bodies[2]["init_info"]
    assert init == {"master_address": "127.0.0.1", "master_port": transport.opened[0]["master_port"],
                    "rank_offset": 1, "world_size": 3, **transport.wire_params()}
    assert transport.opened == [{"master_address": "127.0.0.1", "master_port": init["master_port"],
                                 "world_size": 3, "device": "cpu"}]           # joined once, as rank 0 of 3
    assert [b for b, c in zip(fake.bodies, fake.calls) if c == "/finish_weight_update"] == [
        {"weight_version": "1"}, {"weight_version": "2"}]
    assert fake.weight_version == "2" and sync.served_version == 2 and not fake.paused and not fake.session

    # each broadcast carried every parameter under its checkpoint name, with its value at push time
    params = dict(model.named_parameters())
    assert [n for n, _ in transport.sent[1]] == list(params)
    assert all(torch.equal(t, params[n]) for n, t in transport.sent[1])
    before, after = dict(transport.sent[0]), dict(transport.sent[1])
    assert torch.allclose(after["lm_head.weight"], before["lm_head.weight"] + 0.5)
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert all(torch.equal(fake.served[n], params[n]) for n in params)      # what vLLM now serves

    assert first["sync_seconds"] >= first["sync_rpc_seconds"] > 0 and "sync_init_seconds" in first
    assert "sync_init_seconds" not in second

    sync.close()                                              # leaves the group on both ends
    assert fake.calls[-1] == "/shutdown_weight_transfer_engine" and fake.init_info is None
    assert transport.closed == 1 and sync.world_size is None


def test_idempotent_requests_are_retried_and_stateful_ones_are_not(fake, model, tmp_path):
    transport = RecordingTransport(fake)
    sync = NcclSync(fake.url, lambda: model, transport=transport, backoff_s=0)
    fake.faults["/get_world_size"] = [(503, {"error": "starting"})]
    fake.faults["/pause"] = [(503, {"error": "busy"}), (502, {"error": "gateway"})]
    sync.push(tmp_path, 1)
    assert fake.calls[:5] == ["/get_world_size", "/get_world_size", *JOIN, "/pause?mode=wait"]
    assert fake.calls.count("/pause?mode=wait") == 3 and fake.weight_version == "1"

    # a 503 on a stateful request is not repeated: a repeat after a lost answer would open a second session
    fake.calls.clear()
    fake.faults["/start_weight_update"] = [(503, {"error": "busy"})]
    with pytest.raises(SyncError) as err:
        sync.push(tmp_path, 2)
    assert err.value.status == 503 and err.value.attempts == 1
    assert fake.calls == ["/pause?mode=wait", "/start_weight_update", "/resume"]     # resumed all the same
    assert len(transport.sent) == 1 and sync.world_size == 3                   # nothing sent; group kept
    sync.push(tmp_path, 2)
    assert fake.weight_version == "2" and len(transport.opened) == 1


def test_a_failed_update_fails_fast_resumes_and_the_next_push_joins_a_new_group(fake, model, tmp_path):
    transport = RecordingTransport(fake)
    sync = NcclSync(fake.url, lambda: model, transport=transport, backoff_s=0)
    sync.push(tmp_path, 1)
    fake.calls.clear()

    # vLLM rejects the update before any worker enters the broadcast: the trainer's broadcast would
    # wait for its receivers forever, so the push raises without waiting for it
    fake.reject_update = "Invalid update_info for NCCLWeightTransferEngine"
    with pytest.raises(SyncError) as err:
        sync.push(tmp_path, 2)
    wait_for(lambda: fake.update_barrier.n_waiting == 1)        # the broadcast waits for receivers ...
    assert not transport.send_returned.is_set()                 # ... and the push did not wait for it
    assert err.value.status == 500 and err.value.endpoint.endswith("/update_weights")
    assert "Invalid update_info" in str(err.value) and "joins a new one" in str(err.value)
    assert fake.calls == ["/pause?mode=wait", "/start_weight_update", "/update_weights", "/resume"]
    assert transport.closed == 1 and sync.world_size is None and fake.weight_version == "1"

    fake.update_barrier.abort()                    # the abandoned broadcast errors out at last
    fake.update_barrier = threading.Barrier(2, timeout=RENDEZVOUS_S)
    fake.init_barrier = threading.Barrier(2, timeout=RENDEZVOUS_S)
    fake.reject_update = None
    fake.calls.clear()
    sync.push(tmp_path, 2)
    assert fake.calls == ["/get_world_size", *JOIN, *ROUND]
    assert len(transport.opened) == 2 and fake.weight_version == "2"


def test_a_broadcast_error_on_the_trainer_is_a_sync_error(fake, model, tmp_path):
    class Broken(RecordingTransport):
        def send(self, tensors):
            raise RuntimeError("NCCL error: unhandled cuda error")

    transport = Broken(fake)
    sync = NcclSync(fake.url, lambda: model, transport=transport, backoff_s=0)
    with pytest.raises(SyncError) as err:
        sync.push(tmp_path, 1)
    assert "NCCL broadcast on the trainer failed: RuntimeError: NCCL error" in str(err.value)
    assert isinstance(err.value.__cause__, RuntimeError) and err.value.endpoint.endswith("/update_weights")
    assert "/resume" in fake.calls and transport.closed == 1 and sync.world_size is None
    assert fake.weight_version is None                     # finish was never sent
    fake.update_barrier.abort()                            # the fake worker may still wait in its request


def test_errors_say_how_to_start_vllm(fake, model, tmp_path):
    transport = RecordingTransport(fake)
    fake.faults["/get_world_size"] = [(404, {"detail": "Not Found"})]
    with pytest.raises(SyncError) as err:
        NcclSync(fake.url, lambda: model, transport=transport).push(tmp_path, 1)
    assert err.value.status == 404 and "VLLM_SERVER_DEV_MODE=1" in str(err.value)
    assert "GET " in str(err.value)

    fake.faults["/init_weight_transfer_engine"] = [
        (500, {"error": {"message": "Weight transfer not configured. Please set weight_transfer_config to "
                                    "enable weight transfer."}})]
    sync = NcclSync(fake.url, lambda: model, transport=transport, retries=0)
    with pytest.raises(SyncError) as err:
        sync.push(tmp_path, 1)
    assert "--weight-transfer-config '{\"backend\": \"nccl\"}'" in str(err.value)
    assert transport.closed == 1 and sync.world_size is None and "/pause?mode=wait" not in fake.calls
    fake.init_barrier.abort()                              # the stub's rendezvous waits no longer

    class Unreachable(RecordingTransport):
        def open(self, **kwargs):
            raise RuntimeError("TCPStore: timed out waiting for clients")

    fake.init_barrier = threading.Barrier(2, timeout=RENDEZVOUS_S)
    with pytest.raises(SyncError) as err:
        NcclSync(fake.url, lambda: model, transport=Unreachable(fake)).push(tmp_path, 1)
    assert err.value.status is None and "NCCL rendezvous as rank 0 on the trainer failed" in str(err.value)
    assert "must reach the trainer at 127.0.0.1:" in str(err.value)
    fake.init_barrier.abort()                              # vLLM's side of that rendezvous gives up too


def test_the_trainer_syncs_a_step_over_nccl_and_verifies_what_vllm_serves(fake, tiny_model, tmp_path,
                                                                          monkeypatch):
    # the start-up check would refuse on this CPU machine: the transport it guards is the stub's
    monkeypatch.setattr(nccl_module, "nccl_problem", lambda: None)
    cfg = TrainerConfig(model=str(tiny_model), data_dir=str(tmp_path / "data"), vllm_url=fake.url, sync="nccl",
                        served_model_name="policy", torch_threads=1, learning_rate=1e-2, metrics_port=0)
    trainer = Trainer(cfg)
    assert isinstance(trainer.sync, NcclSync) and trainer.sync.url == fake.url
    trainer.sync.transport = RecordingTransport(fake)
    trainer.load_or_init()
    rows = [{"transition_id": f"t{i}", "rollout_id": f"r{i}", "task_id": "t", "prompt_token_ids": [60, 61, 62],
             "completion_token_ids": [65 + i, 66], "completion_logprobs": [-5.5, -5.5], "model_version": 0,
             "reward": float(i % 2), "advantage": 1.0 if i % 2 else -1.0, "created_unix_nano": 1}
            for i in range(4)]
    store.write_table(trainer.data_dir, "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))
    initial = {k: v.clone() for k, v in fake.served.items()}

    row = trainer.train_once()

    assert row["policy_version"] == 1 and fake.weight_version == "1"
    live = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    assert all(torch.equal(fake.served[n], p) for n, p in live.items())         # the step's weights
    assert any(not torch.equal(fake.served[n], initial[n]) for n in live)
    assert row["sync_max_abs_logprob_diff"] < 1e-4         # verified through /v1/completions, as for reload
    assert row["sync_seconds"] > 0
    saved = store.connect(trainer.data_dir).execute("SELECT sync_max_abs_logprob_diff FROM train_steps").fetchall()
    assert saved == [(row["sync_max_abs_logprob_diff"],)]


def test_a_real_vllm_without_the_nccl_engine_is_named_in_the_error(vllm_server, model, tmp_path):
    """The session's real vLLM (CPU, dev mode, no --weight-transfer-config): its routes answer as
    NcclSync expects, and the refusal says how to start it. Only the trainer's NCCL end is a stub."""
    import requests

    class Rendezvous:
        def __init__(self):
            self.opened, self.released = [], threading.Event()

        def wire_params(self):
            return {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}

        def open(self, **kwargs):            # waits for workers that, here, never come
            self.opened.append(kwargs)
            self.released.wait(RENDEZVOUS_S)

        def close(self):
            self.released.set()

    transport = Rendezvous()
    sync = NcclSync(vllm_server.url, lambda: model, transport=transport, retries=0)
    with pytest.raises(SyncError) as err:
        sync.push(tmp_path, 1)
    assert err.value.status == 500 and err.value.endpoint.endswith("/init_weight_transfer_engine")
    assert "Weight transfer not configured" in err.value.body
    assert "--weight-transfer-config '{\"backend\": \"nccl\"}'" in str(err.value)
    assert transport.opened[0]["world_size"] == 2           # the trainer + vLLM's one CPU worker
    assert transport.released.is_set() and sync.world_size is None
    response = requests.post(f"{vllm_server.url}/v1/completions", timeout=30, json={
        "model": vllm_server.model_name, "prompt": [60, 61], "max_tokens": 2})
    assert response.status_code == 200                       # never paused: it serves on


# ---- the start-up refusal -------------------------------------------------------------------------
def test_the_trainer_refuses_nccl_without_cuda():
    if nccl_problem() is None:
        pytest.skip("this machine can run NCCL sync")
    with pytest.raises(ConfigError) as err:
        TrainerConfig(model="m", sync="nccl")
    assert err.value.field == "trainer.sync"
    message = str(err.value)
    if not torch.cuda.is_available():
        assert "CUDA is not available" in message
    assert "--sync reload" in message and "NVIDIA GPU with vllm installed" in message


def test_the_trainer_refuses_nccl_when_vllm_cannot_be_imported(monkeypatch):
    # as on a GPU machine whose trainer environment lacks vllm (this one lacks a GPU as well)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    problem = nccl_problem()
    if problem is None:
        pytest.skip("vllm is importable in this environment")
    assert "vllm.distributed.weight_transfer.nccl_common cannot be imported" in problem
    with pytest.raises(ConfigError) as err:
        TrainerConfig(model="m", sync="nccl")
    assert err.value.field == "trainer.sync" and "pip install vllm==" in str(err.value)


def test_nccl_sends_full_weights_so_lora_is_refused(monkeypatch):
    monkeypatch.setattr(nccl_module, "nccl_problem", lambda: None)
    with pytest.raises(ConfigError, match="--sync lora") as err:
        TrainerConfig(model="m", sync="nccl", lora_r=16)
    assert err.value.field == "trainer.sync"
    assert TrainerConfig(model="m", sync="nccl").sync == "nccl"          # accepted where NCCL can run
