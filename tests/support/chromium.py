"""Debian's Chromium (`apt-get install chromium`, /usr/bin/chromium), headless, driven over the DevTools protocol
with aiohttp's websocket client (a [dev] dependency): the tests' way to open a page from disk, read its DOM, record
every request it makes and take a screenshot. No browser is downloaded; a machine without /usr/bin/chromium
fails the test that needs it, saying how to install it (.ci/run does).

    with Chromium(profile_dir) as browser:
        browser.open(path.as_uri())
        browser.evaluate("document.title")
        browser.requests          # every URL the page asked for (Network.requestWillBeSent)
        browser.screenshot(png_path)

Flags: headless as root needs --no-sandbox; the background-networking, component-update and sync switches keep the
browser itself from reaching out (the closed network refuses it, and none of it is the page's), and a new empty
--user-data-dir per browser keeps earlier state out.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

BINARY = Path("/usr/bin/chromium")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--hide-scrollbars", "--mute-audio")
_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


class Chromium:
    def __init__(self, profile: Path, width: int = 1400, height: int = 1000, timeout_s: float = 60.0) -> None:
        if not BINARY.is_file():
            raise FileNotFoundError(f"{BINARY} is missing: apt-get install -y chromium (Debian's package; .ci/run "
                                    "installs it before make test)")
        profile.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.process = subprocess.Popen(
            [str(BINARY), *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.events: list[dict[str, Any]] = []
        self.requests: list[str] = []
        self._next = 0
        browser_url = self._listening()
        # the rest of its stderr is drained, so that the browser never blocks on a full pipe
        threading.Thread(target=self._drain, daemon=True).start()
        self.loop = asyncio.new_event_loop()
        port = browser_url.split(":")[2].split("/")[0]
        self.session = self.loop.run_until_complete(self._session())
        self.socket = self.loop.run_until_complete(self._page_socket(port))

    def _listening(self) -> str:
        assert self.process.stderr is not None
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line and self.process.poll() is not None:
                break
            self.log.append(line)
            found = _LISTENING.search(line)
            if found:
                return found.group(1)
        self.process.kill()
        raise RuntimeError("chromium did not open its DevTools port:\n" + "".join(self.log[-20:]))

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)

    async def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    async def _page_socket(self, port: str) -> aiohttp.ClientWebSocketResponse:
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t.get("type") == "page")
        return await self.session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)

    # ----------------------------------------------------------------------------------- the protocol
    async def _receive(self) -> dict[str, Any]:
        message = await asyncio.wait_for(self.socket.receive(), self.timeout_s)
        if message.type != aiohttp.WSMsgType.TEXT:
            raise RuntimeError(f"DevTools socket closed ({message.type})")
        data = json.loads(message.data)
        if "method" in data:
            self.events.append(data)
            if data["method"] == "Network.requestWillBeSent":
                self.requests.append(data["params"]["request"]["url"])
        return data

    async def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self._next += 1
        ident = self._next
        await self.socket.send_str(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            data = await self._receive()
            if data.get("id") == ident:
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                return data.get("result", {})

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        return self.loop.run_until_complete(self._call(method, params))

    def wait_for(self, event: str) -> dict[str, Any]:
        """The first `event` received (an earlier one counts)."""
        async def wait() -> dict[str, Any]:
            while True:
                found = next((e for e in self.events if e["method"] == event), None)
                if found is not None:
                    return found
                await self._receive()

        return self.loop.run_until_complete(wait())

    # ------------------------------------------------------------------------------------ what tests do
    def open(self, url: str) -> None:
        """Load `url` with every request recorded (Network domain on before the navigation) and scripts' errors
        kept (Runtime.exceptionThrown), until its load event."""
        self.call("Network.enable")
        self.call("Runtime.enable")
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    @property
    def script_errors(self) -> list[dict[str, Any]]:
        return [e["params"] for e in self.events if e["method"] == "Runtime.exceptionThrown"]

    def screenshot(self, path: Path, height: int | None = None) -> Path:
        """A PNG of the page from its top, `height` CSS pixels tall (default the whole page)."""
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], height or size["height"]),
                "scale": 1}
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip=clip)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self._call("Browser.close", {}))
        except (RuntimeError, asyncio.TimeoutError, aiohttp.ClientError):
            pass  # the browser closing its socket as it answers is what is asked for
        self.loop.run_until_complete(self.socket.close())
        self.loop.run_until_complete(self.session.close())
        self.loop.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
