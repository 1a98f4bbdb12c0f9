"""bench/gpu_check.sh --smoke: the GPU check's own code path, on the CPU with a tiny config.

No GPU here: this runs the same script with ``--smoke`` (a tiny Qwen2, fp32, two timed steps)
so that the prepared check is known to work before a GPU machine runs it for real.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402


def test_smoke_run_writes_the_json(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(REPO / "bench" / "gpu_check.sh"), "--smoke", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result

    expected = Qwen2ForCausalLM(Qwen2Config(**gpu_check.SMOKE))
    assert result["model"]["parameters"] == sum(p.numel() for p in expected.parameters())
    assert result["batch"]["tokens_per_step"] == 4 * (24 + 16)
    assert len(result["steps"]["seconds"]) == 2 and all(s > 0 for s in result["steps"]["seconds"])
    assert result["tokens_per_second"] == pytest.approx(
        result["batch"]["tokens_per_step"] / result["steps"]["mean_seconds"], rel=1e-3)
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])
    assert result["losses"][0] != result["losses"][1]          # different batches, a trained model
    assert result["mfu"] is None and result["peak_memory_gib"] is None      # no GPU: nothing to claim
    assert "skipped" in result["nccl_weight_sync"]


def test_missing_module_fails_clearly(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_check, "REQUIRED", (*gpu_check.REQUIRED, "lightspan_no_such_module"))
    assert gpu_check.main(["--smoke", "--out", str(tmp_path / "x.json")]) == 2
    assert "cannot import lightspan_no_such_module" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_peak_flops_by_device_name():
    assert gpu_check.peak_tflops("NVIDIA H200") == 989.4
    assert gpu_check.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert gpu_check.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_check.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_check.peak_tflops("NVIDIA L40S") == 362.1
    assert gpu_check.peak_tflops("Some Future GPU") is None
