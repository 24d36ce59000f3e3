"""The web console at ``/ui``: plain HTML, CSS and JavaScript modules shipped in the package (``serve_app/ui``),
no build step and no CDN. The pages are public like /docs; every API call they make carries the key the user
typed, which the page keeps in sessionStorage and sends as an Authorization header, never in a URL."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

UI_DIR = Path(__file__).resolve().parent / "ui"
UI_PREFIX = "/ui"
PUBLIC_PATHS = (UI_PREFIX, f"{UI_PREFIX}/*")


def install_console(app: FastAPI) -> None:
    @app.get(UI_PREFIX, include_in_schema=False)
    def console_root() -> RedirectResponse:
        # Relative module imports in index.html resolve against the folder, so the page lives at /ui/.
        return RedirectResponse(f"{UI_PREFIX}/")

    app.mount(UI_PREFIX, StaticFiles(directory=UI_DIR, html=True), name="console")
