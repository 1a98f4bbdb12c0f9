"""A stand-in for vLLM's chat route in gateway tests: answers every POST with a one-token chat
completion carrying ids and logprobs, and records each request body it was sent."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ChatStub:
    def __init__(self):
        self.calls: list[dict] = []
        calls = self.calls

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                calls.append(body)
                data = json.dumps({"id": "c", "object": "chat.completion", "model": body.get("model", "policy"),
                                   "prompt_token_ids": [1, 2],
                                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"},
                                                "finish_reason": "stop", "token_ids": [7],
                                                "logprobs": {"content": [{"token": "a", "logprob": -0.5}]}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def models(self) -> list[str]:
        """The model each call asked for, in order."""
        return [body.get("model") for body in self.calls]
