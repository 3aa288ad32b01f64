"""``/dashboard/``: the web dashboard, static files shipped in the package (no build step).

The page asks for a tenant's API key and calls the JSON API with it from the browser; the
server hands out only files, so no key or session is ever kept here.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
)
"""Sent with every dashboard file: its own scripts and styles only, no framing (a page that
holds an API key in memory), no content-type sniffing, no referrer to other sites."""


class SecurityHeaders:
    """ASGI wrapper adding :data:`SECURITY_HEADERS` to every answer of ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *SECURITY_HEADERS]}
            await send(message)

        await self.app(scope, receive, sending)


def mount(app: FastAPI) -> None:
    app.mount(
        "/dashboard",
        SecurityHeaders(StaticFiles(packages=[("queue_api", "dashboard")], html=True)),
        name="dashboard",
    )

    @app.get("/", include_in_schema=False)
    def home() -> RedirectResponse:
        return RedirectResponse("/dashboard/")
