"""examples/search_r1: the fictional encyclopedia and its questions, the BM25 retrieval service's HTTP
contract (Search-R1's /retrieve), the agent's episode and exact-match reward against the real service,
a retriever that is down as an infrastructure failure (never a reward of 0), and one training step on
the session's vLLM."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import requests

from tests.conftest import free_port
from tests.examples.test_examples import (  # noqa: F401 (collector: a fixture)
    EXAMPLES, collector, lightspan, load, grade_first_of_each_task, train_one_step)

SEARCH_R1 = EXAMPLES / "search_r1"
ENV_MAP = "QUESTION=input.question,GOLDEN_ANSWERS=input.golden_answers"


@pytest.fixture(scope="module")
def gen():
    return load(SEARCH_R1 / "make_corpus.py")


@pytest.fixture(scope="module")
def agent():
    pytest.importorskip("openai")
    return load(SEARCH_R1 / "agent.py")


@contextmanager
def retriever_process(corpus, *extra: str):
    """The real service (``retriever.py``, uvicorn) on a free port; yields its /retrieve URL."""
    pytest.importorskip("bm25s", reason="pip install 'lightspan[search-r1]'")
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SEARCH_R1 / "retriever.py"), "--corpus", str(corpus),
                             "--port", str(port), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(300):
            try:
                if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).ok:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode()[-2000:])
            threading.Event().wait(0.1)
        yield f"http://127.0.0.1:{port}/retrieve"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def retriever():
    with retriever_process(SEARCH_R1 / "data" / "corpus.jsonl") as url:
        yield url


def test_the_world_answers_every_question_from_its_articles(gen):
    corpus, train, val = gen.make_splits(0)
    assert (corpus, train, val) == gen.make_splits(0)                      # deterministic
    text = {doc["contents"].split("\n")[0].strip('"'): doc["contents"].split("\n", 1)[1] for doc in corpus}
    assert len(text) == len(corpus)                                       # one article per name
    assert not {q["subject"] for q in train} & {q["subject"] for q in val}  # held out by subject
    assert {q["hops"] for q in val} == {1, 2} and {q["kind"] for q in val} == {q["kind"] for q in train}
    for q in train + val:
        answer = q["golden_answers"][0]
        if q["hops"] == 1:        # in the subject's own article
            assert answer in text[q["subject"]], q
        else:                     # in the article of an entity the subject's article names
            linked = [name for name in text if name != q["subject"] and name in text[q["subject"]]]
            assert any(answer in text[name] for name in linked), q
    shipped = [json.loads(line) for line in (SEARCH_R1 / "data" / "val.jsonl").read_text().splitlines()]
    assert shipped == val                                                 # the files are reproducible


def test_retrieve_speaks_search_r1s_contract(retriever, gen):
    corpus, train, _ = gen.make_splits(0)
    subject = next(q["subject"] for q in train if q["kind"] == "born_city")
    with_scores = requests.post(retriever, json={"queries": [f"{subject} born", "zzqx"], "topk": 2,
                                                       "return_scores": True},
                                timeout=10).json()
    first, nothing = with_scores["result"]
    assert nothing == []                                    # no term matched: no document, not score-0 padding
    assert len(first) == 2 and first[0]["score"] >= first[1]["score"] > 0
    doc = first[0]["document"]
    assert doc["title"] == subject and doc["contents"] == f'"{subject}"\n{doc["text"]}'
    assert doc["contents"] in {d["contents"] for d in corpus}
    plain = requests.post(retriever, json={"queries": [f"{subject} born"]}, timeout=10).json()["result"][0]
    assert len(plain) == 3 and plain[0] == doc              # default topk (--topk 3), documents without scores
    assert requests.post(retriever, json={"queries": []}, timeout=10).json() == {"result": []}
    for bad in ({"queries": "one"}, {"queries": [1]}, {"queries": ["a"], "topk": 0}, {"queries": ["a"], "topk": True},
                {"queries": ["a"], "topk": 51}, {"queries": ["a"], "return_scores": "yes"}, [1]):
        r = requests.post(retriever, json=bad, timeout=10)
        assert r.status_code == 400 and r.json()["error"], (bad, r.text)
    assert requests.post(retriever, data=b"{not json", timeout=10).status_code == 400
    assert requests.get(retriever.replace("/retrieve", "/healthz"), timeout=10).json() == \
        {"status": "ok", "documents": len(corpus)}


def test_a_corpus_line_without_a_document_is_refused_with_its_line(tmp_path):
    pytest.importorskip("bm25s", reason="pip install 'lightspan[search-r1]'")
    retriever = load(SEARCH_R1 / "retriever.py")
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"id": "0", "contents": "\\"A\\"\\nA is."}\n{"id": "1", "title": "B"}\n')
    with pytest.raises(ValueError, match=r"corpus.jsonl:2 has no \"contents\""):
        retriever.read_corpus(bad)


def test_exact_match_is_search_r1s(agent):
    assert agent.exact_match("The  Rivenby.", ["rivenby"]) == 1.0
    assert agent.exact_match("Rivenby, Norvania", ["Rivenby"]) == 0.0
    assert agent.exact_match(None, ["Rivenby"]) == 0.0
    assert agent.golden_answers('["a", "b"]') == ["a", "b"] and agent.golden_answers("Rivenby") == ["Rivenby"]
    assert agent.parse_action("<search>Jon Brisk") == ("search", "Jon Brisk")
    assert agent.parse_action("x <answer>Osterfell</answer> y") == ("answer", "Osterfell")
    assert agent.parse_action("Osterfell") == (None, "")


class Scripted:
    """An OpenAI client whose chat completions are the given replies, in order; it keeps the requests."""

    def __init__(self, replies):
        self.replies, self.requests = list(replies), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    def _create(self, **request):
        self.requests.append(copy.deepcopy(request))
        message = SimpleNamespace(content=self.replies.pop(0))
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def test_a_two_hop_episode_against_the_real_service(agent, retriever, gen):
    _, train, _ = gen.make_splits(0)
    q = next(q for q in train if q["kind"] == "born_country")
    person = q["subject"]
    city = requests.post(retriever, json={"queries": [person], "topk": 1}, timeout=10).json()["result"][0][0]
    born = city["text"].rsplit("born in ", 1)[1].rstrip(".")
    client = Scripted([f"<search>{person}", f"<search>{born}", f"<answer>{q['golden_answers'][0]}"])
    episode = agent.search_episode(client, q["question"], q["golden_answers"], retrieval_url=retriever, shots=2)
    assert episode["reward"] == 1.0 and episode["searches"] == [person, born] and episode["turns"] == 3
    info = client.requests[1]["messages"][-1]
    assert info["role"] == "user" and info["content"].startswith(f"<information>Doc 1(Title: {person}) ")
    assert client.requests[0]["stop"] == agent.STOP
    wrong = agent.search_episode(Scripted(["<answer>Nowhere"]), q["question"], q["golden_answers"],
                                 retrieval_url=retriever)
    assert (wrong["reward"], wrong["ended"]) == (0.0, "answer")
    invalid = agent.search_episode(Scripted(["I do not know"]), q["question"], q["golden_answers"],
                                   retrieval_url=retriever)
    assert (invalid["reward"], invalid["ended"]) == (0.0, "invalid")


@contextmanager
def flaky_retriever():
    """Answers the agent's start-up check (no queries) and fails every search with 503."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            code, out = (200, b'{"result": []}') if not body["queries"] else (503, b"overloaded")
            self.send_response(code)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    finally:
        server.shutdown()


