"""The dashboard in a real browser: headless Debian chromium, driven by Playwright, against a
real `batchmlx serve` (tiny random model, API key). Skips only where no Chromium is installed.

BATCHMLX_DASHBOARD_SCREENSHOT=path.png saves a screenshot of the page during the run (the one
in the README was taken so).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import chat_body, request_line
from tests.server.helpers import jsonl, start_server, wait_batch

KEY = "sk-browser-test-key"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
# root in CI: no sandbox; containers: no GPU, a small /dev/shm
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
LONG_S = 240_000  # ms: the longest any one wait may take on a loaded machine


def chromium() -> str:
    for name in (os.environ.get("BATCHMLX_CHROMIUM"), *CHROMIUM_NAMES):
        if name and (path := shutil.which(name)):
            return path
    pytest.skip("no Chromium installed (Debian: apt-get install chromium; .ci/run installs it)")


def browser_env() -> dict[str, str]:
    """This process's environment without the BLAS preload the suite re-executes with
    (engine/host/fast_blas.py): a preloaded OpenBLAS crashes Chromium's GPU process at start."""
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    s = start_server(tmp_path_factory.mktemp("browser"), "--model", str(tiny_model_dir),
                     "--max-batch-size", "8", api_key=KEY)  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def page(server):
    executable = chromium()
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS,
                                    env=browser_env())  # fmt: skip
        page = browser.new_page(viewport={"width": 1280, "height": 760}, accept_downloads=True)
        yield page
        browser.close()


def submit(client, lines: list[dict]) -> str:
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id  # fmt: skip


def small_batch() -> list[dict]:
    lines = [request_line(f"ok{i}", chat_body(f"Say {i}.", max_tokens=24)) for i in range(12)]
    return [*lines, request_line("too-hot", chat_body("hi", max_tokens=4, temperature=5))]


def long_batch(n: int = 400) -> list[dict]:
    # far more work than the test lets run: it can only end by being cancelled
    return [request_line(f"long{i}", chat_body(f"Tell a long story, part {i}.", max_tokens=1500))
            for i in range(n)]  # fmt: skip


def test_dashboard_follows_downloads_and_cancels(server, page, record_property):
    from playwright.sync_api import expect

    client = server.client()
    base = f"http://127.0.0.1:{server.port}/"
    page.goto(base)
    # the key is asked for once, kept in the tab, sent as a bearer token
    expect(page.locator("#key-form")).to_be_visible()
    page.fill("#key-input", KEY)
    page.click("#key-form button")
    expect(page.locator("#overview")).to_be_visible()
    expect(page.locator("#tile-worker")).to_have_text("running")

    # a small batch submitted through the API: the page follows it to 100% and `completed`
    small = submit(client, small_batch())
    row = page.locator(f'tr[data-batch-id="{small}"]')
    expect(row).to_be_visible(timeout=LONG_S)
    expect(row.locator(".status")).to_have_text("completed", timeout=LONG_S)
    expect(row.locator("[role=progressbar]")).to_have_attribute("aria-valuenow", "100")
    expect(row.locator(".counts")).to_have_text("12 / 1 / 13")
    batch = client.batches.retrieve(small)
    out_tokens = f"{batch.usage.input_tokens:,} / {batch.usage.output_tokens:,}"
    expect(row.locator(".tokens")).to_have_text(out_tokens)

    # its own page: timeline, the failed line, downloads of both files
    row.locator(".id").click()
    expect(page.locator("#detail")).to_be_visible()
    expect(page.locator("#detail-status")).to_have_text("completed")
    expect(page.locator("#detail-bar")).to_have_attribute("aria-valuenow", "100")
    steps = page.locator("#timeline li")
    expect(steps).to_have_count(4)
    expect(page.locator("#timeline li.reached")).to_have_count(4)
    expect(steps.nth(3)).to_contain_text("completed")
    expect(page.locator("#errors li")).to_have_count(1)
    expect(page.locator("#errors li")).to_contain_text("too-hot: 400")
    for button, file_id in (("#download-output", batch.output_file_id),
                            ("#download-errors", batch.error_file_id)):  # fmt: skip
        with page.expect_download() as info:
            page.click(button)
        download = info.value
        assert download.suggested_filename.startswith(small)
        assert Path(download.path()).read_bytes() == client.files.content(file_id).content
    expect(page.locator("#cancel")).to_be_hidden()  # nothing to cancel on a finished batch

    # a long batch: watch it run, then cancel it from its page
    long_id = submit(client, long_batch())
    page.click("header h1 a")
    row = page.locator(f'tr[data-batch-id="{long_id}"]')
    expect(row.locator(".status")).to_have_text("in_progress", timeout=LONG_S)
    expect(page.locator("#tile-running")).not_to_have_text("0", timeout=LONG_S)
    if shot := os.environ.get("BATCHMLX_DASHBOARD_SCREENSHOT"):
        bar = f'tr[data-batch-id="{long_id}"] [role=progressbar]'
        page.wait_for_function(  # a few finished requests and some chart to show
            f"() => Number(document.querySelector('{bar}')?.getAttribute('aria-valuenow')) >= 3",
            timeout=LONG_S,
        )  # fmt: skip
        page.screenshot(path=shot)
    row.locator(".id").click()
    expect(page.locator("#detail-status")).to_have_text("in_progress")
    page.click("#cancel")
    expect(page.locator("#detail-status")).to_have_text("cancelled", timeout=LONG_S)
    expect(page.locator("#timeline li").nth(2)).to_contain_text("cancelling")
    expect(page.locator("#cancel")).to_be_hidden()
    b = wait_batch(client, long_id)
    assert b.status == "cancelled" and b.request_counts.completed < b.request_counts.total

    # how long the page takes to show a status change made elsewhere (recorded, not asserted)
    third = submit(client, long_batch(50))
    page.click("header h1 a")
    status = page.locator(f'tr[data-batch-id="{third}"] .status')
    expect(status).to_have_text("in_progress", timeout=LONG_S)
    client.batches.cancel(third)
    changed = time.monotonic()
    page.wait_for_function(
        f"""() => ['cancelling', 'cancelled'].includes(
            document.querySelector('tr[data-batch-id="{third}"] .status')?.textContent)""",
        polling="raf", timeout=LONG_S,
    )  # fmt: skip
    latency = time.monotonic() - changed
    record_property("status_change_to_page_s", round(latency, 3))
    print(f"status change shown by the page after {latency:.3f}s")

    # the key never went into a URL or the server's log
    assert KEY not in page.url
    wait_batch(client, third)
    assert KEY not in server.log.read_text()
