"""Attacks on the collector's API (issue 28, section 4): files beside the collector read through
``/v1/sql``, and a flood of queries (a web page's ``<img>`` can send them) that locks out rewards."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.collector.helpers import api_url


def test_sql_cannot_read_the_collectors_working_directory(collector_factory, tmp_path, monkeypatch):
    """DuckDB lets a connection read its temp directory (``.tmp`` in the working directory) whatever
    ``allowed_directories`` says: ``read_text('.tmp/secret.txt')`` returned the file."""
    work = tmp_path / "cwd"
    (work / ".tmp").mkdir(parents=True)
    (work / ".tmp" / "secret.txt").write_text("SECRET-28")
    monkeypatch.chdir(work)                      # the SQL workers start in the collector's directory
    collector = collector_factory()
    url = api_url(collector, "/v1/sql")
    for path in (".tmp/secret.txt", str(work / ".tmp" / "secret.txt"), ".tmp/*"):
        answer = requests.post(url, json={"sql": f"SELECT content FROM read_text('{path}')"}, timeout=60)
        assert answer.status_code == 400 and "SECRET-28" not in answer.text, (path, answer.text[:300])
        assert "Permission" in answer.json()["error"], answer.text[:300]
    # the store's own tables stay readable
    ok = requests.post(url, json={"sql": "SELECT count(*) FROM spans"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["rows"] == [[0]], ok.text[:300]
