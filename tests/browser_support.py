"""A real browser for the tests: Debian's Chromium driven by Playwright, pages served from the repository on
localhost (WebGPU needs a secure context), onnxruntime-web from js/node_modules. :func:`missing` says in one line
what is not installed, for a clean skip."""
from __future__ import annotations

import functools
import http.server
import re
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "js" / "node_modules" / "onnxruntime-web" / "dist"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# the onnxruntime-web bundles a page imports, and the provider each one trains on
CONFIGS = {
    "wasm": ("ort.wasm.min.mjs", "wasm"),
    "jsep": ("ort.all.min.mjs", "webgpu"),          # WebGPU through JSEP, the JavaScript kernels
    "webgpu": ("ort.webgpu.min.mjs", "webgpu"),     # the native WebGPU provider
}
ARGS = ["--enable-unsafe-webgpu"]                   # headless WebGPU: SwiftShader's software adapter here


def missing() -> str | None:
    """What keeps the browser tests from running here (None: nothing)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "no playwright (pip install playwright)"
    if not Path(CHROMIUM).exists():
        return "no chromium (apt-get install chromium)"
    if not DIST.is_dir():
        return "no onnxruntime-web (cd js && npm ci)"
    return None


class _Handler(http.server.SimpleHTTPRequestHandler):
    fixtures: Path | None = None

    def translate_path(self, path: str) -> str:
        if self.fixtures is not None and path.startswith("/fx/"):
            return str(self.fixtures / path[4:].split("?")[0])
        return super().translate_path(path)

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, *args) -> None:
        pass


@contextmanager
def served(fixtures: Path | None = None) -> Iterator[str]:
    """The repository (and ``fixtures`` under /fx/) on a localhost port: yields the base URL."""
    handler = type("Handler", (_Handler,), {"fixtures": fixtures})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(ROOT)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def chromium() -> Iterator:
    """A headless Chromium (Playwright driving Debian's binary; no browser download)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


def adapter(page) -> str:
    """The WebGPU adapter the page gets, in words."""
    return page.evaluate("""async () => {
        const a = navigator.gpu && await navigator.gpu.requestAdapter();
        if (!a) return 'none';
        const i = a.info || {};
        return [i.vendor, i.architecture, i.description].filter(Boolean).join(' ');
    }""")


_PLACED = re.compile(r"(?:All nodes placed on|Node\(s\) placed on) \[(\w+)\]\. Number of nodes: (\d+)")


def placed(lines: list[str]) -> dict[str, int]:
    """Nodes per execution provider, from onnxruntime's verbose session log."""
    out: dict[str, int] = {}
    for line in lines:
        for ep, n in _PLACED.findall(line):
            out[ep] = out.get(ep, 0) + int(n)
    return out
