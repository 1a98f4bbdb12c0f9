"""A demo or experiment wipes only a data directory that an earlier demo or experiment made; its CPU
clock counts each service it started apart from the rest."""

import socket
import subprocess
import sys

import pytest

from lightspan.core.config import ConfigError
from lightspan.runs import RUN_MARKER, CpuClock, free_ports, fresh_data_dir, tree_cpu_seconds


def test_a_new_directory_is_made_and_marked_then_wiped_by_the_next_run(tmp_path):
    data = fresh_data_dir(str(tmp_path / "run"), "demo")
    assert (data / "logs").is_dir() and (data / RUN_MARKER).is_file()
    (data / "spans").mkdir()
    again = fresh_data_dir(str(data), "experiment")
    assert again == data and not (data / "spans").exists() and (data / RUN_MARKER).is_file()


def test_a_directory_it_did_not_make_is_refused_and_left_alone(tmp_path):
    store = tmp_path / "lightspan-data"
    (store / "spans").mkdir(parents=True)
    (store / "spans" / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError) as err:
        fresh_data_dir(str(store), "experiment")
    assert err.value.field == "experiment.data_dir"
    assert (store / "spans" / "x.parquet").read_bytes() == b"PAR1"


_BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_the_cpu_clock_counts_a_service_and_its_child_apart_from_the_rest():
    procs = {}
    clock = CpuClock(procs)
    # a "service" that burns 0.4 CPU-s in a child of its own, then waits to be stopped
    service = subprocess.Popen([sys.executable, "-c", "import subprocess, sys\n"
                                f"subprocess.run([sys.executable, '-c', {_BURN.format(s=0.4)!r}])\n"
                                "print('done', flush=True)\nsys.stdin.read()"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs["service"] = service
    try:
        assert service.stdout.readline() == "done\n"
        subprocess.run([sys.executable, "-c", _BURN.format(s=0.3)], check=True)   # a one-shot job: the rest
        parts = clock.parts()
        assert set(parts) == {"service", "rest"}
        assert 0.4 <= parts["service"] < 0.4 + 1.0          # its child's burn, reaped into it, and its start-up
        assert 0.3 <= parts["rest"]
        assert abs(sum(parts.values()) - (tree_cpu_seconds() - clock.start)) < 0.05
    finally:
        service.stdin.close()
        service.wait()
    # a service that has exited is counted in the rest (its parent reaped it)
    after = clock.parts()
    assert set(after) == {"rest"} and after["rest"] >= 0.7


def test_free_ports_are_distinct_and_bindable():
    """Ports picked together never repeat (a socket bound to port 0 and closed may hand the next
    one the same port: three services once got [58441, 57207, 57207])."""
    for _ in range(50):
        ports = free_ports(5)
        assert len(set(ports)) == 5
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))
