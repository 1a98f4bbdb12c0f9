"""scripts/setup.sh refuses, before pip starts, to install where the disk has no room for it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def small_disk(tmp_path):
    """A real 50 MB filesystem (tmpfs), mounted for the test."""
    where = tmp_path / "small"
    where.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=50m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("this machine lets the tests mount no tmpfs")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def _setup(script: Path, vllm_venv: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(vllm_venv.parent), "PYTHON": sys.executable,
           "LIGHTSPAN_VLLM_VENV": str(vllm_venv)}
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)


def test_no_room_for_vllm_is_refused_before_pip_starts(small_disk):
    # the checkout's .venv is there: only vLLM's environment is still to install
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("the checkout has no .venv (scripts/test.sh makes it)")
    out = _setup(ROOT / "scripts" / "setup.sh", small_disk / "cache" / "vllm")
    assert out.returncode == 1, out
    assert f"{small_disk / 'cache' / 'vllm'} needs about 4 GB free on the filesystem of {small_disk}, and" in out.stderr
    assert "installing" not in out.stdout + out.stderr          # nothing was started, .venv untouched
    assert list(small_disk.iterdir()) == []


def test_what_shares_a_filesystem_is_added_up(small_disk):
    # a checkout on the small disk with no .venv yet, and vLLM's environment beside it
    checkout = small_disk / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", checkout / "scripts")
    out = _setup(checkout / "scripts" / "setup.sh", small_disk / "vllm")
    assert out.returncode == 1, out
    assert f".venv and {small_disk / 'vllm'} need about 7 GB free on the filesystem of {checkout}, and" in out.stderr
    assert sorted(p.name for p in small_disk.iterdir()) == ["checkout"]
    assert sorted(p.name for p in checkout.iterdir()) == ["scripts"]
