"""The chat page at / in a real headless Chromium (Debian's `chromium`, driven by Playwright): it
lists the models, streams an answer token by token, stops one on request, keeps the conversation
across a reload, sends the API key, and renders code blocks (docs/images/chat-page.png is this test's
screenshot, written where EDGELLM_SCREENSHOTS names a folder)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KEY = "s3cret"

if CHROMIUM is None:  # like the NEON tests' qemu: installed by make (make browser) where apt can
    pytest.skip("no chromium here (make browser installs it where apt can)", allow_module_level=True)

playwright = pytest.importorskip("playwright.sync_api")


@pytest.fixture
def browser():
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def test_the_page_is_served_whole_and_offline(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for name in ("app.js", "style.css"):
        assert httpx.get(server.url + f"/ui/{name}").status_code == 200
    assert httpx.get(server.url + "/ui/../app.py").status_code == 404
    text = page.text + httpx.get(server.url + "/ui/app.js").text
    assert "http://" not in text.replace("http://127.0.0.1", "") and "https://" not in text  # nothing from a CDN


def test_chat_streams_stops_and_survives_a_reload(server_factory, browser, tmp_path):
    server = server_factory(api_key=KEY, max_batch=1, timeout_s=120)
    page = browser.new_page(viewport={"width": 900, "height": 700})
    page.goto(server.url + "/")
    page.fill("#key", KEY)
    page.dispatch_event("#key", "change")
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    assert page.eval_on_selector("#model", "s => s.value") == "smollm2-135m"
    page.fill("#temperature", "0")
    page.dispatch_event("#temperature", "change")

    page.fill("#prompt", "What is the capital of France?")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('#speed').textContent.includes('tok/s')", timeout=60_000)
    answers = page.locator(".message.assistant")
    assert "Paris" in answers.last.inner_text()
    assert "TTFT" in page.inner_text("#speed")

    # a long answer, watched as it grows, then stopped
    page.fill("#prompt", "Write a long story about a lighthouse keeper, with many details.")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.message.assistant')[1]?.textContent.length > 20",
                           timeout=60_000)
    early = answers.nth(1).inner_text()
    page.wait_for_function(f"document.querySelectorAll('.message.assistant')[1].textContent.length > {len(early) + 20}",
                           timeout=60_000)
    page.click("#stop")
    page.wait_for_function("document.querySelector('#send').disabled === false")
    stopped = answers.nth(1).inner_text()
    page.wait_for_timeout(500)
    assert answers.nth(1).inner_text() == stopped and len(stopped) > len(early)  # streamed, then no more
    assert "stopped" in page.inner_text("#speed")
    assert not httpx.get(server.url + "/health").json()["busy"]  # the server dropped the stopped request

    # a code block renders as one
    page.fill("#prompt", "Show a Python hello world program in a code block.")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelectorAll('.message.assistant').length === 3 && "
                           "document.querySelector('#send').disabled === false", timeout=60_000)
    shot = Path(os.environ.get("EDGELLM_SCREENSHOTS", tmp_path)) / "chat-page.png"
    page.screenshot(path=str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert page.locator(".message.assistant pre code").count() >= 1  # the code block, rendered as one

    page.reload()
    page.wait_for_function("document.querySelectorAll('.message').length === 6")
    assert "Paris" in page.locator(".message.assistant").first.inner_text()
    page.click("#clear")
    assert page.locator(".message").count() == 0


def test_a_wrong_key_shows_the_error(server_factory, browser):
    server = server_factory(api_key=KEY)
    page = browser.new_page()
    page.goto(server.url + "/")
    page.fill("#key", "wrong")
    page.dispatch_event("#key", "change")
    page.wait_for_function("document.querySelector('#speed').textContent.includes('invalid API key')")


def test_json_mode_answers_json(server_factory, browser):
    import json

    server = server_factory(timeout_s=120)
    page = browser.new_page()
    page.goto(server.url + "/")
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    page.fill("#temperature", "0")
    page.check("#json")
    page.fill("#prompt", "Describe Paris as JSON with keys name and country.")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('#speed').textContent.includes('tok/s')", timeout=60_000)
    assert isinstance(json.loads(page.locator(".message.assistant").last.inner_text()), dict)
