"""Open the built documentation site in headless Chromium, as a reader would.

    python tools/check_site_in_browser.py [SITE_DIR]      # default: site/ (mkdocs build)

Serves SITE_DIR on a free localhost port, starts Debian's ``chromium`` headless with its
DevTools port, and drives it over the DevTools protocol (a minimal WebSocket client: the
standard library has none, and this check needs no other package). It checks that the
index opens, that following a link from it lands on that page, that the API page shows
``Loop.fit``'s signature, and that the site's search finds "Checkpoint" (the search runs
in a web worker, so its results are waited for, up to a deadline). Any failure exits 1
with what was seen; Chromium's absence exits 2.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

DEADLINE_S = 60.0


#: What DevTools answers an evaluation that met a navigation (the page's context replaced):
#: a poll asks again.
_NAVIGATING = ("navigated or closed", "Execution context was destroyed",
               "Cannot find context with specified id")


class Failure(Exception):
    """A check of the site failed: the message says what was expected and what was seen."""


class DevTools:
    """One page of the browser, driven over its DevTools WebSocket."""

    def __init__(self, url: str) -> None:
        rest = url.split("://", 1)[1]
        address, path = rest.split("/", 1)
        host, port = address.split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=DEADLINE_S)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /{path} HTTP/1.1\r\nHost: {address}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += self.sock.recv(4096)
        if b" 101 " not in answer.split(b"\r\n", 1)[0]:
            raise Failure(f"DevTools refused the WebSocket: {answer[:200]!r}")
        self.buffer, self.next_id = answer.split(b"\r\n\r\n", 1)[1], 0

    def _send(self, text: str) -> None:
        payload, mask = text.encode(), os.urandom(4)
        size = len(payload)
        head = bytes([0x81]) + (bytes([0x80 | size]) if size < 126 else
                                bytes([0x80 | 126]) + struct.pack(">H", size) if size < 65536
                                else bytes([0x80 | 127]) + struct.pack(">Q", size))
        masked = bytes(byte ^ mask[index % 4] for index, byte in enumerate(payload))
        self.sock.sendall(head + mask + masked)

    def _read(self, count: int) -> bytes:
        while len(self.buffer) < count:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise Failure("the browser closed the DevTools connection")
            self.buffer += chunk
        data, self.buffer = self.buffer[:count], self.buffer[count:]
        return data

    def _receive(self) -> str:
        message = b""
        while True:
            first, second = self._read(2)
            size = second & 0x7F
            if size == 126:
                size = struct.unpack(">H", self._read(2))[0]
            elif size == 127:
                size = struct.unpack(">Q", self._read(8))[0]
            message += self._read(size)
            if first & 0x80:  # the final fragment
                return message.decode()

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self._send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self._receive())
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise Failure(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, what: str) -> Any:
        """Poll ``expression`` until it is truthy; fail saying ``what`` never happened."""
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except Failure as failure:  # asked while the page navigates: its context went
                if not any(text in str(failure) for text in _NAVIGATING):
                    raise
                value = None
            if value:
                return value
            time.sleep(0.2)
        where = self.evaluate("location.href")
        raise Failure(f"{what}: not within {DEADLINE_S:.0f} s (page {where})")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for(f"location.href === {json.dumps(url)} && document.readyState === 'complete'",
                      f"the page {url} loading")


def _serve(directory: Path) -> tuple[http.server.ThreadingHTTPServer, int]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
            pass  # a line per request would bury the check's own lines

    handler = functools.partial(Quiet, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def _browser(profile: str) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        print("check_site_in_browser: no chromium on PATH (Debian: apt-get install chromium)",
              file=sys.stderr)
        sys.exit(2)
    process = subprocess.Popen(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-port=0",
         "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)  # its helper processes go with it (`_stop`)
    try:
        return process, _page_url(process, profile)
    except BaseException:
        _stop(process)
        raise


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End chromium and every process it started, whatever state it is in."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _page_url(process: subprocess.Popen[bytes], profile: str) -> str:
    port_file = Path(profile) / "DevToolsActivePort"
    deadline = time.monotonic() + DEADLINE_S
    while not port_file.exists() or not port_file.read_text().strip():
        if process.poll() is not None or time.monotonic() > deadline:
            raise Failure(f"chromium did not start its DevTools port (status {process.poll()})")
        time.sleep(0.1)
    port = port_file.read_text().split()[0]
    targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list",
                                                timeout=DEADLINE_S).read())
    page = next(target for target in targets if target.get("type") == "page")
    return str(page["webSocketDebuggerUrl"])


def check(site: Path) -> list[str]:
    """Run every check on the built site; return what each found."""
    server, port = _serve(site)
    base = f"http://127.0.0.1:{port}"
    found: list[str] = []
    with tempfile.TemporaryDirectory() as profile:
        process, url = _browser(profile)
        try:
            page = DevTools(url)
            page.call("Runtime.enable")
            page.open(f"{base}/index.html")
            title = page.evaluate("document.querySelector('h1').innerText")
            if "hookloop" not in (title or ""):
                raise Failure(f"the index's heading is {title!r}, not hookloop's")
            found.append(f"index: {title!r}")
            # Follow a link of the index's text, as a reader clicks it.
            link = "document.querySelector('article a[href=\"concepts.html\"]')"
            href = page.evaluate(f"{link}.href")
            # Clicked once this evaluation has returned: a click inside it navigates away
            # from the context DevTools answers from.
            page.evaluate(f"setTimeout(() => {link}.click(), 50); true")
            page.wait_for("location.pathname.endsWith('/concepts.html') && "
                          "document.readyState === 'complete'", f"following the link {href}")
            heading = page.evaluate("document.querySelector('h1').innerText")
            if "Concepts" not in (heading or ""):
                raise Failure(f"the link {href} opened a page headed {heading!r}")
            found.append(f"followed {href}: {heading!r}")
            page.open(f"{base}/api/hookloop.html")
            signature = page.evaluate(
                "(() => { const h = document.getElementById('hookloop.Loop.fit'); "
                "return h && h.parentElement.innerText; })()") or ""
            # Whitespace aside: mkdocstrings lays a signature out with black or ruff when
            # either is installed, one parameter a line.
            flat = "".join(signature.split())
            if "fit(epochs:int" not in flat or "max_steps" not in flat:
                raise Failure(f"Loop.fit's signature not on its API page: {signature[:300]!r}")
            found.append("Loop.fit: " + next(line for line in signature.splitlines()
                                              if line.startswith("fit(")))
            page.open(f"{base}/index.html?q=Checkpoint")
            titles = page.wait_for(
                "(() => { const items = [...document.querySelectorAll("
                "'.md-search-result__item')].map(item => item.innerText); "
                "return items.some(text => text.includes('Checkpoint')) && items; })()",
                "a search result for 'Checkpoint'")
            found.append(f"search 'Checkpoint': {len(titles)} results, the first "
                         f"{titles[0].splitlines()[0]!r}")
        finally:
            _stop(process)
            server.shutdown()
    return found


def main(argv: list[str]) -> int:
    site = Path(argv[0] if argv else "site")
    if not (site / "index.html").is_file():
        print(f"check_site_in_browser: no {site}/index.html: run mkdocs build first",
              file=sys.stderr)
        return 1
    try:
        for line in check(site):
            print(f"check_site_in_browser: {line}")
    except (Failure, OSError) as failure:  # OSError: a socket's timeout, a refused port
        print(f"check_site_in_browser: FAILED: {failure!r}", file=sys.stderr)
        return 1
    print("check_site_in_browser: every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
