"""``/dashboard/``: the web dashboard, static files shipped in the package (no build step).

The page asks for a tenant's API key and calls the JSON API with it from the browser; the
server hands out only files, so no key or session is ever kept here.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from starlette.staticfiles import StaticFiles


def mount(app: FastAPI) -> None:
    app.mount(
        "/dashboard",
        StaticFiles(packages=[("queue_api", "dashboard")], html=True),
        name="dashboard",
    )

    @app.get("/", include_in_schema=False)
    def home() -> RedirectResponse:
        return RedirectResponse("/dashboard/")
