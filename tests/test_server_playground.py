"""End to end: `clover serve` in a subprocess, its playground page in headless Chromium (driven over
the DevTools protocol): a prompt is typed, Generate clicked, masked slots seen resolving block by
block, TPF and tokens/s shown, and a screenshot saved (build/e2e/playground.png, or $CLOVER_E2E_OUT).

Runs under `make e2e` (which installs Debian's chromium and websocket-client); skipped otherwise."""

import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import save_tiny_model

pytestmark = pytest.mark.skipif(not os.environ.get("CLOVER_E2E"), reason="end-to-end: run with `make e2e`")

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("CLOVER_E2E_OUT", ROOT / "build" / "e2e"))


def read_line_matching(stream, pattern, proc, timeout=120):
    deadline, seen = time.time() + timeout, []
    while time.time() < deadline:
        line = stream.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise RuntimeError(f"no line matching {pattern!r}; got:\n{''.join(seen)[-3000:]}")


class CDP:
    """A minimal DevTools-protocol client for one page."""

    def __init__(self, ws_url):
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.ids = itertools.count(1)

    def call(self, method, **params):
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expression):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JS error in {expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.js(expression):
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {expression}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("e2e-model"))
    proc = subprocess.Popen([sys.executable, "-m", "clover", "serve", "--model", folder, "--port", "0",
                             "--block-size", "8", "--threshold", "0.9", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        url = read_line_matching(proc.stdout, r"on (http://\S+)", proc).group(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        pytest.fail("no chromium on PATH (make e2e installs it)")
    profile = tempfile.mkdtemp(prefix="serve_chromium_")
    proc = subprocess.Popen([exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                             "--remote-allow-origins=*", f"--user-data-dir={profile}", "--window-size=1100,900",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ws = read_line_matching(proc.stderr, r"DevTools listening on (ws://\S+)", proc, timeout=60).group(1)
        port = re.search(r":(\d+)/", ws).group(1)
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        page = next(p for p in pages if p["type"] == "page")
        yield CDP(page["webSocketDebuggerUrl"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)


def test_playground_denoises_live(served, browser):
    cdp = browser
    cdp.call("Page.enable")
    cdp.call("Page.navigate", url=served + "/")
    cdp.wait("document.readyState === 'complete' && document.getElementById('model').textContent.includes('context')")
    # watch the output area: how many masked slots and block renders appear while it denoises
    cdp.js("""window.__seen = {masks: 0, renders: 0};
        new MutationObserver(() => {
            const m = document.querySelectorAll('#out .mask').length;
            if (document.getElementById('block')) window.__seen.renders += 1;
            window.__seen.masks = Math.max(window.__seen.masks, m);
        }).observe(document.getElementById('out'), {childList: true, subtree: true}); true""")
    cdp.js("const p = document.getElementById('prompt'); p.value = ''; p.focus(); true")
    cdp.call("Input.insertText", text="Once upon a time")
    cdp.js("document.getElementById('max_tokens').value = '96'; true")
    assert cdp.js("document.getElementById('prompt').value") == "Once upon a time"
    box = cdp.js("(() => { const r = document.getElementById('go').getBoundingClientRect(); "
                 "return [r.x + r.width / 2, r.y + r.height / 2]; })()")
    for kind in ("mousePressed", "mouseReleased"):
        cdp.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)
    cdp.wait("document.getElementById('state').textContent.startsWith('finished')", timeout=120)
    seen = cdp.js("window.__seen")
    tokens = cdp.js("document.querySelectorAll('#out .tok').length")
    steps = cdp.js("new Set([...document.querySelectorAll('#out .tok')].map(t => t.dataset.step)).size")
    tpf, tps = cdp.js("[document.getElementById('tpf').textContent, document.getElementById('tps').textContent]")
    assert seen["masks"] > 0 and seen["renders"] > 1, seen  # masked slots were on screen, blocks re-rendered
    assert tokens > 0 and steps > 1  # tokens coloured by more than one fill step
    assert float(tpf) >= 1 and float(tps) > 0
    assert cdp.js("document.getElementById('error').textContent") == ""
    OUT.mkdir(parents=True, exist_ok=True)
    shot = cdp.call("Page.captureScreenshot", format="png")
    (OUT / "playground.png").write_bytes(base64.b64decode(shot["data"]))
    assert (OUT / "playground.png").stat().st_size > 5000
