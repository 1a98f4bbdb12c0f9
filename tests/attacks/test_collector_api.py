"""Attacks on the collector's API (issue 28, section 4): files beside the collector read through
``/v1/sql``, and a flood of queries (a web page's ``<img>`` can send them) that locks out rewards."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.collector.helpers import api_url, query


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


SLOW = "SELECT count(*) FROM range(100000000) a, range(100) b"   # runs until sql_timeout_s interrupts it


def test_a_flood_of_queries_never_refuses_a_reward(collector_factory):
    """Reward posts shared the queries' turns: while GETs of /v1/sql held every turn and every place
    in the queue, ``POST /v1/rewards`` was answered 429 for as long as the flood lasted."""
    collector = collector_factory(sql_max_concurrent=1, sql_timeout_s=2)
    url = api_url(collector, "/v1/sql")
    assert requests.get(url, params={"q": "SELECT 1"}, timeout=60).status_code == 200   # the worker is warm
    stop, refused, statuses = threading.Event(), threading.Event(), []

    def flood():
        while not stop.is_set():
            status = requests.get(url, params={"q": SLOW}, timeout=60).status_code
            statuses.append(status)
            if status == 429:
                refused.set()

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(12)]
    for thread in threads:
        thread.start()
    try:
        assert refused.wait(30), f"the flood never filled the queries' queue: {statuses}"   # it is full now
        answers = [requests.post(api_url(collector, "/v1/rewards"), json={"rollout_id": f"r{i}", "value": 1.0},
                                 timeout=30) for i in range(3)]
        assert not stop.is_set() and refused.is_set()
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert [a.status_code for a in answers] == [200] * 3, [a.text[:200] for a in answers]
    assert all(a.json()["stored"] == 1 for a in answers)


@pytest.mark.parametrize("headers", [{"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                                     {"Origin": "http://attacker.example"}, {"Origin": "null"}])
def test_a_page_of_another_site_cannot_query(collector_factory, headers):
    """An ``<img src=".../v1/sql?q=...">`` on any page sends a GET (with ``Sec-Fetch-Site: cross-site``
    and no Origin): refused before it takes a turn; curl, scripts and this server's own pages query."""
    collector = collector_factory()
    url = api_url(collector, "/v1/sql")
    answer = requests.get(url, params={"q": "SELECT 1"}, headers=headers, timeout=60)
    assert answer.status_code == 403 and "refused" in answer.json()["error"], answer.text[:300]
    for fine in ({}, {"Sec-Fetch-Site": "same-origin"}, {"Sec-Fetch-Site": "none"},
                 {"Origin": f"http://127.0.0.1:{collector.api_port}", "Sec-Fetch-Site": "same-origin"}):
        ok = requests.get(url, params={"q": "SELECT 1"}, headers=fine, timeout=60)
        assert ok.status_code == 200 and ok.json()["rows"] == [[1]], (fine, ok.text[:300])


@pytest.mark.parametrize("encoded,rollout", [("a%252Fb", "a%2Fb"), ("a%2Fb", "a/b"), ("r%20one", "r one")])
def test_the_events_route_decodes_the_rollout_id_once(collector_factory, data_dir, encoded, rollout):
    """``/v1/rollouts/a%252Fb/events`` stored its reward under ``a/b`` (the path decoded twice), and
    ``a%2Fb`` (how ``lightspan rollout`` quotes an id with a slash in AGL_EVENT_URL) was 404."""
    collector = collector_factory()
    answer = requests.post(api_url(collector, f"/v1/rollouts/{encoded}/events"), timeout=30,
                           json={"event_type": "reward", "data": {"value": 0.5}})
    assert answer.status_code == 200 and answer.json()["rewards"][0]["rollout_id"] == rollout, answer.text[:300]
    collector.flush()
    assert query(data_dir, "SELECT rollout_id, reward FROM spans WHERE name = 'lightspan.reward'") == [(rollout, 0.5)]
