"""Headless Chromium driven over the DevTools protocol, offline: open a page, read it, screenshot it.

Chromium (Debian's ``chromium``, installed by scripts/setup.sh) starts with every
network path closed: a proxy to a closed port, host resolution mapped to nothing,
no background networking. The DevTools endpoint is Chromium's own local socket
(``--remote-debugging-port=0``: the port it chose is read from ``DevToolsActivePort``),
spoken to with aiohttp's websocket client. Every request the page makes, every
console message and every uncaught exception are recorded.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OFFLINE_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
    "--disable-default-apps", "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
    "--hide-scrollbars", "--mute-audio",
)


def chromium_binary() -> str | None:
    """The Chromium executable, if installed."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageVisit:
    """What happened while a page was open."""

    requests: list[str] = field(default_factory=list)
    console: list[tuple[str, str]] = field(default_factory=list)  # (level, text)
    exceptions: list[str] = field(default_factory=list)
    data: Any = None  # the value of the script evaluated in the page
    screenshot: bytes = b""

    @property
    def errors(self) -> list[str]:
        return [t for level, t in self.console if level in ("error", "assert")] + self.exceptions


async def _visit(ws_url: str, url: str, script: str, width: int) -> PageVisit:
    import aiohttp

    visit = PageVisit()
    ids = itertools.count(1)
    pending: dict[int, asyncio.Future] = {}
    loaded = asyncio.Event()

    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url, max_msg_size=0) as ws:
        async def reader() -> None:
            async for msg in ws:
                m = json.loads(msg.data)
                if "id" in m and m["id"] in pending:
                    pending.pop(m["id"]).set_result(m)
                    continue
                method, params = m.get("method"), m.get("params") or {}
                if method == "Network.requestWillBeSent":
                    visit.requests.append(params["request"]["url"])
                elif method == "Runtime.consoleAPICalled":
                    text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", ()))
                    visit.console.append((params.get("type", ""), text))
                elif method == "Runtime.exceptionThrown":
                    visit.exceptions.append(json.dumps(params.get("exceptionDetails", {}))[:500])
                elif method == "Log.entryAdded":
                    entry = params.get("entry", {})
                    visit.console.append((entry.get("level", ""), f"{entry.get('text')} {entry.get('url', '')}"))
                elif method == "Page.loadEventFired":
                    loaded.set()

        task = asyncio.create_task(reader())

        async def call(method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
            i = next(ids)
            fut = asyncio.get_running_loop().create_future()
            pending[i] = fut
            msg: dict[str, Any] = {"id": i, "method": method, "params": params}
            if session:
                msg["sessionId"] = session
            await ws.send_str(json.dumps(msg))
            reply = await asyncio.wait_for(fut, 60)
            if "error" in reply:
                raise RuntimeError(f"{method}: {reply['error']}")
            return reply.get("result", {})

        try:
            target = (await call("Target.createTarget", url="about:blank"))["targetId"]
            session = (await call("Target.attachToTarget", targetId=target, flatten=True))["sessionId"]
            for domain in ("Network", "Runtime", "Log", "Page"):
                await call(f"{domain}.enable", session)
            await call("Emulation.setDeviceMetricsOverride", session, width=width, height=900, deviceScaleFactor=1,
                       mobile=False)
            await call("Page.navigate", session, url=url)
            await asyncio.wait_for(loaded.wait(), 60)
            await asyncio.sleep(0.3)  # late requests or console messages, if any, arrive now
            result = await call("Runtime.evaluate", session, expression=script, returnByValue=True)
            if "exceptionDetails" in result:
                raise RuntimeError(f"the test script failed in the page: {result['exceptionDetails']}")
            visit.data = result["result"].get("value")
            metrics = await call("Page.getLayoutMetrics", session)
            size = metrics.get("cssContentSize") or metrics["contentSize"]
            shot = await call("Page.captureScreenshot", session, format="png", captureBeyondViewport=True,
                              clip={"x": 0, "y": 0, "width": width, "height": size["height"], "scale": 1})
            visit.screenshot = base64.b64decode(shot["data"])
        finally:
            task.cancel()
    return visit


def visit_page(path: Path, script: str = "null", width: int = 1200, timeout_s: float = 90) -> PageVisit:
    """Open ``path`` in headless Chromium offline, evaluate ``script`` there and take a full-page screenshot."""
    binary = chromium_binary()
    if binary is None:
        raise RuntimeError("chromium is not installed (scripts/setup.sh installs it: apt-get install chromium)")
    profile = tempfile.mkdtemp(prefix="chromium-")
    try:
        # Its own process group: the browser's helpers (renderer, crashpad) go with it, so none is left writing
        # into the profile while it is removed.
        proc = subprocess.Popen([binary, *OFFLINE_FLAGS, "--remote-debugging-port=0", f"--user-data-dir={profile}",
                                 "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + timeout_s
            while not (port_file.is_file() and len(port_file.read_text().splitlines()) >= 2):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"chromium did not open its DevTools port (exit code {proc.poll()})")
                time.sleep(0.1)
            port, ws_path = port_file.read_text().splitlines()[:2]
            ws_url = f"ws://127.0.0.1:{port}{ws_path}"
            return asyncio.run(asyncio.wait_for(_visit(ws_url, Path(path).resolve().as_uri(), script, width),
                                                timeout_s))
        finally:
            _stop_group(proc)
    finally:
        for _ in range(20):  # a helper that outlived the group's signal may still be closing a file
            shutil.rmtree(profile, ignore_errors=True)
            if not os.path.exists(profile):
                break
            time.sleep(0.1)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the browser's process group, wait up to 10 s for it, then SIGKILL what is left of the group."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
    except ProcessLookupError:
        pass
    proc.wait()
