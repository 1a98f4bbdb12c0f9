"""core/schedule.py and the job that uses it, ``lightspan transitions build --every``."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from lightspan import store
from lightspan.core import schedule
from lightspan.core.config import ConfigError
from lightspan.lightningrl.config import TransitionsConfig
from tests.lightningrl.helpers import episode, write


def test_a_failed_run_is_logged_and_the_next_runs(caplog):
    stop, runs = threading.Event(), []

    def job():
        runs.append(len(runs))
        if len(runs) == 2:
            raise RuntimeError("store unreachable")
        if len(runs) == 4:
            stop.set()

    with caplog.at_level(logging.ERROR, logger="lightspan.core.schedule"):
        assert schedule.every(0.001, job, stop=stop, name="build") == 0       # the last run succeeded
    assert runs == [0, 1, 2, 3]
    assert [r.getMessage() for r in caplog.records] == ["build failed (1 so far), next in 0 s: store unreachable"]


def test_the_exit_code_says_the_last_run_failed():
    stop = threading.Event()

    def job():
        stop.set()
        raise OSError("no space left")

    assert schedule.every(0.001, job, stop=stop) == 1


@pytest.mark.parametrize("fields, message", [
    ({"every": "0s"}, "transitions.every: '0s' is not a positive duration"),
    ({"every": "soon"}, "transitions.every: 'soon' is not a positive duration"),
    ({"every": "30s", "incremental": False}, "transitions.every: a scheduled build must be incremental"),
])
def test_a_bad_schedule_fails_at_start_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        TransitionsConfig(**fields)


def test_scheduled_builds_store_each_rollout_once_and_stop_on_sigterm(tmp_path):
    received = time.time_ns() - 3600 * 10**9            # older than the watermark's lag: read once
    write(tmp_path, episode("r1", 1.0, received_unix_nano=received) + episode("r2", 0.0, received_unix_nano=received))
    proc = subprocess.Popen([sys.executable, "-m", "lightspan.cli", "transitions", "build", "--data-dir",
                             str(tmp_path), "--every", "0.05s", "--min-group-size", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "LIGHTSPAN_PROGRESS": "0"})
    try:
        builds = [json.loads(proc.stdout.readline()) for _ in range(3)]     # a JSON line per build
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert [b["transitions/rollouts"] for b in builds] == [2, 0, 0]
    assert "SIGTERM: finishing the current run, then stopping" in err
    con = store.connect(str(tmp_path))
    try:
        assert con.execute("SELECT count(DISTINCT rollout_id), count(*) FROM transitions").fetchone() == (2, 2)
    finally:
        con.close()
