"""A stand-in for the judge's LLM endpoint: records every chat request and answers each task's
group with the answer a test gave for that task (a score JSON text, or an HTTP error status)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

def scores(**entries: tuple[float, str]) -> str:
    """A judge's answer: ``scores(r1=(1.0, "why"), ...)``, as its JSON text."""
    return json.dumps({"scores": {label: {"score": s, "reason": r} for label, (s, r) in entries.items()}})


class JudgeStub:
    """``answers``: task id -> answer text (or an int: answer with that HTTP status). ``requests``
    holds the JSON body of every chat call."""

    def __init__(self, answers: dict[str, str | int]):
        self.answers = answers
        self.requests: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                stub.requests.append(body)
                prompt = body["messages"][1]["content"]     # the group's task is named in it
                task = max((t for t in stub.answers if t in prompt), key=len, default=None)
                answer = stub.answers.get(task, 404)
                if isinstance(answer, int):
                    status, payload = answer, json.dumps({"error": "stub"}).encode()
                else:
                    status = 200
                    payload = json.dumps({"id": "j", "object": "chat.completion", "model": "judge", "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]}
                    ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def prompts(self) -> list[str]:
        """The user message of every chat call, in order."""
        return [body["messages"][1]["content"] for body in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
