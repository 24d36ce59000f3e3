"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) served from assets shipped in the package (``serve_app/static``,
vendored from the npm packages swagger-ui-dist and redoc; see static/VERSIONS), so the API description works
on a machine without internet. FastAPI's own pages load both from a CDN and a favicon from its website."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_PREFIX = "/static"
DOCS_PATH, REDOC_PATH, OAUTH2_REDIRECT_PATH = "/docs", "/redoc", "/docs/oauth2-redirect"
# Public without a key: the pages and their assets (the API description is public; the data is not).
PUBLIC_PATHS = (DOCS_PATH, REDOC_PATH, OAUTH2_REDIRECT_PATH, f"{STATIC_PREFIX}/*")
FAVICON = f"{STATIC_PREFIX}/swagger-ui/favicon-32x32.png"
# The pages may load only from this server: ReDoc's bundle, for one, fetches its "by Redocly" logo from a CDN,
# which an offline browser would wait on and an online one would leak the visit to. Inline scripts and styles are
# how FastAPI's page templates and both bundles start; workers and images may be blobs or data URLs.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; worker-src 'self' blob:; connect-src 'self'; font-src 'self' data:"
)


def _self_only(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    return page


def install_offline_docs(app: FastAPI) -> None:
    """Call on an app created with ``docs_url=None, redoc_url=None``."""
    openapi_url = app.openapi_url or "/openapi.json"
    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="static")

    @app.get(DOCS_PATH, include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return _self_only(
            get_swagger_ui_html(
                openapi_url=openapi_url,
                title=f"{app.title} - Swagger UI",
                oauth2_redirect_url=OAUTH2_REDIRECT_PATH,
                swagger_js_url=f"{STATIC_PREFIX}/swagger-ui/swagger-ui-bundle.js",
                swagger_css_url=f"{STATIC_PREFIX}/swagger-ui/swagger-ui.css",
                swagger_favicon_url=FAVICON,
                # validatorUrl None: Swagger UI would otherwise send the document to an online validator.
                swagger_ui_parameters={"validatorUrl": None},
            )
        )

    @app.get(OAUTH2_REDIRECT_PATH, include_in_schema=False)
    def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC_PATH, include_in_schema=False)
    def redoc() -> HTMLResponse:
        return _self_only(
            get_redoc_html(
                openapi_url=openapi_url,
                title=f"{app.title} - ReDoc",
                redoc_js_url=f"{STATIC_PREFIX}/redoc/redoc.standalone.js",
                redoc_favicon_url=FAVICON,
                with_google_fonts=False,
            )
        )
