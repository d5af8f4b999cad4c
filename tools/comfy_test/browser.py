"""Headless Chromium on ComfyUI's own frontend page, driven over the DevTools protocol (a stdlib websocket
client; Debian's `chromium` package). Only loopback hosts resolve: the page cannot reach the internet."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from comfy import poll


class WebSocket:
    """Just enough RFC 6455 for the DevTools protocol: masked text frames out, text frames in."""

    def __init__(self, url: str, timeout: float = 60):
        parts = urllib.parse.urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise ConnectionError(f"websocket handshake with {url} failed: {head[:200]!r}")

    def send(self, text: str) -> None:
        data, mask = text.encode(), os.urandom(4)
        n = len(data)
        header = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else
                                  bytes([0x80 | 126]) + struct.pack(">H", n) if n < 65536 else
                                  bytes([0x80 | 127]) + struct.pack(">Q", n))
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def _exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("websocket closed")
            out += chunk
        return out

    def recv(self) -> str:
        message = b""
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            n = struct.unpack(">H", self._exact(2))[0] if n == 126 else (
                struct.unpack(">Q", self._exact(8))[0] if n == 127 else n)
            payload = self._exact(n)
            if b0 & 0x0F == 0x8:
                raise ConnectionError("websocket closed by the browser")
            if b0 & 0x0F in (0x9, 0xA):  # ping/pong: not used by chromium here
                continue
            message += payload
            if b0 & 0x80:
                return message.decode()


class Browser:
    """Chromium with one page; `evaluate` runs JavaScript (promises awaited) and returns its JSON value."""

    def __init__(self, chromium: str | None = None, size=(1600, 1000)):
        exe = chromium or shutil.which("chromium") or shutil.which("chromium-browser")
        if not exe:
            raise RuntimeError("no chromium found: install it (Debian/Ubuntu: apt-get install chromium) or "
                               "pass --chromium PATH")
        self.profile = tempfile.mkdtemp(prefix="qwen_edit_chromium_")
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
             "--disable-background-networking", "--disable-component-update",
             "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--user-data-dir={self.profile}", f"--window-size={size[0]},{size[1]}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = Path(self.profile) / "DevToolsActivePort"
        poll(lambda: port_file.is_file() and port_file.read_text().strip(), 60, "chromium to start")
        port = int(port_file.read_text().split()[0])
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        page = next(t for t in targets if t.get("type") == "page")
        self.ws, self.next_id, self.errors = WebSocket(page["webSocketDebuggerUrl"]), 0, []
        self.call("Runtime.enable")
        self.call("Page.enable")

    def call(self, method: str, params: dict | None = None) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params or {}}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("method") == "Runtime.exceptionThrown":
                self.errors.append(msg["params"]["exceptionDetails"].get("exception", {}).get("description"))
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True})
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError("page error: " + str(details.get("exception", {}).get("description")
                                                    or details.get("text")))
        return result.get("result", {}).get("value")

    def open_comfy(self, url: str, timeout: float = 180) -> None:
        """Open ComfyUI's page and wait until its app (and the extensions) are ready."""
        self.call("Page.navigate", {"url": url.rstrip("/") + "/"})
        ready = ("!!(window.app && window.app.graph && window.app.canvas && window.app.extensions && "
                 "window.app.extensions.some(e => e.name === 'qwen_edit.live_training'))")
        poll(lambda: self._safe(ready), timeout, "the ComfyUI frontend and the pack's extension to load")

    def _safe(self, expression: str):
        try:
            return self.evaluate(expression)
        except RuntimeError:
            return None

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the session we started for our chromium
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        shutil.rmtree(self.profile, ignore_errors=True)
