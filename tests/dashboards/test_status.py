"""``lightspan status`` on a store whose contents are known (the run against a real vLLM is in
test_browser.py)."""

from __future__ import annotations

import json

from lightspan.cli import main
from lightspan.dashboards import status
from tests.conftest import free_port
from tests.dashboards.conftest import ROLLOUTS, TRAIN_STEPS


def run_status(capsys, *args: str) -> tuple[int, str]:
    code = main(["status", *args])
    return code, capsys.readouterr().out


def test_status_counts_what_the_store_holds(ui_store, capsys):
    (ui_store.data_dir / "policy.json").write_text(json.dumps({"version": 2, "path": "/models/v2"}))
    try:
        code, out = run_status(capsys, "--data-dir", str(ui_store.data_dir), "--format", "json")
    finally:
        (ui_store.data_dir / "policy.json").unlink()
    assert code == 0
    d = json.loads(out)["data"]
    assert (d["spans"], d["llm_calls"], d["rollouts"]) == (5 * len(ROLLOUTS), 2 * len(ROLLOUTS), len(ROLLOUTS))
    assert d["rollouts_by_split"]["val"] == {"rollouts": 1, "reward_mean": 0.25}
    assert (d["transitions"], d["transition_builds"]) == (6, 1)
    assert (d["train_steps"], d["training_runs"]) == (len(TRAIN_STEPS), 2)
    assert d["policy"]["version"] == 2
    latest = d["latest_run"]
    assert (latest["run_id"], latest["steps"], latest["step"], latest["loss"]) == ("run-new", 2, 2, 0.25)
    assert d["disk_bytes"]["spans"] > 0 and d["disk_bytes"]["train_steps"] > 0
    assert json.loads(out)["inference"] is None


def test_status_text_and_an_unreachable_inference_server(ui_store, capsys):
    url = f"http://127.0.0.1:{free_port()}"     # nothing listens there
    code, out = run_status(capsys, "--data-dir", str(ui_store.data_dir), "--vllm-url", url, "--timeout-s", "2")
    assert code == 1
    assert f"rollouts      {len(ROLLOUTS)}; train 3 (mean reward 0.500); val 1 (mean reward 0.250)" in out
    assert f"inference       {url}: NOT healthy (unreachable" in out
    assert "latest run      run-new: 2 steps, last step 2" in out
    assert "policy        none published" in out


def test_status_of_an_empty_directory(tmp_path, capsys):
    code, out = run_status(capsys, "--data-dir", str(tmp_path / "nothing-yet"))
    assert code == 0
    assert "(does not exist yet)" in out and "rollouts      0" in out and "latest run      none" in out


def test_status_rejects_a_bad_option(capsys):
    assert main(["status", "--format", "xml"]) == 2
    assert main(["status", "--vllm-url", "localhost:8000"]) == 2


def test_disk_usage_sums_files_per_directory(tmp_path):
    (tmp_path / "spans" / "date=2026-01-01").mkdir(parents=True)
    (tmp_path / "spans" / "date=2026-01-01" / "a.parquet").write_bytes(b"x" * 100)
    (tmp_path / "wal").mkdir()
    (tmp_path / "wal" / "seg").write_bytes(b"y" * 30)
    (tmp_path / "policy.json").write_bytes(b"z" * 7)
    sizes = status.disk_usage(tmp_path)
    assert (sizes["spans"], sizes["wal"], sizes["transitions"], sizes["total"]) == (100, 30, 0, 137)
