"""/docs (Swagger UI) and /redoc (ReDoc) render the API in headless Chromium with no network beyond
the gateway: every request the pages make to another host is refused, and none is attempted."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from test_playground import browser  # noqa: F401 - the module-scoped fixture

pytestmark = pytest.mark.e2e

RENDER_TIMEOUT_MS = 60_000


@pytest.fixture
def offline_page(browser, stack):  # noqa: F811 - the fixture imported above
    """A page that may reach the stack's gateway and nothing else; `offline_page.elsewhere` lists
    every request that tried."""
    gateway = urlsplit(stack.http_url).netloc
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    page = context.new_page()
    elsewhere: list[str] = []
    errors: list[str] = []

    def route(r) -> None:
        if urlsplit(r.request.url).netloc == gateway:
            r.continue_()
        else:
            elsewhere.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.elsewhere, page.errors = elsewhere, errors
    yield page
    context.close()


def test_swagger_ui_renders_every_operation_offline(offline_page, stack):
    page = offline_page
    page.goto(f"{stack.http_url}/docs")
    page.wait_for_selector(".opblock-summary-path", timeout=RENDER_TIMEOUT_MS)
    paths = set(page.locator(".opblock-summary-path").all_inner_texts())
    paths = {p.replace("\u200b", "").strip() for p in paths}
    assert {"/v1/audio/speech", "/v1/audio/voices", "/v1/models", "/readyz"} <= paths, paths
    # An operation opens and shows its request body schema (the typed SpeechRequest).
    page.locator(".opblock-post .opblock-summary-path", has_text="/v1/audio/speech").first.click()
    page.wait_for_selector(".opblock.is-open .opblock-section-request-body", timeout=RENDER_TIMEOUT_MS)
    assert page.elsewhere == [], page.elsewhere
    assert page.errors == [], page.errors


def test_redoc_renders_every_operation_offline(offline_page, stack):
    page = offline_page
    page.goto(f"{stack.http_url}/redoc")
    page.wait_for_selector("[data-section-id^='operation/']", state="attached", timeout=RENDER_TIMEOUT_MS)
    text = page.locator(".api-content").inner_text()
    assert "/v1/audio/speech" in text and "/v1/audio/voices" in text, text[:500]
    assert page.locator("[data-section-id^='operation/']").count() >= 10
    assert page.elsewhere == [], page.elsewhere
    assert page.errors == [], page.errors
