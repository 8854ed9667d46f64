"""Gradient models open and render in Netron, in a real (headless) Chromium.

Netron serves the model on 127.0.0.1 only; Chromium is driven over the DevTools
protocol on a pipe (no port opened). Skipped where Chromium or netron is missing.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import onnx
import pytest

import onnxgrad

MODELS = Path(__file__).resolve().parent.parent / "models"
_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def _browser() -> str | None:
    return next((p for p in map(shutil.which, _BROWSERS) if p), None)


class _Chromium:
    """Headless Chromium driven over ``--remote-debugging-pipe`` (fd 3 in, fd 4 out)."""

    def __init__(self, exe: str, profile: str, size: tuple[int, int] = (1600, 1000)):
        to_chrome, self._write = os.pipe()
        self._read, from_chrome = os.pipe()

        def fds():                  # in the child: its pipe ends at fds 3 and 4, whatever numbers they had
            a, b = os.dup(to_chrome), os.dup(from_chrome)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-extensions", "--remote-debugging-pipe", f"--user-data-dir={profile}",
             f"--window-size={size[0]},{size[1]}", "about:blank"],
            pass_fds=(3, 4, to_chrome, from_chrome), preexec_fn=fds,   # 3, 4: kept after fds()
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome)
        os.close(from_chrome)
        self._buf = b""
        self._id = 0
        self.session = None

    def call(self, method: str, timeout: float = 60, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.", "Storage.")):
            msg["sessionId"] = self.session
        os.write(self._write, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buf:
                if time.monotonic() > deadline:
                    raise TimeoutError(method)
                chunk = os.read(self._read, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the pipe")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def eval(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except Exception:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._write)
        os.close(self._read)


_STATE = """(() => {
  const body = document.body ? document.body.className : '';
  const message = document.getElementById('message-text');
  return {body: body, message: message ? message.innerText : '',
          nodes: document.querySelectorAll('g.node.graph-node').length};
})()"""


def render(path: str | os.PathLike, screenshot: str | os.PathLike | None = None,
           timeout: float = 90.0) -> dict:
    """Serve ``path`` with netron on loopback, open it in headless Chromium; return what the page shows:
    ``body`` (the page state's classes: 'default' once the graph is drawn), ``message`` (an error or
    notification text) and ``nodes`` (graph nodes drawn). Optionally save a PNG of the page."""
    import netron

    exe = _browser()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    address = ("127.0.0.1", port)
    netron.serve(str(path), None, address=address, browse=False)
    profile = tempfile.mkdtemp(prefix="netron-chromium-")
    chrome = _Chromium(exe, profile)
    try:
        url = f"http://127.0.0.1:{port}/"
        # netron asks for cookie consent before it draws anything: answer it up front
        chrome.call("Storage.setCookies", cookies=[{"name": "consent", "value": str(int(time.time() * 1000)),
                                                    "url": url}])
        chrome.open(url)
        deadline = time.monotonic() + timeout
        state = {}
        while time.monotonic() < deadline:
            state = chrome.eval(_STATE) or {}
            if "default" in state.get("body", "").split() or "alert" in state.get("body", "").split():
                break
            time.sleep(0.25)
        time.sleep(0.5)                       # let the layout settle before the picture
        state = chrome.eval(_STATE) or state
        if screenshot is not None:
            png = chrome.call("Page.captureScreenshot", format="png")["data"]
            Path(screenshot).write_bytes(base64.b64decode(png))
        return state
    finally:
        chrome.close()
        netron.stop(address)
        shutil.rmtree(profile, ignore_errors=True)


def _needs_browser():
    if _browser() is None:
        pytest.skip("no Chromium on this machine")
    pytest.importorskip("netron")


@pytest.mark.parametrize("name, group", [("mlp_dynamo", False), ("cnn_dynamo", False), ("mlp_dynamo", True)])
def test_gradient_model_renders_in_netron(tmp_path, name, group):
    _needs_browser()
    gm = onnxgrad.grad(str(MODELS / f"{name}.onnx"), group=group)
    path = tmp_path / f"{name}.grad.onnx"
    onnx.save(gm, path)
    state = render(path)
    assert "default" in state["body"].split(), state          # the graph view, not an error or the welcome
    assert state["message"] == "", state
    # one drawn box per node, Constants folded into their readers aside: at least the backward nodes' count
    drawn = len([n for n in gm.graph.node if n.op_type != "Constant"])
    assert state["nodes"] >= drawn * 0.9, (state, drawn)


def test_broken_model_shows_an_error(tmp_path):
    """The check above could fail: a file Netron cannot read leaves the page without a graph."""
    _needs_browser()
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"\x08\x07" + b"\xff" * 64)
    state = render(path, timeout=30)
    assert "default" not in state["body"].split() or state["nodes"] == 0, state


if __name__ == "__main__":                     # screenshots: python tests/test_netron.py OUTDIR MODEL.onnx ...
    import sys

    for p in sys.argv[2:]:
        out = Path(sys.argv[1]) / (Path(p).name.replace(".onnx", "") + ".png")
        print(p, render(p, out), out)