def test_a_retriever_that_is_down_is_not_the_models_failure(agent):
    dead = f"http://127.0.0.1:{free_port()}/retrieve"
    client = Scripted(["<search>Jon Brisk"])
    with pytest.raises(agent.RetrieverUnavailable, match="unreachable"):
        agent.search_episode(client, "q", ["a"], retrieval_url=dead)
    assert client.requests == []                         # checked before any LLM call
    with flaky_retriever() as url:
        client = Scripted(["<search>Jon Brisk"])
        with pytest.raises(agent.RetrieverUnavailable, match="answered 503"):
            agent.search_episode(client, "q", ["a"], retrieval_url=url)
        assert len(client.requests) == 1                 # failed at the search, mid-episode


@pytest.mark.e2e
def test_retriever_down_fails_the_rollout_as_infrastructure(collector, tmp_path):
    """Under ``lightspan rollout`` (worker mode): exit status 75, outcome infra, retried, no reward stored;
    the rollouts view says infra and the transition builder drops them as infra, never as reward 0."""
    import os

    from lightspan import store

    data, ports = collector
    api = f"http://127.0.0.1:{ports['api']}"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "q1", "question": "Who founded Ki Works?", "golden_answers": ["A B"]}) + "\n")
    env = {**os.environ, "SEARCH_R1_RETRIEVAL_URL": f"http://127.0.0.1:{free_port()}/retrieve"}
    out = subprocess.run([sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(tasks), "--samples", "2",
                          "--env-map", ENV_MAP, "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}",
                          "--openai-base-url", f"http://127.0.0.1:{free_port()}/v1", "--data-dir", str(data),
                          "--timeout-s", "60", "--", sys.executable, str(SEARCH_R1 / "agent.py")],
                         env=env, check=True, text=True, stdout=subprocess.PIPE).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["ok"], summary["failed"], summary["infra"]) == (0, 0, 2), summary
    requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()
    rows = store.connect(data).execute(
        "SELECT outcome, exit_code, status, final_reward FROM rollouts WHERE task_id = 'q1'").fetchall()
    assert rows == [("infra", 75, "infra", None)] * 4, rows         # 2 samples, each tried twice
    logs = list((data / "rollout-logs").glob("q1-*.log"))
    assert any("unreachable" in p.read_text() for p in logs)
    built = lightspan("transitions", "build", "--data-dir", str(data), "--grace-s", "0")
    assert built["transitions/dropped_rollouts/infra"] == 4 and built.get("transitions/calls", 0) == 0, built


