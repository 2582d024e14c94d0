"""The demo page in headless Chromium (Debian's `chromium`, driven by playwright; no browser download):
load it, submit the pre-filled ticket, see three answers rendered, and keep a screenshot; ask why, and see the
ticket's sentences coloured by their contribution."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("CLEF_FLASH_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install -y --no-install-recommends chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def base_url(tiny_dir):
    import torch

    import clef_flash
    from clef_flash.server import create_app
    from clef_flash.testing.server import running_server

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with running_server(create_app(clef_flash.load(tiny_dir, precision="fp32"))) as url:
        yield url
    torch.set_num_threads(threads)


def test_demo_page_triages_the_prefilled_ticket(browser, base_url, tmp_path_factory):
    page = browser.new_page(viewport={"width": 1360, "height": 860})
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(base_url + "/")
    page.wait_for_selector("#model-info:has-text('ready')")
    assert page.is_visible("#random-banner")  # the tiny release has random weights, and says so
    page.click("#submit")
    page.wait_for_selector("#status:has-text('done')", timeout=30_000)

    answers = page.locator("#answers .answer")
    assert answers.count() == 3
    assert [answers.nth(i).get_attribute("data-question-id") for i in range(3)] == ["team", "urgency", "refund"]
    assert page.locator("#answers .answer[data-question-id=team] .option").count() == 4
    assert page.locator("#answers .answer[data-question-id=urgency] .option").count() == 4
    assert page.locator("#answers .answer[data-question-id=refund] .option").count() == 2
    assert int(page.inner_text("#tokens").replace(",", "")) > 100
    assert page.inner_text("#latency").endswith(" ms")
    assert not errors, errors
    assert all(url.startswith(base_url) for url in requests), requests  # nothing from the network

    out = Path(tmp_path_factory.mktemp("demo")) / "demo.png"
    page.screenshot(path=str(out), full_page=True)
    print(f"\nscreenshot: {out}")
    assert out.stat().st_size > 10_000
    if os.environ.get("CLEF_FLASH_DEMO_SCREENSHOT"):  # e.g. docs/demo.png, to refresh the README's picture
        shutil.copyfile(out, os.environ["CLEF_FLASH_DEMO_SCREENSHOT"])

    page.locator(".question .qcriteria").first.fill("billing: only one option")
    page.click("#submit")
    page.wait_for_selector("#status:has-text('error 422')")
    assert "questions.team.criteria: a choice question needs 2 to 255 options; got 1" in page.inner_text("#answers .error")
    page.close()


def test_demo_page_highlights_the_parts_by_contribution(browser, base_url, tmp_path_factory):
    page = browser.new_page(viewport={"width": 1360, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(base_url + "/")
    page.wait_for_selector("#model-info:has-text('ready')")
    ticket = page.input_value("#ticket")
    page.click("#explain")
    page.wait_for_selector("#status:has-text('explained')", timeout=30_000)

    parts = page.locator("#why-text .part")
    assert parts.count() == 4  # the subject line, two sentences of the paragraph, the signature
    assert page.inner_text("#why-text") == ticket  # the ticket as it is, its parts highlighted in place
    assert parts.nth(0).inner_text() == "Subject: Charged twice for my annual plan"
    before = [float(parts.nth(i).get_attribute("data-contribution")) for i in range(4)]
    colours = [parts.nth(i).evaluate("node => getComputedStyle(node).backgroundColor") for i in range(4)]
    strongest = max(range(4), key=lambda i: abs(before[i]))
    assert colours[strongest].startswith("rgba(46, 139, 87" if before[strongest] >= 0 else "rgba(192, 57, 43"), colours
    assert [option.inner_text() for option in page.locator("#why-question option").all()] == ["team", "urgency", "refund"]
    page.select_option("#why-question", "refund")
    after = [float(parts.nth(i).get_attribute("data-contribution")) for i in range(4)]
    assert after != before and "→" in page.inner_text("#why-decision")
    out = Path(tmp_path_factory.mktemp("demo")) / "why.png"
    page.screenshot(path=str(out), full_page=True)
    print(f"\nscreenshot: {out}")
    assert not errors, errors

    page.fill("#ticket", "One sentence only.")
    page.click("#explain")
    page.wait_for_selector("#status:has-text('error 422')")
    assert "state: the state is one part" in page.inner_text("#answers .error")
    page.close()
