"""A small headless-Chromium driver over the Chrome DevTools Protocol (websocket-client only).

Debian's ``chromium`` package provides the browser; nothing is downloaded. Chromium is started
with ``--remote-debugging-port=0`` and a fresh profile; the port it picked is read from
``DevToolsActivePort`` in that profile. Console errors, uncaught exceptions and failed loads
(the ``Log`` domain: 404s, CSP violations) are collected as they arrive.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import requests
import websocket

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         "--disable-default-apps", "--mute-audio", "--window-size=1400,1000", "--remote-debugging-port=0",
         "--remote-allow-origins=*"]


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless Chromium with one page. ``goto``, ``wait_for``, ``evaluate``, ``screenshot``."""

    def __init__(self, executable: str, timeout_s: float = 30.0):
        self.profile = Path(tempfile.mkdtemp(prefix="lightspan-chromium-"))
        self.log = open(self.profile.parent / f"{self.profile.name}.log", "wb")
        self.proc = subprocess.Popen([executable, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.timeout_s = timeout_s
        self.errors: list[str] = []
        self._next_id = 0
        try:
            port = self._port()
            pages = [t for t in requests.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
                     if t["type"] == "page"]
            self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=timeout_s,
                                                  suppress_origin=True)
            for domain in ("Page", "Runtime", "Log"):
                self.call(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    def _port(self) -> int:
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with code {self.proc.returncode}")
            text = marker.read_text() if marker.is_file() else ""
            if text.strip():
                return int(text.split()[0])
            time.sleep(0.05)
        raise TimeoutError("chromium did not open its DevTools port")

    # --- protocol -----------------------------------------------------------------------------
    def _event(self, message: dict) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description", "")))
                                                      for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append("exception: " + str(details.get("exception", {}).get("description") or details.get("text")))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log: {entry.get('text')} {entry.get('url', '')}".strip())

    def call(self, method: str, **params) -> dict:
        self._next_id += 1
        call_id = self._next_id
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._event(message)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    # --- conveniences -------------------------------------------------------------------------
    def goto(self, url: str) -> None:
        """Load ``url`` afresh (through about:blank: a changed #fragment alone would not reload)."""
        self.call("Page.navigate", url="about:blank")
        self.wait_for("document.readyState === 'complete' && location.href === 'about:blank'")
        self.call("Page.navigate", url=url)

    def wait_for(self, expression: str, what: str | None = None):
        """Poll ``expression`` until it is truthy; its value. Fails with the page's errors."""
        # mid-load the page may throw; an element found is true (a DOM node has no JSON value)
        guarded = (f"(() => {{ try {{ const v = ({expression}); return v instanceof Node ? true : v; }} "
                   "catch (e) { return null; } })()")
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            value = self.evaluate(guarded)
            if value:
                return value
            time.sleep(0.05)
        state = self.evaluate("document.getElementById('main') && document.getElementById('main').innerText")
        raise AssertionError(f"timed out waiting for {what or expression}; errors {self.errors}; page: {state!r}")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            try:
                ws.close()
            except Exception:   # the browser is going away anyway
                pass
        if self.proc.poll() is None:   # the browser and its helpers: the process group we started
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.profile, ignore_errors=True)
