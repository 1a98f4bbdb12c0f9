"""Start-up errors of ``lightspan collector`` are one line naming what is wrong and the fix
(issue 28, section 4): a data or WAL directory it cannot write to gave a 31-line traceback."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest


@contextlib.contextmanager
def read_only(directory: Path):
    """``directory`` made read-only for this process: its mode for a user, a read-only tmpfs
    mounted on it for root (whom modes do not stop)."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield directory
        finally:
            directory.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(directory)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"root cannot be kept from writing here without a read-only mount: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def start(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightspan.cli", "collector", *args, "--grpc-port", "0",
                           "--http-port", "0", "--api-port", "0"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)


@pytest.mark.parametrize("which", ["data_dir", "wal_dir"])
def test_a_directory_the_collector_cannot_write_is_one_line_naming_it(tmp_path, which):
    with read_only(tmp_path / "ro") as ro:
        args = ("--data-dir", str(ro)) if which == "data_dir" else \
            ("--data-dir", str(tmp_path / "data"), "--wal-dir", str(ro / "wal"))
        out = start(tmp_path, *args)
        assert list(ro.iterdir()) == []                          # nothing was written there
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    where = str(ro) if which == "data_dir" else str(ro / "wal")
    assert f"collector.{which}" in lines[0] and f"cannot write to {where}" in lines[0], lines[0]
    assert "fix:" in lines[0] and f"--{which.replace('_', '-')}" in lines[0], lines[0]
    if which == "wal_dir":                                       # checked before anything is written
        assert list((tmp_path / "data").iterdir()) == []
