"""Drive Debian's headless Chromium over the DevTools protocol on a pipe.

``--remote-debugging-pipe`` makes Chromium read protocol messages from fd 3 and write its
answers to fd 4, each a JSON text ended by a NUL byte: no port to pick, no websocket package.
bash moves our pipe ends onto fds 3 and 4 (``preexec_fn`` would do it in Python, but is not
safe in a process with threads, and the tests serve the API from one).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
)


class CdpError(RuntimeError):
    pass


class Chromium:
    """One browser with one page; ``with Chromium(tmp_path) as browser: browser.open(url)``."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 1000) -> None:
        assert CHROMIUM is not None
        profile.mkdir(parents=True, exist_ok=True)
        self.width, self.height = width, height
        to_browser_r, self._out = os.pipe()
        self._in, from_browser_w = os.pipe()
        self._buffer = b""
        self._ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []
        self._session: str | None = None
        script = 'exec 3<&"$BF_CDP_IN" 4>&"$BF_CDP_OUT"; exec "$@"'
        env = {**os.environ, "BF_CDP_IN": str(to_browser_r), "BF_CDP_OUT": str(from_browser_w)}
        self.process = subprocess.Popen(
            [
                "bash",
                "-c",
                script,
                "chromium",
                CHROMIUM,
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            pass_fds=(to_browser_r, from_browser_w),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the browser may be gone already
            self._send("Browser.close", {}, session=False, wait=False)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        for fd in (self._in, self._out):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- protocol

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise CdpError("Chromium did not answer in time")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise CdpError("Chromium closed the pipe")
            self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        message: dict[str, Any] = json.loads(raw)
        return message

    def _send(
        self,
        method: str,
        params: dict[str, Any],
        *,
        session: bool = True,
        wait: bool = True,
        timeout: float = 30,
    ) -> dict[str, Any]:
        ident = next(self._ids)
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        if not wait:
            return {}
        deadline = time.monotonic() + timeout
        while True:
            answer = self._read_message(deadline)
            if answer.get("id") != ident:
                self.events.append(answer)
                continue
            if "error" in answer:
                raise CdpError(f"{method}: {answer['error']}")
            result: dict[str, Any] = answer.get("result", {})
            return result

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        return self._send(method, params)

    # -- the page

    def open(self, url: str) -> None:
        deadline = time.monotonic() + 30
        target = None
        while target is None:
            infos = self._send("Target.getTargets", {}, session=False)["targetInfos"]
            target = next((t for t in infos if t["type"] == "page"), None)
            if target is None:
                if time.monotonic() > deadline:
                    raise CdpError("Chromium opened no page")
                time.sleep(0.1)
        attached = self._send(
            "Target.attachToTarget",
            {"targetId": target["targetId"], "flatten": True},
            session=False,
        )
        self._session = attached["sessionId"]
        self.send("Page.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            width=self.width,
            height=self.height,
            deviceScaleFactor=1,
            mobile=False,
        )
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def evaluate(self, expression: str) -> Any:
        answer = self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in answer:
            raise CdpError(f"{expression}: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise CdpError(f"timed out waiting for {expression}")
            time.sleep(0.05)

    def click(self, selector: str) -> None:
        """A real left click in the middle of the element, as a user's mouse makes it."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return {x: r.x + r.width / 2, y: r.y + r.height / 2}; })()"
        )
        x, y = box["x"], box["y"]
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type_into(self, selector: str, text: str) -> None:
        """Click the field, select what is there, and type over it."""
        self.click(selector)
        self.evaluate(f"document.querySelector({json.dumps(selector)}).select()")
        self.send("Input.insertText", text=text)

    def text(self, selector: str) -> str:
        value = self.evaluate(f"document.querySelector({json.dumps(selector)}).textContent")
        return str(value)

    def screenshot(self, path: Path) -> None:
        """The whole page, not only the window."""
        metrics = self.send("Page.getLayoutMetrics")
        size = metrics["cssContentSize"]
        shot = self.send(
            "Page.captureScreenshot",
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        )
        path.write_bytes(base64.b64decode(shot["data"]))