@pytest.mark.e2e
def test_search_r1_trains_one_step_from_its_traces(collector, vllm_server, tiny_model, tmp_path, gen):
    """The unchanged agent under ``lightspan rollout`` with the real retriever, transitions, one GRPO
    step. The tiny model writes random bytes (an invalid action: one call, reward 0); a grader marks one
    rollout per task solved so that each group has an advantage."""
    import os

    from lightspan import store
    from lightspan.trainer.sync import ReloadSync

    data, ports = collector
    api = f"http://127.0.0.1:{ports['api']}"
    ReloadSync(vllm_server.url).push(str(tiny_model), 0)
    _, train, _ = gen.make_splits(0)
    tasks = tmp_path / "train.jsonl"      # no worked dialogue and 8 new tokens: the tiny model's context
    tasks.write_text("".join(json.dumps({**q, "shots": 0, "max_tokens": 8, "temperature": 0.8}) + "\n"
                             for q in train[:2]))
    with retriever_process(SEARCH_R1 / "data" / "corpus.jsonl") as url:
        env = {**os.environ, "SEARCH_R1_RETRIEVAL_URL": url}
        out = subprocess.run([sys.executable, "-m", "lightspan.cli", "rollout", "--tasks", str(tasks),
                              "--samples", "2", "--env-map", ENV_MAP,
                              "--otlp-endpoint", f"http://127.0.0.1:{ports['http']}", "--openai-base-url",
                              f"{vllm_server.url}/v1", "--data-dir", str(data), "--timeout-s", "120",
                              "--", sys.executable, str(SEARCH_R1 / "agent.py")],
                             env=env, check=True, text=True, stdout=subprocess.PIPE).stdout
    assert json.loads(out.strip().splitlines()[-1])["ok"] == 4, out
    requests.post(f"{api}/v1/flush", timeout=60).raise_for_status()
    con = store.connect(data)
    rollouts = con.execute("SELECT rollout_key, task_id, final_reward FROM rollouts WHERE task_id IS NOT NULL "
                           "ORDER BY rollout_key").fetchall()
    assert len(rollouts) == 4 and all(r[2] == 0.0 for r in rollouts), rollouts
    calls = con.execute("SELECT count(*) FILTER (WHERE len(completion_token_ids) > 0) FROM llm_calls").fetchone()[0]
    assert calls >= 4
    grade_first_of_each_task(api, rollouts)
    built = lightspan("transitions", "build", "--data-dir", str(data), "--grace-s", "0")
    assert built["transitions/calls"] == calls and built["transitions/nonzero_advantage"] > 0, built
    train_one_step(data, tiny_model, vllm_server.url)
