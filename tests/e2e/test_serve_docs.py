"""/docs and /redoc through the Serve proxy work offline: every URL in the pages is on this server, and the
assets they load are served (without a key, like the pages) from the package."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.ray

URL_ATTRIBUTE = re.compile(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)['"]""")


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_doc_pages_reference_no_external_host_and_their_assets_load(alloy_service, page):
    anonymous = alloy_service.client(None)
    response = anonymous.get(page)
    assert response.status_code == 200 and "text/html" in response.headers["content-type"]
    assert not re.search(r"https?://", response.text), "the page names an external host"
    urls = URL_ATTRIBUTE.findall(response.text)
    assets = [u for u in urls if u.startswith("/static/")]
    assert assets, urls
    for url in [*assets, "/openapi.json"]:
        assert anonymous.get(url).status_code == 200, url


def test_static_folder_is_public_but_nothing_else_became_public(alloy_service):
    anonymous = alloy_service.client(None)
    assert anonymous.get("/static/VERSIONS").status_code == 200
    assert anonymous.get("/static/../jobs").status_code in (401, 404)
    assert anonymous.get("/jobs").status_code == 401
    assert anonymous.get("/static/nope.js").status_code == 404
