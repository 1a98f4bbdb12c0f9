"""A retrieval service with Search-R1's HTTP contract, on BM25 (``bm25s``), over a JSONL corpus.

    python examples/search_r1/retriever.py --corpus examples/search_r1/data/corpus.jsonl --port 8010

The contract is Search-R1's retrieval server's (``search_r1/search/retrieval_server.py`` there), so
an agent written for Search-R1 or for Agent Lightning's Search-R1 example can call it unchanged:

    POST /retrieve   {"queries": ["Orlen Vask"], "topk": 3, "return_scores": true}
    200              {"result": [[{"document": {"id": "41", "contents": "\\"Orlen Vask\\"\\nOrlen Vask is ...",
                                                "title": "Orlen Vask", "text": "Orlen Vask is ..."},
                                   "score": 2.31}, ...]]}

one list per query, best first; without ``return_scores`` each item is the document itself.
``topk`` missing or null takes ``--topk``. A document with no query term in it (BM25 score 0) is never
returned, as Lucene's BM25 returns only matching documents, so a list may be shorter than ``topk``.
``GET /healthz`` answers ``{"status": "ok", "documents": N}``. A request that breaks the contract
gets 400 with what is wrong (``{"error": ...}``); at most ``--max-queries`` queries and ``--max-topk``
documents per query, bodies up to 1 MB.

The corpus is Search-R1's format: one ``{"id", "contents"}`` per line, ``contents`` being
``"Title"\\ntext`` (``title`` and ``text`` fields are accepted instead). The index is built in memory
at start-up (a few ms for this example's 158 articles; bm25s indexes about a million short documents
a minute on one core), lower-cased, English stop words removed, no stemming.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import bm25s
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

log = logging.getLogger("search_r1.retriever")
MAX_BODY = 1 << 20


def read_corpus(path: str | Path) -> list[dict]:
    """The corpus's documents, each with ``id``, ``contents``, ``title`` and ``text``; a line that is
    not a document is an error naming the line."""
    docs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n} is not a JSON object")
        if "contents" in row:
            title, _, text = str(row["contents"]).partition("\n")
            title = title.strip('"')
        elif "text" in row:
            title, text = str(row.get("title", "")), str(row["text"])
        else:
            raise ValueError(f"{path}:{n} has no \"contents\" (nor \"text\")")
        docs.append({"id": str(row.get("id", len(docs))), "contents": f'"{title}"\n{text}' if title else text,
                     "title": title, "text": text})
    if not docs:
        raise ValueError(f"{path} holds no document")
    return docs


class Index:
    """BM25 over the documents' title and text."""

    def __init__(self, docs: list[dict]):
        self.docs = docs
        self.bm25 = bm25s.BM25()
        self.bm25.index(bm25s.tokenize([f"{d['title']} {d['text']}" for d in docs], stopwords="en",
                                       show_progress=False), show_progress=False)

    def search(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        """For each query, up to ``topk`` (document, score) pairs with a score above 0, best first."""
        out: list[list[tuple[dict, float]]] = [[] for _ in queries]
        k = min(topk, len(self.docs))
        # a query with no indexable term (empty, only stop words) matches nothing
        tokens = bm25s.tokenize(queries, stopwords="en", show_progress=False, return_ids=False)
        live = [i for i, t in enumerate(tokens) if t]
        if not live or k < 1:
            return out
        ids, scores = self.bm25.retrieve([tokens[i] for i in live], k=k, show_progress=False)
        for row, i in enumerate(live):
            out[i] = [(self.docs[int(d)], float(s)) for d, s in zip(ids[row], scores[row]) if s > 0]
        return out


def parse_request(body: bytes, max_queries: int, max_topk: int, default_topk: int) -> tuple[list[str], int, bool]:
    """``(queries, topk, return_scores)`` of a /retrieve body; ValueError saying what is wrong."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("the body is not JSON") from None
    if not isinstance(doc, dict):
        raise ValueError("the body must be a JSON object with \"queries\"")
    queries = doc.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError("\"queries\" must be a list of strings")
    if len(queries) > max_queries:
        raise ValueError(f"at most {max_queries} queries per request, got {len(queries)}")
    topk = doc.get("topk")
    if topk is None:
        topk = default_topk
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= max_topk:
        raise ValueError(f"\"topk\" must be a whole number from 1 to {max_topk}")
    scores = doc.get("return_scores", False)
    if not isinstance(scores, bool):
        raise ValueError("\"return_scores\" must be true or false")
    return queries, topk, scores


def make_app(index: Index, topk: int = 3, max_topk: int = 50, max_queries: int = 256) -> Starlette:
    def document(d: dict) -> dict:
        return {"id": d["id"], "contents": d["contents"], "title": d["title"], "text": d["text"]}

    async def retrieve(request: Request) -> JSONResponse:
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                return JSONResponse({"error": f"body over {MAX_BODY} bytes"}, status_code=413)
        try:
            queries, k, with_scores = parse_request(body, max_queries, max_topk, topk)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        hits = index.search(queries, k)
        result = [[{"document": document(d), "score": s} if with_scores else document(d) for d, s in one]
                  for one in hits]
        return JSONResponse({"result": result})

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "documents": len(index.docs)})

    return Starlette(routes=[Route("/retrieve", retrieve, methods=["POST"]),
                             Route("/healthz", healthz, methods=["GET"])])


def main() -> None:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(here / "data" / "corpus.jsonl"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--topk", type=int, default=3, help="documents per query when a request gives no topk")
    parser.add_argument("--max-topk", type=int, default=50)
    parser.add_argument("--max-queries", type=int, default=256)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    docs = read_corpus(args.corpus)
    app = make_app(Index(docs), args.topk, args.max_topk, args.max_queries)
    log.info("%d documents from %s; POST http://%s:%d/retrieve", len(docs), args.corpus, args.host, args.port)
    # a bounded server: connections past limit_concurrency get 503, idle keep-alives close after 5 s
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", limit_concurrency=64,
                timeout_keep_alive=5)


if __name__ == "__main__":
    main()
