"""The web console at /ui in a real headless Chromium (Debian's package, driven by Playwright) against the running
Serve app: the key is typed once and never put in a URL, a merge started from the form is followed live to
COMPLETED (timeline and events from the SSE stream, no reload), the model page shows lineage and downloads a
file, the form refuses what the API would, and an evolution started from its form runs (a real Tune search on
the session cluster) to COMPLETED while its page draws the fitness chart live. Screenshots go to
tests/e2e/artifacts/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.ray

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
TINY_EVOLUTION = Path(__file__).resolve().parents[2] / "configs" / "evolve-tiny.yaml"


@pytest.fixture(scope="module")
def browser():
    if shutil.which(CHROMIUM) is None:
        pytest.fail("chromium is not installed: `make install` installs Debian's package", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser, alloy_service):
    context = browser.new_context(
        base_url=alloy_service.base_url, accept_downloads=True, viewport={"width": 1200, "height": 800}
    )
    page = context.new_page()
    page.requested_urls = []
    page.on("request", lambda request: page.requested_urls.append(request.url))
    page.console_errors = []
    page.on("pageerror", lambda error: page.console_errors.append(str(error)))
    yield page
    context.close()


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _sign_in(page, key: str) -> None:
    page.goto("/ui")
    page.fill("#key-input", key)
    page.click("#key-entry button[type=submit]")
    page.wait_for_selector("#jobs")


def test_merge_from_the_form_followed_live_to_completed(page, alloy_service, served_models, tmp_path):
    key = alloy_service.keys["write"]
    _sign_in(page, key)
    assert page.evaluate("sessionStorage.getItem('alloy.apiKey')") == key

    page.goto("/ui/#/merge")
    page.wait_for_selector("#merge-form")
    page.select_option("#models", ["tune1", "tune2"])
    page.select_option("#strategy", "ties")
    page.select_option("#base", "base")
    page.fill("#parameters", '{"density": 0.5}')
    page.fill("#output", "ui-merged")
    _shot(page, "merge-form")
    page.click("#merge-submit")

    page.wait_for_url("**/ui/#/jobs/*")
    page.wait_for_selector("#job-state [data-state=COMPLETED]", timeout=240_000)
    page.wait_for_selector("#result-model")
    # A fast merge may be COMPLETED when the page first reads the job (state and result come from that read);
    # the timeline is the event stream's, which replays the job's events from the first: wait for its last.
    page.wait_for_selector("#timeline li.COMPLETED")
    timeline = page.locator("#timeline li").all_inner_texts()
    assert [item.split()[0] for item in timeline] == ["CREATED", "PREPARING", "RUNNING", "COMPLETED"]
    # The timeline and the event log are filled only by the event stream: the page was never reloaded.
    assert page.locator("#events div").count() >= 5
    assert page.get_attribute("#job-progress", "aria-valuenow") == "100"
    _shot(page, "job-completed")

    page.click("#result-model")
    page.wait_for_selector("#lineage a")
    assert "ui-merged" in page.inner_text("h2")
    job_id = page.url.rsplit("/", 1)[-1]
    assert page.locator("#lineage").inner_text().count("Made by job") == 1
    _shot(page, "model-page")
    with page.expect_download() as download_info:
        page.click("#files tr[data-file='config.json'] button")
    saved = tmp_path / "config.json"
    download_info.value.save_as(saved)
    assert saved.read_text().lstrip().startswith("{")

    page.goto("/ui/#/jobs")
    page.wait_for_selector("#jobs [data-state=COMPLETED]")
    _shot(page, "jobs-list")
    assert not any(key in url for url in page.requested_urls), "the API key appeared in a URL"
    assert page.console_errors == []
    assert job_id


def test_the_form_refuses_what_the_api_refuses(page, alloy_service, served_models):
    _sign_in(page, alloy_service.keys["write"])
    page.goto("/ui/#/merge")
    page.wait_for_selector("#merge-form")
    page.select_option("#models", ["tune1"])
    page.fill("#output", "ui-one")
    posts_before = sum("/merge/execute" in url for url in page.requested_urls)
    page.click("#merge-submit")
    assert "VALIDATION_FAILED" in page.inner_text("#merge-error")
    assert sum("/merge/execute" in url for url in page.requested_urls) == posts_before  # refused locally

    page.select_option("#models", ["tune1", "gpt"])  # a llama and a gpt2: only the server can tell
    page.select_option("#strategy", "slerp")
    page.fill("#parameters", '{"t": 0.5}')
    page.fill("#output", "ui-mismatch")
    page.click("#merge-submit")
    page.wait_for_function("document.querySelector('#merge-error').textContent.includes('INCOMPATIBLE_MODELS')")


def test_a_wrong_key_is_asked_again(page, alloy_service):
    page.goto("/ui")
    page.fill("#key-input", "not-a-key")
    page.click("#key-entry button[type=submit]")
    page.wait_for_function(
        "document.querySelector('#key-error') && document.querySelector('#key-error').textContent.includes('refused')"
    )


def test_console_assets_are_all_local(alloy_service):
    anonymous = alloy_service.client(None)
    for asset in ("/ui/", "/ui/app.js", "/ui/api.js", "/ui/dom.js", "/ui/style.css"):
        response = anonymous.get(asset)
        assert response.status_code == 200, asset
        assert "http://" not in response.text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in response.text
    assert anonymous.get("/ui", follow_redirects=False).status_code in (302, 307)


def test_evolution_page_draws_fitness_live(page, alloy_service):
    """An evolution's page as its search writes generations: the job and its trials are written to the service's
    own database the way the EvolutionEngine writes them (JobStore progress, tracker trials); no Tune run is
    needed to see the page follow them."""
    from datetime import datetime, timezone

    from alloy.jobs.store import JobStore
    from alloy.storage.db import Database
    from alloy.storage.tracker import ExperimentTracker
    from evolution.engine import EXPERIMENT_KIND, experiment_id_for

    db = Database(alloy_service.database_url)
    jobs, tracker = JobStore(db), ExperimentTracker(db)
    job = jobs.create("evolution", {"search": {"generations": 3, "population": 2}})
    experiment = tracker.create_experiment("ui evolution", EXPERIMENT_KIND, experiment_id=experiment_id_for(job.id))

    def generation(number: int, *fitness: float) -> None:
        for index, value in enumerate(fitness):
            tracker.record_trial(experiment, f"t{number}-{index}", number, {"weight": value}, {}, {"fitness": value})
        tracker.flush()
        jobs.update_progress(
            job.id,
            generation=number,
            best_fitness=max(fitness),
            median_fitness=sum(fitness) / 2,
            heartbeat_at=datetime.now(timezone.utc).isoformat(),
        )

    try:
        jobs.transition(job.id, "PREPARING")
        jobs.transition(job.id, "RUNNING")
        generation(0, 0.1, 0.3)
        generation(1, 0.2, 0.5)
        _sign_in(page, alloy_service.keys["read"])
        page.goto(f"/ui/#/evolutions/{job.id}")
        page.wait_for_selector("#fitness-chart polyline.best")
        assert len(page.get_attribute("#fitness-chart polyline.best", "points").split()) == 2
        assert page.locator("#trials tr").count() == 1 + 4

        generation(2, 0.6, 0.4)  # the page follows without a reload
        page.wait_for_function(
            "document.querySelector('#fitness-chart polyline.best')"
            ".getAttribute('points').trim().split(' ').length === 3"
        )
        assert page.locator("#trials tr").count() == 1 + 6
        _shot(page, "evolution")
        jobs.complete(job.id, {"best_trial": "t2-0"})
        page.wait_for_selector("main [data-state=COMPLETED]")
    finally:
        db.close()


def test_an_evolution_started_from_the_form_is_followed_live_to_completed(page, alloy_service):
    """A real evolution (the CI config: 3 trials x 3 generations on the tiny preset) submitted from the console's
    form; the page is never reloaded, so every new point of the chart comes from the event stream."""
    request = yaml.safe_load(TINY_EVOLUTION.read_text())
    request["name"] = "console evolution"
    _sign_in(page, alloy_service.keys["write"])
    page.goto("/ui/#/evolve")
    page.wait_for_selector("#evolution-form")
    page.fill("#evolution-request", "{not json")
    page.click("#evolution-submit")
    assert "VALIDATION_FAILED" in page.inner_text("#evolution-error")
    page.fill("#evolution-request", json.dumps({**request, "search": {**request["search"], "kind": "nonsense"}}))
    page.click("#evolution-submit")
    page.wait_for_function("document.querySelector('#evolution-error').textContent.includes('VALIDATION_FAILED')")

    page.fill("#evolution-request", json.dumps(request, indent=2))
    _shot(page, "evolution-form")
    page.click("#evolution-submit")
    page.wait_for_url("**/ui/#/evolutions/*")
    page.wait_for_selector("#fitness-chart")
    # Record every size the chart takes while the search runs (a MutationObserver in the page itself).
    page.evaluate(
        """() => {
          window.chartSizes = [];
          const box = document.querySelector('#fitness-chart');
          const size = () => {
            const line = box.querySelector('polyline.best');
            return line ? line.getAttribute('points').trim().split(' ').filter(Boolean).length : 0;
          };
          new MutationObserver(() => window.chartSizes.push(size())).observe(box, { childList: true, subtree: true });
        }"""
    )
    page.wait_for_selector("main [data-state=COMPLETED]", timeout=300_000)
    page.wait_for_selector("#evolution-result #result-model")
    sizes = page.evaluate("window.chartSizes")
    assert max(sizes) == request["search"]["generations"], sizes  # one point per generation, best and median
    assert len({size for size in sizes if size}) >= 2, f"the chart did not grow live: {sizes}"
    assert page.locator("#trials tr").count() == 1 + request["search"]["population"] * request["search"]["generations"]
    _shot(page, "evolution-completed")
    page.click("#evolution-result #result-model")
    page.wait_for_selector("#lineage")
    assert page.console_errors == []


@pytest.mark.parametrize(
    "path, rendered", [("/docs", ".swagger-ui .opblock"), ("/redoc", "[data-section-id^='operation/']")]
)
def test_api_docs_render_in_the_browser_with_the_network_cut(browser, alloy_service, path, rendered):
    """Every request that leaves this server is aborted (as on an offline GPU cluster): the pages still render the
    whole API from the packaged assets."""
    context = browser.new_context(base_url=alloy_service.base_url, viewport={"width": 1200, "height": 800})
    outside: list[str] = []

    def only_this_server(route):
        if route.request.url.startswith(alloy_service.base_url):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    context.route("**/*", only_this_server)
    try:
        page = context.new_page()
        page.goto(path)
        page.wait_for_selector(rendered, timeout=60_000)
        assert page.locator(rendered).count() >= 10  # the operations (or their sections) are all drawn
        _shot(page, f"api-docs{path.replace('/', '-')}")
    finally:
        context.close()
    assert outside == [], outside
