"""Fixtures of the collector tests: a data directory and collectors that are stopped afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightspan.collector.server import Collector
from tests.collector.helpers import config


@pytest.fixture
def data_dir(tmp_path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def collector_factory(data_dir):
    started = []

    def make(**overrides) -> Collector:
        collector = Collector(config(overrides.pop("data_dir", data_dir), **overrides)).start()
        started.append(collector)
        return collector

    yield make
    for collector in started:
        collector.stop()
