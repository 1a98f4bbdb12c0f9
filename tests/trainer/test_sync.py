"""Weight sync (trainer/sync.py): the request protocol against a stub, then the real vLLM server."""

import http.server
import json
import logging
import shutil
import socket
import threading

import pyarrow as pa
import pytest
import requests
import torch

from lightspan import store
from lightspan.models import build_tiny_model
from lightspan.trainer.config import TrainerConfig
from lightspan.trainer.loop import Trainer
from lightspan.trainer.nccl import NcclSync
from lightspan.trainer.replicas import ReplicaSync
from lightspan.trainer.sync import LoraSync, NoSync, ReloadSync, SyncError, prompt_logprobs, verify

torch.set_num_threads(1)
log = logging.getLogger(__name__)


# ---- the protocol, against a stub server --------------------------------------------------------
class Stub(http.server.BaseHTTPRequestHandler):
    """Answers each POST from ``script[path]`` (a list of (status, body), last one repeats)."""

    def do_POST(self):  # noqa: N802
        path = self.path.split("?")[0]
        self.server.calls.append(self.path)
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.server.bodies.append(json.loads(raw) if raw else None)
        answers = self.server.script.get(path, [(200, {})])
        status, body = answers.pop(0) if len(answers) > 1 else answers[0]
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    server.calls, server.bodies, server.script = [], [], {}
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    server.server_close()


