"""The dashboard page in headless Chromium: it loads, shows live numbers that change after jobs
are submitted, raises no script or CSP error, and leaves a screenshot in test-artifacts/.

Needs Debian's ``chromium`` (``apt-get install -y chromium``) and Playwright for Python
(``pip install playwright``; its browser download, ``playwright install``, is not used).
Skipped when either is missing.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from rollq.consumer.engine import EchoEngine
from rollq.keys import QueueKeys
from tests.dashboard.test_dashboard import JOB, LOOP, rig  # noqa: F401 (rig: fixture)

pytestmark = [pytest.mark.browser, pytest.mark.asyncio(loop_scope=LOOP)]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("ROLLQ_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


@pytest.fixture
def playwright_api():
    try:
        from playwright.async_api import async_playwright, expect
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"chromium not found at {CHROMIUM} (apt-get install -y chromium, or set ROLLQ_CHROMIUM)")
    return async_playwright, expect


async def test_page_shows_live_numbers(queue, rig, playwright_api):  # noqa: F811 (rig)
    from rollq.weightsync.versions import VersionRecord, commit_version

    client = rig.client()
    keys = QueueKeys(queue)
    d = await rig.dashboard([queue], interval=0.5)
    for v in (1, 2):
        rec = VersionRecord(version=v, transport="memmap", checksum=f"c{v}", num_tensors=290, nbytes=3 << 30,
                            trainer="trainer-0")
        await commit_version(client, keys, rec)
    replicas = [rig.consumer(queue, engine=EchoEngine(delay_per_token=0.01), consumer_id=f"replica-{i}",
                             max_inflight=16, initial_inflight=16, heartbeat_interval=0.5, lease_ttl=10)
                for i in range(2)]  # a generous lease: Chromium starting up takes both cores for a while
    for c in replicas:
        c.version = 2
        rig.start(c)

    async_playwright, expect = playwright_api
    errors: list[str] = []
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            await page.goto(f"{d.url}/#{queue}")

            # locators, not wait_for_function: the page's CSP forbids eval
            await expect(page.locator("#totals")).to_contain_text("completed 0 ")
            await expect(page.locator("tr[data-replica='replica-1']")).to_have_count(1)
            await expect(page.locator("[data-k='version']")).to_have_text("2")

            # load: jobs arrive, the tiles and charts follow
            p = await rig.producer(queue)
            handles = await p.submit_many([{**JOB, "sampling": {"max_tokens": 10 + i % 40}} for i in range(300)])
            await expect(page.locator("[data-k='in_flight']")).not_to_have_text("0", timeout=15_000)
            await client.xadd(keys.jobs, {b"d": b"garbage"})  # a dead letter to show
            await p.gather(handles, timeout=60)
            await expect(page.locator("#totals")).to_contain_text("completed 300 ", timeout=15_000)
            await expect(page.locator("#dlq td.reason")).to_have_count(1)
            # a second wave, still running when the screenshot is taken
            await p.submit_many([{**JOB, "sampling": {"max_tokens": 60}}] * 150)
            await expect(page.locator("[data-k='in_flight']")).not_to_have_text("0", timeout=15_000)

            # what the page draws from the samples of both waves (each waits for it to show)
            await expect(page.locator("[data-k='p99']")).not_to_have_text(re.compile(r"^(|–)$"))
            await expect(page.locator("#replicas tbody tr")).to_have_count(2)
            await expect(page.locator("#replicas .badge.serving")).to_have_count(2)
            await expect(page.locator("#chart-rate path.line").first).to_be_attached()
            await expect(page.locator("#dlq td.reason").first).to_contain_text("msgpack")
            await expect(page.locator("#versions tbody tr")).to_have_count(2)
            await expect(page.locator("#status")).to_have_text(re.compile(r"^sampled"))
            await expect(page.locator("#status")).not_to_have_class(re.compile(r"\bbad\b"))

            out = ROOT / "test-artifacts"
            out.mkdir(exist_ok=True)
            await page.screenshot(path=str(out / "dashboard.png"), full_page=True)
        finally:
            await browser.close()
    assert not errors, errors
    assert (out / "dashboard.png").stat().st_size > 10_000