def fake_checkpoint(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_push_pauses_reloads_resets_and_resumes_retrying_503(stub, tmp_path):
    stub.script["/pause"] = [(503, {"error": "busy"}), (200, {"status": "paused"})]
    stub.script["/collective_rpc"] = [(200, {"results": [None]})]
    stub.script["/reset_prefix_cache"] = [(200, {"success": False}), (200, {"success": True})]
    sync = ReloadSync(stub.url, backoff_s=0)
    metrics = sync.push(fake_checkpoint(tmp_path / "v000001"), 1)
    assert stub.calls == ["/pause?mode=wait", "/pause?mode=wait", "/collective_rpc",
                          "/reset_prefix_cache", "/reset_prefix_cache", "/resume"]
    assert metrics["sync_seconds"] >= metrics["sync_rpc_seconds"] >= 0
    assert sync.serving == (tmp_path / "v000001").resolve()
    with pytest.raises(ValueError, match="new directory"):
        sync.push(tmp_path / "v000001", 2)                          # vLLM may serve stale weights
    with pytest.raises(FileNotFoundError, match="not a safetensors checkpoint"):
        sync.push(tmp_path / "v000002", 2)                          # checked before vLLM sees it
    assert len(stub.calls) == 6


def test_failed_reload_raises_reloads_the_last_good_checkpoint_and_resumes(stub, tmp_path):
    stub.script["/collective_rpc"] = [(500, {"error": "Worker failed"}), (200, {"results": [None]})]
    sync = ReloadSync(stub.url, serving=fake_checkpoint(tmp_path / "v000001"), backoff_s=0)
    with pytest.raises(SyncError) as err:
        sync.push(fake_checkpoint(tmp_path / "v000002"), 2)
    assert err.value.endpoint.endswith("/collective_rpc") and err.value.status == 500
    assert "HTTP 500" in str(err.value) and "Worker failed" in str(err.value)
    assert err.value.attempts == 1                                   # a worker exception: not retried
    assert "v000001 again" in err.value.__notes__[0]
    assert stub.calls == ["/pause?mode=wait", "/collective_rpc", "/collective_rpc", "/resume"]
    assert sync.serving == (tmp_path / "v000001").resolve()


def test_the_directory_served_before_the_first_push_is_asked_at_that_push(stub, tmp_path):
    """The trainer knows what vLLM serves only once it loaded its model, after it made its backend."""
    stub.script["/collective_rpc"] = [(500, {"error": "Worker failed"}), (200, {"results": [None]})]
    asked = []
    start = fake_checkpoint(tmp_path / "v000001")
    sync = ReloadSync(stub.url, serving=lambda: asked.append(1) or start, backoff_s=0)
    assert sync.serving is None and not asked
    with pytest.raises(SyncError) as err:
        sync.push(fake_checkpoint(tmp_path / "v000002"), 2)
    assert "v000001 again" in err.value.__notes__[0] and sync.serving == start.resolve()
    sync.push(tmp_path / "v000002", 2)
    assert asked == [1] and sync.serving == (tmp_path / "v000002").resolve()     # asked once


def test_each_backend_says_whether_it_verifies_and_verifies_at_its_server(stub):
    stub.script["/v1/completions"] = [(200, {"choices": [{"prompt_logprobs": [None, {"7": {"logprob": -1.0}},
                                                                              {"8": {"logprob": -2.0}}]}]})]
    assert NoSync().verifies is False and NoSync().push("anywhere", 1) == {}
    with pytest.raises(RuntimeError, match="nothing to verify"):
        NoSync().verify("policy", [1, 7, 8], [-1.0, -2.0])
    for sync in (ReloadSync(stub.url), LoraSync(stub.url, "policy"), NcclSync(stub.url, lambda: None),
                 ReplicaSync((stub.url,), lambda url: ReloadSync(url), data_dir=None)):
        assert sync.verifies is True
    assert ReloadSync(stub.url).verify("policy", [1, 7, 8], [-1.5, -2.0]) == 0.5
    assert LoraSync(stub.url, "policy").verify("policy", [1, 7, 8], [-1.0, -2.25]) == 0.25
    assert stub.bodies[-1]["prompt"] == [1, 7, 8] and stub.bodies[-1]["model"] == "policy"


def test_sync_error_for_a_server_that_is_not_there(tmp_path):
    with socket.socket() as s:                                       # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(SyncError) as err:
        ReloadSync(url, retries=1, backoff_s=0).push(fake_checkpoint(tmp_path / "v000001"), 1)
    message = str(err.value)
    assert f"POST {url}/pause?mode=wait failed after 2 attempt(s): no response" in message
    assert "ConnectionError" in message and err.value.status is None
    with pytest.raises(SyncError, match="/v1/completions"):
        verify(url, "policy", [1, 2, 3], [0.0, 0.0], retries=0)


def fake_adapter(path):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


def test_lora_push_loads_a_versioned_name_points_the_stable_one_at_it_and_unloads_the_last(stub, tmp_path):
    stub.script["/v1/load_lora_adapter"] = [(503, {"error": "busy"}), (200, {})]
    sync = LoraSync(stub.url, "policy", backoff_s=0)
    v1, v2 = fake_adapter(tmp_path / "v000001"), fake_adapter(tmp_path / "v000002")
    sync.push(v1, 1)
    metrics = sync.push(v2, 2)
    load = "/v1/load_lora_adapter"
    assert stub.calls == [load, load, load, load, load, "/v1/unload_lora_adapter"]   # the first 503 retried
    assert stub.bodies[1:] == [
        {"lora_name": "policy-v1", "lora_path": str(v1.resolve()), "load_inplace": True},
        {"lora_name": "policy", "lora_path": str(v1.resolve()), "load_inplace": True},
        {"lora_name": "policy-v2", "lora_path": str(v2.resolve()), "load_inplace": True},
        {"lora_name": "policy", "lora_path": str(v2.resolve()), "load_inplace": True},
        {"lora_name": "policy-v1"}]
    assert metrics["sync_seconds"] >= metrics["sync_rpc_seconds"] >= 0 and sync.loaded == "policy-v2"
    with pytest.raises(ValueError, match="new directory"):
        sync.push(v2, 3)                                   # vLLM's prefix cache is keyed by the path
    with pytest.raises(FileNotFoundError, match="not a LoRA adapter"):
        sync.push(fake_checkpoint(tmp_path / "full"), 3)  # checked before vLLM sees it
    assert len(stub.calls) == 6


def test_lora_push_keeps_a_canarys_serving_version_loaded(stub, tmp_path):
    in_use = {1}                              # the serving version of a canary (trainer/deployed.py)
    sync = LoraSync(stub.url, "policy", backoff_s=0, keep=lambda: in_use)
    for v in (1, 2, 3):
        sync.push(fake_adapter(tmp_path / f"v{v:06d}"), v)
    unloads = [b for c, b in zip(stub.calls, stub.bodies) if c == "/v1/unload_lora_adapter"]
    assert unloads == [{"lora_name": "policy-v2"}]     # v1 serves: kept; v2 was neither arm
    in_use.clear()
    sync.push(fake_adapter(tmp_path / "v000004"), 4)
    assert stub.bodies[-1] == {"lora_name": "policy-v3"}


def test_lora_push_errors_say_how_to_start_vllm(stub, tmp_path):
    stub.script["/v1/load_lora_adapter"] = [(404, {"detail": "Not Found"})]
    with pytest.raises(SyncError) as err:
        LoraSync(stub.url, "policy").push(fake_adapter(tmp_path / "a"), 1)
    assert err.value.status == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in err.value.__notes__[0]
    stub.script["/v1/load_lora_adapter"] = [(400, {"error": {"message": "The lora adapter 'policy' conflicts "
                                                                        "with a served base model."}})]
    with pytest.raises(SyncError) as err:
        LoraSync(stub.url, "policy").push(fake_adapter(tmp_path / "b"), 1)
    assert err.value.attempts == 1 and "serve it under another name" in err.value.__notes__[0]
    # a failed unload of the old name is logged, not raised: the new version serves already
    stub.script["/v1/load_lora_adapter"] = [(200, {})]
    stub.script["/v1/unload_lora_adapter"] = [(404, {"error": {"message": "The lora adapter 'policy-v1' "
                                                                          "cannot be found."}})]
    sync = LoraSync(stub.url, "policy")
    sync.loaded = "policy-v1"
    sync.push(fake_adapter(tmp_path / "c"), 2)
    assert sync.loaded == "policy-v2"


# ---- the real vLLM server -----------------------------------------------------------------------
@pytest.fixture
def restore_weights(vllm_server, tmp_path):
    """Give the session's vLLM server its original weights back, from a new directory."""
    yield
    copy = shutil.copytree(vllm_server.model_dir, tmp_path / "restore-v0")
    ReloadSync(vllm_server.url).push(copy, 0)


def trainer_for(model_dir, tmp_path, vllm_server, **kwargs):
    cfg = TrainerConfig(model=str(model_dir), data_dir=str(tmp_path / "data"), vllm_url=vllm_server.url,
                        served_model_name=vllm_server.model_name, sync="reload", torch_threads=1, **kwargs)
    trainer = Trainer(cfg)
    trainer.load_or_init()
    return trainer


def test_reload_makes_vllm_serve_the_trainers_weights(vllm_server, tmp_path, restore_weights):
    perturbed = build_tiny_model(tmp_path / "seed1", seed=1)        # same shapes, other weights
    trainer = trainer_for(perturbed, tmp_path, vllm_server)
    ids, expected = trainer.verify_sequence()
    served_before = prompt_logprobs(vllm_server.url, vllm_server.model_name, ids)
    assert verify(vllm_server.url, vllm_server.model_name, ids, expected) > 1e-2   # serves seed 0

    checkpoint = trainer.save(1)
    metrics = ReloadSync(vllm_server.url).push(checkpoint, 1)

    served_after = prompt_logprobs(vllm_server.url, vllm_server.model_name, ids)
    assert max(abs(a - b) for a, b in zip(served_before, served_after)) > 1e-2
    diff = verify(vllm_server.url, vllm_server.model_name, ids, expected)
    log.warning("after reload: max |logprob(vLLM) - logprob(trainer)| = %.3g over %d tokens, sync %.3f s",
                diff, len(ids) - 1, metrics["sync_seconds"])
    assert diff < 1e-4


def test_a_training_step_is_synced_and_verified(vllm_server, tmp_path, restore_weights):
    trainer = trainer_for(vllm_server.model_dir, tmp_path, vllm_server, learning_rate=1e-2)
    rows = [{"transition_id": f"t{i}", "rollout_id": f"r{i}", "task_id": "t", "prompt_token_ids": [60, 61, 62],
             "completion_token_ids": [65 + i, 66], "completion_logprobs": [-5.5, -5.5], "model_version": 0,
             "reward": float(i % 2), "advantage": 1.0 if i % 2 else -1.0, "created_unix_nano": 1}
            for i in range(4)]
    store.write_table(trainer.data_dir, "transitions", pa.Table.from_pylist(rows, schema=store.TRANSITION_SCHEMA))

    row = trainer.train_once()

    assert row["policy_version"] == 1 and row["sync_seconds"] > 0
    assert row["sync_max_abs_logprob_diff"] < 1e-4
    log.warning("after a training step: sync_max_abs_logprob_diff = %.3g", row["sync_max_abs_logprob_diff"])
    saved = store.connect(trainer.data_dir).execute("SELECT sync_max_abs_logprob_diff FROM train_steps").fetchall()
    assert saved == [(row["sync_max_abs_logprob_diff"],)]
    response = requests.post(f"{vllm_server.url}/v1/completions", timeout=30, json={
        "model": vllm_server.model_name, "prompt": [60, 61], "max_tokens": 2})
    assert response.status_code == 200                               # resumed: serving again


def test_vllm_serves_again_after_a_failed_reload(vllm_server, tmp_path, restore_weights):
    # a corrupt file fails half-way through vLLM's reload, which leaves its weights on the meta
    # device; ReloadSync reloads the last good checkpoint, or the next request kills the engine
    good = shutil.copytree(vllm_server.model_dir, tmp_path / "good")
    corrupt = shutil.copytree(vllm_server.model_dir, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    sync = ReloadSync(vllm_server.url, serving=good, retries=0)
    with pytest.raises(SyncError) as err:
        sync.push(corrupt, 1)
    assert err.value.endpoint.endswith("/collective_rpc") and err.value.status == 500
    assert "again and serves it" in err.value.__notes__[0]
    response = requests.post(f"{vllm_server.url}/v1/completions", timeout=30, json={
        "model": vllm_server.model_name, "prompt": [60, 61], "max_tokens": 2})
    assert response.status_code == 200                               # resumed, and the engine lives


def test_a_sync_error_message_carries_its_hints():
    from lightspan.trainer.sync import SyncError

    exc = SyncError("/v1/load_lora_adapter", 404, "Not Found", attempts=1)
    exc.add_note("start vLLM with --enable-lora")
    assert "HTTP 404" in str(exc) and str(exc).endswith("start vLLM with --enable-lora")
